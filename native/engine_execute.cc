// Running what negotiation decided: fused allreduce buckets and single collectives.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "collectives.h"
#include "engine.h"
#include "reduce_kernels.h"

namespace smddp {

namespace {
constexpr size_t kFusionAlign = 64;
size_t aligned(size_t n) { return (n + kFusionAlign - 1) / kFusionAlign * kFusionAlign; }

int64_t product(std::vector<int64_t>::const_iterator b, std::vector<int64_t>::const_iterator e) {
  int64_t n = 1;
  for (; b != e; ++b) n *= *b;
  return n;
}

std::string algorithm_span_name(const char* algo) {
  std::string s = "ALLREDUCE_";
  for (const char* p = algo; *p; ++p) s += char(std::toupper(*p));
  return s;
}
}  // namespace

std::string Engine::failure_text(const Entry& e, const std::string& error) {
  // A check-only entry stands for a CUDA call whose kind is in its name (gather and scatter
  // are negotiated as broadcasts): the name alone says which call failed.
  return (e.sig.check_only ? std::string() : std::string(op_type_name(e.sig.op)) + " ") + "'" + e.name +
         "' failed: " + error;
}

void Engine::execute(const Response& r) {
  std::vector<std::shared_ptr<Entry>> entries;
  for (const auto& re : r.entries) {
    auto it = pending_.find(re.name);
    if (it == pending_.end()) {
      if (r.is_error) continue;  // a stall error for a tensor this rank never submitted
      throw Error("internal: rank 0 scheduled tensor '" + re.name + "', which this rank has not queued");
    }
    auto e = it->second;
    pending_.erase(it);
    if (e->hit_id != Announcement::kNoCacheId) {  // run by a hit cycle, or failed while listed
      hit_entries_.erase(e->hit_id);
      unlisted_hits_.erase(std::remove(unlisted_hits_.begin(), unlisted_hits_.end(), e->hit_id), unlisted_hits_.end());
      e->hit_id = Announcement::kNoCacheId;
    }
    entries.push_back(e);
    // Learn the id rank 0 assigned so the next announcement of this tensor is 4 bytes.
    if (!r.is_error && !coordinator_) replica_.learn(re.cache_id, re.name, e->sig);
  }
  if (r.is_error) {
    for (auto& e : entries) complete(e, failure_text(*e, r.error));
    return;
  }
  if (r.sig.check_only) {  // every rank agreed; the data moves elsewhere (NCCL)
    for (auto& e : entries) complete(e, "");
    return;
  }
  const int64_t start = now_us();
  if (timeline_.enabled()) {
    for (auto& e : entries) {
      timeline_.span(e->name, "QUEUE", e->submit_us, e->announce_us);
      timeline_.span(e->name, "NEGOTIATE", e->announce_us, start);
    }
  }
  if (r.sig.op == OpType::kAllreduce) {
    execute_allreduce(r, entries);
  } else {
    execute_single(r, entries.front());
  }
  counters_.responses++;
  if (entries.size() > 1) {
    counters_.fused_responses++;
    counters_.fused_tensors += entries.size();
  }
  for (auto& e : entries) complete(e, "");
}

void Engine::execute_allreduce(const Response& r, std::vector<std::shared_ptr<Entry>>& entries) {
  const DType dtype = r.sig.dtype;
  const size_t es = dtype_size(dtype);
  const char* algo = "local";
  if (entries.size() == 1) {
    Entry& e = *entries.front();
    const size_t bytes = e.count * es;
    if (e.out != e.in) std::memcpy(e.out, e.in, bytes);
    scale_by(e.out, e.count, dtype, r.sig.prescale);
    const int64_t t0 = now_us();
    allreduce(*comm_, e.out, e.count, dtype, r.sig.reduce_op, &algo);
    scale_by(e.out, e.count, dtype, r.sig.postscale);
    if (timeline_.enabled()) timeline_.span(e.name, algorithm_span_name(algo).c_str(), t0, now_us());
    counters_.allreduce_bytes += bytes;
    return;
  }
  // Fused: pack into one buffer (each tensor 64-byte aligned), reduce once, unpack.
  size_t total = 0;
  for (auto& e : entries) total += aligned(e->count * es);
  if (fusion_buffer_.size() < total) fusion_buffer_.resize(total);
  char* buf = fusion_buffer_.data();
  const int64_t t0 = now_us();
  size_t off = 0;
  for (auto& e : entries) {
    std::memcpy(buf + off, e->in, e->count * es);
    std::memset(buf + off + e->count * es, 0, aligned(e->count * es) - e->count * es);
    off += aligned(e->count * es);
  }
  scale_by(buf, total / es, dtype, r.sig.prescale);
  const int64_t t1 = now_us();
  allreduce(*comm_, buf, total / es, dtype, r.sig.reduce_op, &algo);
  scale_by(buf, total / es, dtype, r.sig.postscale);
  const int64_t t2 = now_us();
  off = 0;
  for (auto& e : entries) {
    std::memcpy(e->out, buf + off, e->count * es);
    off += aligned(e->count * es);
  }
  const int64_t t3 = now_us();
  counters_.allreduce_bytes += total;
  if (timeline_.enabled()) {
    std::string args =
        "{\"fused_tensors\":" + std::to_string(entries.size()) + ",\"bytes\":" + std::to_string(total) + "}";
    for (auto& e : entries) {
      timeline_.span(e->name, "MEMCPY_IN_FUSION_BUFFER", t0, t1);
      timeline_.span(e->name, algorithm_span_name(algo).c_str(), t1, t2, args);
      timeline_.span(e->name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3);
    }
  }
}

void Engine::execute_single(const Response& r, const std::shared_ptr<Entry>& ep) {
  Entry& e = *ep;
  const Signature& sig = r.sig;
  const size_t es = dtype_size(sig.dtype);
  const int P = size();
  const int me = rank();
  const int64_t t0 = now_us();
  auto need_output = [&](size_t bytes) {
    if (!e.out) {
      e.owned_output.resize(bytes);
      e.out = e.owned_output.data();
    } else if (bytes > e.out_capacity) {
      throw Error(std::string(op_type_name(sig.op)) + " '" + e.name + "': the output buffer holds " +
                  std::to_string(e.out_capacity) + " bytes but the result needs " + std::to_string(bytes));
    }
  };
  switch (sig.op) {
    case OpType::kBroadcast: {
      if (e.out != e.in) std::memcpy(e.out, e.in, e.count * es);
      broadcast(*comm_, e.out, e.count * es, sig.root);
      break;
    }
    case OpType::kReduce:
      reduce(*comm_, e.in, e.out, e.count, sig.dtype, sig.reduce_op, sig.root);
      break;
    case OpType::kAllgather: {
      const int64_t row = product(sig.shape.begin() + (sig.shape.empty() ? 0 : 1), sig.shape.end()) * int64_t(es);
      std::vector<int64_t> bytes(P);
      e.result_counts.assign(P, 0);
      for (int q = 0; q < P; ++q) {
        e.result_counts[q] = r.per_rank.at(q).at(0);
        bytes[q] = e.result_counts[q] * row;
      }
      need_output(size_t(std::accumulate(bytes.begin(), bytes.end(), int64_t(0))));
      allgatherv(*comm_, e.in, e.out, bytes);
      break;
    }
    case OpType::kAlltoall: {
      const int64_t row = product(sig.shape.begin() + (sig.shape.empty() ? 0 : 1), sig.shape.end()) * int64_t(es);
      std::vector<int64_t> send(P), recv(P);
      e.result_counts.assign(P, 0);
      for (int q = 0; q < P; ++q) {
        if (r.per_rank.at(q).size() < size_t(P) + 1)  // sends to each rank, then the capacity
          throw Error("alltoall '" + e.name + "': rank " + std::to_string(q) + " gave " +
                      std::to_string(r.per_rank[q].size()) + " split sizes for " + std::to_string(P) + " ranks");
        send[q] = r.per_rank[me][q] * row;
        e.result_counts[q] = r.per_rank[q][me];
        recv[q] = e.result_counts[q] * row;
      }
      need_output(size_t(std::accumulate(recv.begin(), recv.end(), int64_t(0))));
      alltoallv(*comm_, e.in, send, e.out, recv);
      break;
    }
    case OpType::kReduceScatter: {
      std::vector<int64_t> counts = sig.splits;
      if (counts.empty()) counts.assign(P, int64_t(e.count) / P);
      need_output(size_t(counts[me]) * es);
      reduce_scatter(*comm_, e.in, e.out, counts, sig.dtype, sig.reduce_op);
      break;
    }
    case OpType::kBarrier:
      break;  // negotiation itself synchronised every rank
    default:
      throw Error("unknown collective in response");
  }
  if (timeline_.enabled()) {
    std::string span = op_type_name(sig.op);
    for (auto& c : span) c = char(std::toupper(c));
    timeline_.span(e.name, span.c_str(), t0, now_us());
  }
}

}  // namespace smddp
