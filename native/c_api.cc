// The engine's C interface (c_api.h): thin wrappers that turn the core's C++ calls into plain
// C ones, catching every exception at the boundary and handing its message back as text.
#include "c_api.h"

#include <cstring>
#include <memory>

#include "engine.h"
#include "nccl_group.h"

namespace smddp {

namespace {

void put_error(char* err, size_t err_len, const char* message) {
  if (err == nullptr || err_len == 0) return;
  std::strncpy(err, message, err_len - 1);
  err[err_len - 1] = '\0';
}

// Runs `fn`; on an exception writes its message and returns `failed`.
template <typename R, typename F>
R guarded(char* err, size_t err_len, R failed, F&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    put_error(err, err_len, e.what());
  } catch (...) {
    put_error(err, err_len, "unknown error in the smddp core");
  }
  return failed;
}

Signature to_signature(const smddp_signature* s) {
  if (s->op < 0 || s->op >= int32_t(OpType::kCount)) throw Error("unknown collective type " + std::to_string(s->op));
  if (s->dtype < 0 || s->dtype >= int32_t(DType::kCount)) throw Error("unknown dtype " + std::to_string(s->dtype));
  if (s->reduce_op < 0 || s->reduce_op >= int32_t(ReduceOp::kCount))
    throw Error("unknown reduce op " + std::to_string(s->reduce_op));
  Signature sig;
  sig.op = OpType(s->op);
  sig.dtype = DType(s->dtype);
  sig.reduce_op = ReduceOp(s->reduce_op);
  sig.root = s->root;
  sig.shape.assign(s->shape, s->shape + s->ndim);
  sig.splits.assign(s->splits, s->splits + s->nsplits);
  return sig;
}

DType to_dtype(int32_t d) {
  if (d < 0 || d >= int32_t(DType::kCount)) throw Error("unknown dtype " + std::to_string(d));
  return DType(d);
}

ReduceOp to_op(int32_t op) {
  if (op < 0 || op >= int32_t(ReduceOp::kCount)) throw Error("unknown reduce op " + std::to_string(op));
  return ReduceOp(op);
}

Engine* engine_of(void* e) { return static_cast<Engine*>(e); }
NcclGroup* group_of(void* g) { return static_cast<NcclGroup*>(g); }

// Events cross as heap-held shared pointers, so the pool they return to outlives them.
void* hand_out(std::shared_ptr<GpuEvent> event) { return new std::shared_ptr<GpuEvent>(std::move(event)); }
GpuEvent& event_of(void* e) { return **static_cast<std::shared_ptr<GpuEvent>*>(e); }

uint64_t engine_submit(void* engine, const char* name, const smddp_signature* sig, const void* in, void* out,
                       size_t count, size_t out_capacity, const int64_t* per_rank, size_t n_per_rank, char* err,
                       size_t err_len) {
  return guarded<uint64_t>(err, err_len, 0, [&] {
    std::vector<int64_t> ragged(per_rank, per_rank + n_per_rank);
    Engine* e = engine_of(engine);
    // The C interface serves c10d calls, which carry no names: they are matched by order.
    Signature s = to_signature(sig);
    s.caller = e->calling_thread();
    return e->submit(name, s, in, out, count, out_capacity, ragged);
  });
}

uint64_t engine_p2p(void* engine, int32_t is_send, int32_t peer, int64_t tag, void* buf, size_t bytes, char* err,
                    size_t err_len) {
  return guarded<uint64_t>(err, err_len, 0,
                           [&] { return engine_of(engine)->submit_p2p(is_send != 0, peer, tag, buf, bytes); });
}

int engine_wait_done(void* engine, uint64_t handle, double timeout_s) {
  try {
    return engine_of(engine)->wait_done(handle, timeout_s) ? 1 : 0;
  } catch (...) {
    return 1;  // nothing to wait for: the completion reports the failure
  }
}

int engine_wait(void* engine, uint64_t handle, double timeout_s, char* err, size_t err_len) {
  return guarded<int>(err, err_len, 1, [&] {
    engine_of(engine)->wait(handle, timeout_s);
    return 0;
  });
}

// The native frontends' completion channel (engine.h).
constexpr int kNativeChannel = 1;

void engine_watch(void* engine, uint64_t handle) {
  try {
    engine_of(engine)->watch(handle, kNativeChannel);
  } catch (...) {
    // An unknown handle was already waited on; there is nothing left to report.
  }
}

int engine_next_completions(void* engine, double timeout_s, smddp_completion_fn fn, void* context) {
  std::vector<uint64_t> done;
  try {
    done = engine_of(engine)->next_completions(timeout_s, kNativeChannel);
  } catch (...) {
    return 1;
  }
  for (uint64_t h : done) fn(context, h);
  // Shut down: what it failed has been reported (shutdown completes everything first).
  return done.empty() && engine_of(engine)->is_shut_down() ? 1 : 0;
}

void engine_counters(void* engine, uint64_t* submitted, uint64_t* cache_hits, uint64_t* cache_misses) {
  const Counters& c = engine_of(engine)->counters();
  *submitted = c.submitted.load();
  *cache_hits = c.cache_hits.load();
  *cache_misses = c.cache_misses.load();
}

void* nccl_allreduce_after(void* group, uintptr_t caller_stream, uintptr_t in, uintptr_t out, size_t count,
                           int32_t dtype, int32_t reduce_op, const int64_t* shape, size_t ndim, char* err,
                           size_t err_len) {
  return guarded<void*>(err, err_len, nullptr, [&] {
    std::vector<int64_t> dims(shape, shape + ndim);
    return hand_out(
        group_of(group)->allreduce_after(caller_stream, in, out, count, to_dtype(dtype), to_op(reduce_op), dims));
  });
}

int nccl_check(void* group, const char* kind, const smddp_signature* sig, char* err, size_t err_len) {
  return guarded<int>(err, err_len, 1, [&] {
    Signature s = to_signature(sig);
    group_of(group)->check(kind, s.op, s.dtype, s.shape, s.reduce_op, s.root);
    return 0;
  });
}

int nccl_wait_for(void* group, uintptr_t caller_stream, char* err, size_t err_len) {
  return guarded<int>(err, err_len, 1, [&] {
    group_of(group)->wait_for(caller_stream);
    return 0;
  });
}

int nccl_allgather(void* group, uintptr_t in, uintptr_t out, size_t count_per_rank, int32_t dtype, char* err,
                   size_t err_len) {
  return guarded<int>(err, err_len, 1, [&] {
    group_of(group)->allgather(in, out, count_per_rank, to_dtype(dtype));
    return 0;
  });
}

int nccl_reduce_scatter(void* group, uintptr_t in, uintptr_t out, size_t count_per_rank, int32_t dtype,
                        int32_t reduce_op, char* err, size_t err_len) {
  return guarded<int>(err, err_len, 1, [&] {
    group_of(group)->reduce_scatter(in, out, count_per_rank, to_dtype(dtype), to_op(reduce_op));
    return 0;
  });
}

int nccl_broadcast(void* group, uintptr_t in, uintptr_t out, size_t count, int32_t dtype, int32_t root, char* err,
                   size_t err_len) {
  return guarded<int>(err, err_len, 1, [&] {
    group_of(group)->broadcast(in, out, count, to_dtype(dtype), root);
    return 0;
  });
}

void* nccl_record(void* group, char* err, size_t err_len) {
  return guarded<void*>(err, err_len, nullptr, [&] { return hand_out(group_of(group)->record()); });
}

size_t nccl_error(void* group, char* buf, size_t buf_len) {
  std::string message = group_of(group)->error();
  if (!message.empty()) put_error(buf, buf_len, message.c_str());
  return message.size();
}

uintptr_t nccl_stream(void* group) { return group_of(group)->stream(); }

int event_block(void* event, uintptr_t stream, char* err, size_t err_len) {
  return guarded<int>(err, err_len, 1, [&] {
    event_of(event).block(stream);
    return 0;
  });
}

int event_query(void* event) {
  try {
    return event_of(event).query() ? 1 : 0;
  } catch (...) {
    return 1;  // a failed event is finished; the group's error says why
  }
}

void event_synchronize(void* event) {
  try {
    event_of(event).synchronize();
  } catch (...) {
  }
}

void event_release(void* event) { delete static_cast<std::shared_ptr<GpuEvent>*>(event); }

}  // namespace

const smddp_c_api* c_api() {
  static const smddp_c_api api = {
      SMDDP_C_API_VERSION, sizeof(smddp_c_api),  engine_submit,
      engine_wait,         engine_watch,         engine_next_completions,
      engine_counters,     nccl_allreduce_after, nccl_check,
      nccl_wait_for,       nccl_allgather,       nccl_reduce_scatter,
      nccl_broadcast,      nccl_record,          nccl_error,
      nccl_stream,         event_block,          event_query,
      event_synchronize,   event_release,        engine_p2p,
      engine_wait_done,
  };
  return &api;
}

}  // namespace smddp
