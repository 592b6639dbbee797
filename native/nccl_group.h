// The NCCL data plane for CUDA tensors: one communicator per process group, bootstrapped by
// a unique id the frontend passes through its rendezvous (rank 0 makes it, the others read
// it from the store), so GPU jobs need nothing beyond what the CPU path needs.
//
// Stream discipline, as in c10d's NCCL backend: collectives run on the group's own stream.
// Before each batch of work that stream waits (on the GPU, through an event) for everything
// the caller's stream has queued, and after it an event marks the batch's end; the caller's
// stream later waits on that event. The host never blocks on the GPU on this path.
//
// A watchdog thread follows every recorded batch: when NCCL reports an asynchronous error,
// or a batch has not finished within the timeout (a dead peer, or a rank that skipped a
// collective), it aborts the communicator so that no kernel spins forever, prints why on
// this rank, and every later call raises that reason.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "engine.h"
#include "gpu_runtime.h"

namespace smddp {

// Events are reused: creating one per collective costs microseconds on the latency path.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool();
  gpu::Event take();
  void give(gpu::Event e);

 private:
  int device_;
  std::mutex mutex_;
  std::vector<gpu::Event> free_;
};

// The end of a batch of GPU work on a group's stream.
class GpuEvent {
 public:
  GpuEvent(std::shared_ptr<EventPool> pool, gpu::Event event) : pool_(std::move(pool)), event_(event) {}
  ~GpuEvent();
  GpuEvent(const GpuEvent&) = delete;
  GpuEvent& operator=(const GpuEvent&) = delete;

  // Makes `stream` (a cudaStream_t as an integer; 0 = the legacy default stream) wait for it.
  void block(uintptr_t stream) const;
  bool query() const;        // finished?
  void synchronize() const;  // host waits (for tests and shutdown; not the hot path)
  gpu::Event raw() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  gpu::Event event_;
};

struct NcclOptions {
  int max_ctas = gpu::NcclConfig::kUndefined;
  int min_ctas = gpu::NcclConfig::kUndefined;
  double timeout_s = 1800;
};

class NcclGroup {
 public:
  static std::string make_unique_id();  // 128 bytes, made on one rank, read by all
  // Collective over the ranks holding the same id: every rank of the group constructs it.
  NcclGroup(const std::string& unique_id, int rank, int size, int device, const NcclOptions& options);
  ~NcclGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  // The cap on thread blocks this communicator was made with, 0 when NCCL chose (or the
  // library is older than 2.17, whose config call is absent).
  int max_ctas() const;
  uintptr_t stream() const { return reinterpret_cast<uintptr_t>(stream_); }
  int nccl_version() const;

  // Order this group's stream after everything already queued on `caller`.
  void wait_for(uintptr_t caller);
  // Enqueued on the group's stream; counts in elements of `dtype`.
  void allreduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op);
  void broadcast(uintptr_t in, uintptr_t out, size_t count, DType dtype, int root);
  void reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, int root);
  void allgather(uintptr_t in, uintptr_t out, size_t count_per_rank, DType dtype);
  void reduce_scatter(uintptr_t in, uintptr_t out, size_t count_per_rank, DType dtype, ReduceOp op);
  void send(uintptr_t buf, size_t count, DType dtype, int peer);
  void recv(uintptr_t buf, size_t count, DType dtype, int peer);
  // Between these, NCCL calls are fused into one launch (coalesced ops, all-to-all).
  void group_start();
  void group_end();
  // An event after everything enqueued so far; the watchdog follows it too.
  std::shared_ptr<GpuEvent> record();
  // The latency path of the most common call, in one crossing: wait_for, allreduce, record.
  std::shared_ptr<GpuEvent> allreduce_after(uintptr_t caller, uintptr_t in, uintptr_t out, size_t count, DType dtype,
                                            ReduceOp op, const std::vector<int64_t>& shape);

  // Argument checks: the frontend negotiates each collective's signature through the CPU
  // engine (check_only) while NCCL runs it; when ranks disagree, or a peer dies, the engine
  // fails the check and the watchdog aborts the communicator with the engine's message, so
  // a mismatched call raises on every rank instead of hanging in NCCL.
  void attach_engine(Engine* engine);
  // Negotiates one collective's signature (named by kind and call order, see checks_per_kind_);
  // no-op until an engine is attached.
  void check(const char* kind, OpType op, DType dtype, const std::vector<int64_t>& shape, ReduceOp reduce, int root);

  // A check whose name's earlier holder is not yet agreed (this rank is more than
  // kCheckNameWindow calls of one kind ahead of a peer) is queued, in call order, and submitted
  // by a later check() or by the watchdog once that holder is agreed; the collective itself goes
  // ahead, as it would on NCCL alone. Only with SMDDP_CUDA_CHECK_BACKLOG checks queued does the
  // calling thread wait. check_waits: how often, and for how long in all, a caller waited;
  // checks_deferred: how many checks were queued.
  uint64_t check_waits() const { return check_waits_; }
  uint64_t check_wait_us() const { return check_wait_us_; }
  uint64_t checks_deferred() const { return checks_deferred_; }

  std::string error() const;
  void abort(const std::string& reason);
  void shutdown();  // waits for queued work, then destroys the communicator

 private:
  void check_usable() const;
  void run(int code, const char* what);
  void watchdog();
  // Submits queued checks from the front while their names are free, until `keep` remain;
  // waits up to `wait_s` for each name (0: not at all, -1: as long as it takes). Caller holds
  // submit_mutex_.
  void drain_deferred(Engine* engine, size_t keep, double wait_s);
  bool name_free(Engine* engine, const std::string& name, double wait_s);  // earlier holder agreed?
  void submit_check(Engine* engine, const std::string& name, const Signature& sig);

  int rank_, size_, device_;
  NcclOptions options_;
  gpu::NcclComm comm_ = nullptr;
  gpu::Stream stream_ = nullptr;
  gpu::Event ready_ = nullptr;  // recorded on callers' streams by wait_for()
  std::shared_ptr<EventPool> events_;
  uint64_t batches_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  struct Outstanding {
    std::shared_ptr<GpuEvent> event;
    uint64_t batch;
    int64_t enqueued_us;
  };
  std::deque<Outstanding> outstanding_;
  Engine* engine_ = nullptr;
  // Checks are named cuda.<kind>#<k mod kCheckNameWindow> (k: calls of that kind so far, the
  // same on every rank), so a repeating step repeats its names and the engine's response cache
  // answers them by id; the last handle of each name, to wait on before reusing it.
  // Naming and submitting checks is serialized by submit_mutex_ (taken before mutex_, never
  // after): two threads must not submit two holders of one name, nor reorder the queue.
  std::mutex submit_mutex_;
  std::unordered_map<std::string, uint64_t> checks_per_kind_;     // guarded by submit_mutex_
  std::unordered_map<std::string, uint64_t> last_check_of_name_;  // guarded by submit_mutex_
  struct DeferredCheck {
    std::string name;
    Signature sig;
  };
  std::deque<DeferredCheck> deferred_;     // guarded by submit_mutex_
  std::atomic<size_t> deferred_count_{0};  // deferred_.size(), for the watchdog's polling
  std::deque<uint64_t> checks_;            // submitted, not yet seen agreed (guarded by mutex_)
  std::atomic<uint64_t> check_waits_{0}, check_wait_us_{0}, checks_deferred_{0};
  std::string error_;
  bool stop_ = false;
  bool destroyed_ = false;
  bool aborted_ = false;  // ncclCommAbort already ran (it frees the communicator)
  std::thread watchdog_;
};

}  // namespace smddp
