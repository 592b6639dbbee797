#include "nccl_group.h"

#include <chrono>

namespace smddp {

namespace {

// ncclDataType_t codes. bool travels as uint8 (0/1), as torch's NCCL backend does.
int nccl_dtype(DType t) {
  switch (t) {
    case DType::kInt8:
      return 0;
    case DType::kUInt8:
      return 1;
    case DType::kBool:
      return 1;
    case DType::kInt32:
      return 2;
    case DType::kInt64:
      return 4;
    case DType::kFloat16:
      return 6;
    case DType::kFloat32:
      return 7;
    case DType::kFloat64:
      return 8;
    case DType::kBFloat16:
      return 9;
    default:
      break;
  }
  throw Error(std::string("NCCL has no type for ") + dtype_name(t));
}

// ncclRedOp_t codes. On bool, SUM is logical or (max of 0/1) and PRODUCT logical and (min),
// as the CPU path computes them.
int nccl_op(ReduceOp op, DType t) {
  if (t == DType::kBool) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMax:
        return 2;
      case ReduceOp::kProduct:
      case ReduceOp::kMin:
        return 3;
      default:
        throw Error(std::string(reduce_op_name(op)) + " is not defined for bool tensors");
    }
  }
  switch (op) {
    case ReduceOp::kSum:
      return 0;
    case ReduceOp::kProduct:
      return 1;
    case ReduceOp::kMax:
      return 2;
    case ReduceOp::kMin:
      return 3;
    case ReduceOp::kAverage:
      return 4;
    default:
      break;
  }
  throw Error("unknown reduce op");
}

constexpr int kNcclInProgress = 7;

}  // namespace

EventPool::~EventPool() {
  for (auto e : free_) gpu::runtime().cudaEventDestroy(e);
}

gpu::Event EventPool::take() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      gpu::Event e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  gpu::DeviceGuard guard(device_);
  gpu::Event e = nullptr;
  gpu::check_cuda(gpu::runtime().cudaEventCreateWithFlags(&e, gpu::kEventDisableTiming), "cudaEventCreate");
  return e;
}

void EventPool::give(gpu::Event e) {
  // Re-recording an event that has not fired yet is allowed: waits already enqueued on it
  // keep the old point, as CUDA captures an event's state when a wait is enqueued.
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(e);
}

GpuEvent::~GpuEvent() {
  if (event_) pool_->give(event_);
}

void GpuEvent::block(uintptr_t stream) const {
  gpu::check_cuda(gpu::runtime().cudaStreamWaitEvent(reinterpret_cast<gpu::Stream>(stream), event_, 0),
                  "cudaStreamWaitEvent");
}

bool GpuEvent::query() const {
  int rc = gpu::runtime().cudaEventQuery(event_);
  if (rc == gpu::kCudaErrorNotReady) return false;
  gpu::check_cuda(rc, "cudaEventQuery");
  return true;
}

void GpuEvent::synchronize() const {
  gpu::check_cuda(gpu::runtime().cudaEventSynchronize(event_), "cudaEventSynchronize");
}

std::string NcclGroup::make_unique_id() {
  gpu::NcclUniqueId id;
  gpu::check_nccl(gpu::runtime().ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

NcclGroup::NcclGroup(const std::string& unique_id, int rank, int size, int device, const NcclOptions& options)
    : rank_(rank), size_(size), device_(device), options_(options) {
  const gpu::Runtime& r = gpu::runtime();
  if (unique_id.size() != sizeof(gpu::NcclUniqueId))
    throw Error("NCCL unique id has " + std::to_string(unique_id.size()) + " bytes, expected 128");
  gpu::NcclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  gpu::DeviceGuard guard(device_);
  int least = 0, greatest = 0;
  gpu::check_cuda(r.cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  // The lowest priority, as torch's NCCL backend's pool streams: compute kernels go first.
  gpu::check_cuda(r.cudaStreamCreateWithPriority(&stream_, gpu::kStreamNonBlocking, least),
                  "cudaStreamCreateWithPriority");
  gpu::check_cuda(r.cudaEventCreateWithFlags(&ready_, gpu::kEventDisableTiming), "cudaEventCreate");
  events_ = std::make_shared<EventPool>(device_);
  const bool configured =
      options_.max_ctas != gpu::NcclConfig::kUndefined || options_.min_ctas != gpu::NcclConfig::kUndefined;
  if (configured && r.ncclCommInitRankConfig) {
    gpu::NcclConfig config;
    config.max_ctas = options_.max_ctas;
    config.min_ctas = options_.min_ctas;
    gpu::check_nccl(r.ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), "ncclCommInitRankConfig");
  } else {
    gpu::check_nccl(r.ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
  }
  watchdog_ = std::thread([this] { watchdog(); });
}

NcclGroup::~NcclGroup() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  // Without shutdown() (the interpreter is exiting) the communicator is left to the process's
  // end: destroying it may need a CUDA context that is already gone.
}

int NcclGroup::max_ctas() const {
  if (options_.max_ctas == gpu::NcclConfig::kUndefined || !gpu::runtime().ncclCommInitRankConfig) return 0;
  return options_.max_ctas;
}

int NcclGroup::nccl_version() const { return gpu::runtime().nccl_version; }

std::string NcclGroup::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void NcclGroup::check_usable() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_.empty()) throw Error(error_);
  if (destroyed_) throw Error("the NCCL communicator of this group was shut down");
}

void NcclGroup::run(int code, const char* what) {
  if (code == 0 || code == kNcclInProgress) return;
  gpu::check_nccl(code, what);
}

void NcclGroup::wait_for(uintptr_t caller) {
  check_usable();
  const gpu::Runtime& r = gpu::runtime();
  gpu::check_cuda(r.cudaEventRecord(ready_, reinterpret_cast<gpu::Stream>(caller)), "cudaEventRecord");
  gpu::check_cuda(r.cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
}

void NcclGroup::allreduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op) {
  check_usable();
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclAllReduce(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count,
                                   nccl_dtype(dtype), nccl_op(op, dtype), comm_, stream_),
      "ncclAllReduce");
}

void NcclGroup::broadcast(uintptr_t in, uintptr_t out, size_t count, DType dtype, int root) {
  check_usable();
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclBroadcast(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count,
                                   nccl_dtype(dtype), root, comm_, stream_),
      "ncclBroadcast");
}

void NcclGroup::reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, int root) {
  check_usable();
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclReduce(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count,
                                nccl_dtype(dtype), nccl_op(op, dtype), root, comm_, stream_),
      "ncclReduce");
}

void NcclGroup::allgather(uintptr_t in, uintptr_t out, size_t count_per_rank, DType dtype) {
  check_usable();
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclAllGather(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count_per_rank,
                                   nccl_dtype(dtype), comm_, stream_),
      "ncclAllGather");
}

void NcclGroup::reduce_scatter(uintptr_t in, uintptr_t out, size_t count_per_rank, DType dtype, ReduceOp op) {
  check_usable();
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclReduceScatter(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count_per_rank,
                                       nccl_dtype(dtype), nccl_op(op, dtype), comm_, stream_),
      "ncclReduceScatter");
}

void NcclGroup::send(uintptr_t buf, size_t count, DType dtype, int peer) {
  check_usable();
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclSend(reinterpret_cast<const void*>(buf), count, nccl_dtype(dtype), peer, comm_, stream_),
      "ncclSend");
}

void NcclGroup::recv(uintptr_t buf, size_t count, DType dtype, int peer) {
  check_usable();
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclRecv(reinterpret_cast<void*>(buf), count, nccl_dtype(dtype), peer, comm_, stream_),
      "ncclRecv");
}

void NcclGroup::group_start() { run(gpu::runtime().ncclGroupStart(), "ncclGroupStart"); }

void NcclGroup::group_end() {
  gpu::DeviceGuard guard(device_);
  run(gpu::runtime().ncclGroupEnd(), "ncclGroupEnd");
}

std::shared_ptr<GpuEvent> NcclGroup::record() {
  check_usable();
  auto event = std::make_shared<GpuEvent>(events_, events_->take());
  gpu::check_cuda(gpu::runtime().cudaEventRecord(event->raw(), stream_), "cudaEventRecord");
  bool was_idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    was_idle = outstanding_.empty();
    outstanding_.push_back({event, ++batches_, now_us()});
  }
  if (was_idle) cv_.notify_all();  // otherwise the watchdog is already polling
  return event;
}

std::shared_ptr<GpuEvent> NcclGroup::allreduce_after(uintptr_t caller, uintptr_t in, uintptr_t out, size_t count,
                                                     DType dtype, ReduceOp op, const std::vector<int64_t>& shape) {
  check("allreduce", OpType::kAllreduce, dtype, shape, op, 0);
  wait_for(caller);
  allreduce(in, out, count, dtype, op);
  return record();
}

void NcclGroup::attach_engine(Engine* engine) {
  std::lock_guard<std::mutex> lock(mutex_);
  engine_ = engine;
}

namespace {
constexpr uint64_t kCheckNameWindow = 16;

// The engine refuses a name twice in flight, so a name is reused only after its earlier holder
// is agreed (Engine::wait_done counts a handle the watchdog already released as finished).
// Every rank reaches the same name at the same call, so the queue below forms at the same call
// on a rank that is ahead, and empties as its peers catch up.
}  // namespace

void NcclGroup::check(const char* kind, OpType op, DType dtype, const std::vector<int64_t>& shape, ReduceOp reduce,
                      int root) {
  Engine* engine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    engine = engine_;
  }
  if (!engine) return;
  Signature sig;
  sig.op = op;
  sig.dtype = dtype;
  sig.reduce_op = reduce;
  sig.root = root;
  sig.shape = shape;
  sig.check_only = true;
  sig.caller = engine->calling_thread();  // this thread's number, even if the watchdog submits it
  std::lock_guard<std::mutex> submitting(submit_mutex_);
  std::string name = std::string("cuda.") + kind + "#" + std::to_string(checks_per_kind_[kind]++ % kCheckNameWindow);
  drain_deferred(engine, 0, 0);  // names are submitted in call order: the queue goes first
  if (deferred_.empty() && name_free(engine, name, 0)) {
    submit_check(engine, name, sig);
    return;
  }
  checks_deferred_++;
  deferred_.push_back({std::move(name), std::move(sig)});
  drain_deferred(engine, size_t(engine->config().cuda_check_backlog), -1);  // waits only past the limit
  if (deferred_count_) cv_.notify_all();  // the watchdog submits the rest as names free up
}

bool NcclGroup::name_free(Engine* engine, const std::string& name, double wait_s) {
  auto it = last_check_of_name_.find(name);
  return it == last_check_of_name_.end() || engine->wait_done(it->second, wait_s);
}

void NcclGroup::drain_deferred(Engine* engine, size_t keep, double wait_s) {
  while (deferred_.size() > keep) {
    DeferredCheck& front = deferred_.front();
    if (!name_free(engine, front.name, 0)) {
      if (wait_s == 0) break;
      const int64_t start = now_us();
      const bool free = name_free(engine, front.name, wait_s);
      check_waits_++;
      check_wait_us_ += uint64_t(now_us() - start);
      if (!free) break;
    }
    submit_check(engine, front.name, front.sig);
    deferred_.pop_front();
  }
  deferred_count_ = deferred_.size();
}

void NcclGroup::submit_check(Engine* engine, const std::string& name, const Signature& sig) {
  const uint64_t handle = engine->submit(name, sig, nullptr, nullptr, 0, 0, {});
  last_check_of_name_[name] = handle;
  bool was_idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    was_idle = checks_.empty() && outstanding_.empty() && !deferred_count_;
    checks_.push_back(handle);
  }
  if (was_idle) cv_.notify_all();
}

void NcclGroup::abort(const std::string& reason) {
  gpu::NcclComm comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_.empty() || destroyed_) return;
    error_ = reason;
    comm = comm_;
    aborted_ = comm != nullptr;
  }
  SMDDP_LOG(0, "NCCL group aborted: " + reason);
  // Makes NCCL's kernels on this rank return, so the caller's stream drains instead of hanging.
  if (comm) gpu::runtime().ncclCommAbort(comm);
}

namespace {
constexpr double kNamedFailureGraceS = 2.0;
}  // namespace

void NcclGroup::watchdog() {
  gpu::runtime().cudaSetDevice(device_);  // this thread's own; the caller's device is untouched
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if ((outstanding_.empty() && checks_.empty() && !deferred_count_) || !error_.empty()) {
      cv_.wait(lock);
      continue;
    }
    // Checks pending: poll often enough to raise a failed check within milliseconds, not so
    // often that this thread competes with the one issuing the step's GPU work. Queued checks
    // wait for a peer's agreement, which frees their names: submit them soon after.
    cv_.wait_for(lock, std::chrono::milliseconds(deferred_count_ ? 1 : checks_.empty() ? 20 : 5));
    if (deferred_count_ && engine_ && error_.empty()) {
      Engine* engine = engine_;
      lock.unlock();  // submit_mutex_ comes before mutex_; never wait for a caller that holds it
      std::string failed;
      {
        std::unique_lock<std::mutex> submitting(submit_mutex_, std::try_to_lock);
        if (submitting.owns_lock()) {
          try {
            drain_deferred(engine, 0, 0);
          } catch (const std::exception& e) {
            failed = e.what();
          }
        }
      }
      if (!failed.empty()) abort("an argument check could not be submitted: " + failed);
      lock.lock();
    }
    while (!outstanding_.empty() && outstanding_.front().event->query()) outstanding_.pop_front();
    std::string reason;
    while (reason.empty() && !checks_.empty() && engine_) {
      try {
        if (!engine_->poll(checks_.front())) break;
        engine_->wait(checks_.front(), 0);
      } catch (const std::exception& e) {
        reason = e.what();
      }
      checks_.pop_front();
    }
    if (reason.empty() && !destroyed_ && comm_) {
      int async = 0;
      gpu::runtime().ncclCommGetAsyncError(comm_, &async);
      if (async != 0 && async != kNcclInProgress)
        reason = "NCCL reported an asynchronous error (" + std::string(gpu::runtime().ncclGetErrorString(async)) +
                 ") on rank " + std::to_string(rank_) + ": a peer failed or its connection broke";
    }
    if (reason.empty() && !outstanding_.empty()) {
      const double waited = (now_us() - outstanding_.front().enqueued_us) / 1e6;
      // A rank that stopped before calling shows up in the argument checks, which name it
      // at the same timeout: while checks are pending, give them the first word.
      const double grace = engine_ && !checks_.empty() ? kNamedFailureGraceS : 0.0;
      if (waited > options_.timeout_s + grace)
        reason = "NCCL collective batch #" + std::to_string(outstanding_.front().batch) + " on rank " +
                 std::to_string(rank_) + " did not finish within " + std::to_string(int(options_.timeout_s)) +
                 " s: a peer rank died, hangs, or did not call the same collective";
    }
    if (!reason.empty()) {
      lock.unlock();
      abort(reason);
      lock.lock();
    }
  }
}

void NcclGroup::shutdown() {
  std::shared_ptr<GpuEvent> last;
  bool failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (destroyed_) return;
    failed = !error_.empty();
    if (!outstanding_.empty()) last = outstanding_.back().event;
  }
  // Queued work finishes first (bounded: a peer that never joins makes us abort instead).
  const int64_t deadline = now_us() + int64_t(std::min(options_.timeout_s, 30.0) * 1e6);
  // Queued checks too: peers wait for them under their names.
  Engine* engine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    engine = engine_;
  }
  if (!failed && engine) {
    std::lock_guard<std::mutex> submitting(submit_mutex_);
    try {
      while (!deferred_.empty() && now_us() < deadline) drain_deferred(engine, 0, 0.001);
    } catch (const std::exception&) {
      failed = true;
    }
    deferred_.clear();
    deferred_count_ = 0;
  }
  while (!failed && last && !last->query()) {
    if (now_us() > deadline) {
      failed = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    destroyed_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  const gpu::Runtime& r = gpu::runtime();
  gpu::DeviceGuard guard(device_);
  // A communicator the watchdog aborted is already freed.
  if (comm_ && !aborted_) (failed ? r.ncclCommAbort(comm_) : r.ncclCommDestroy(comm_));
  comm_ = nullptr;
  if (ready_) r.cudaEventDestroy(ready_);
  ready_ = nullptr;
  // The stream stays: the framework's caching allocator may still record events on it for
  // tensors this group used (record_stream) as they are freed, up to the process's end.
}

}  // namespace smddp
