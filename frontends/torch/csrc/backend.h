// The smddp c10d Backend: torch's per-device Backend interface over the native engine (CPU
// tensors) and the core's NCCL group (CUDA tensors), built against the torch the user runs.
//
// The calls a training step makes (allreduce, all_gather_into_tensor, reduce_scatter_tensor on
// contiguous tensors) go from DDP's reducer or FSDP to the engine without Python or the GIL.
// Everything else, and every argument these fast paths do not take, is handed to the Python
// implementation of the group (process_group.py), which validates it and names what is wrong.
// The Python side also owns the group's engine and NCCL communicator and makes them on first
// use, so a group costs nothing until it is used on a device.
#pragma once

#include <torch/python.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "c_api.h"

namespace __attribute__((visibility("hidden"))) smddp_torch {

  namespace py = pybind11;

  // The core's C interface, read once from the `_core` capsule at import.
  const smddp_c_api& core();
  void load_core(py::capsule capsule);

  // An error message from the core, as a C string buffer.
  struct ErrorText {
    char text[2048] = {0};
  };

  class CpuWork;

  // A group's CPU engine, kept alive (with the Python object that owns it) by every Work that
  // uses it, and the thread that completes those Works as the engine finishes them.
  class EngineLink {
   public:
    EngineLink(void* engine, py::object owner);
    ~EngineLink();
    void* engine() const { return engine_; }
    // The Work is kept (with its buffers) until every handle has completed. Nothing wakes the
    // completion thread for it until watch(): a Work that is waited on completes on the
    // waiting thread (woken by the engine), one never waited on within 0.2 s of the engine
    // finishing it (the thread's sweep). A wake-up per operation cost send/recv 2x its latency.
    void track(const c10::intrusive_ptr<CpuWork>& work, const std::vector<uint64_t>& handles);
    // The completion thread completes these as soon as the engine finishes them (futures).
    // The thread starts with the first watch: a group whose Works are only waited on (or
    // polled, or dropped) never has one.
    void watch(const std::vector<uint64_t>& handles);
    // Hands a finished operation's result to its Work now, from the calling thread, unless
    // another thread already has (whichever comes first does it, once).
    void finish(uint64_t handle) { on_completion(this, handle); }
    // Ends the completion thread once the engine has handed back every tracked operation.
    void stop();
    // At interpreter exit (atexit, before finalization): ends every link's thread now, failing
    // what is still pending, while futures' Python callbacks can still take the GIL. A thread
    // that reached Python during finalization would be killed inside C++ and abort the process.
    static void stop_all_at_exit();

   private:
    void run();
    void start_thread();
    // Completes every unwatched operation that the engine has finished.
    void sweep();
    // Without a thread: hands what the engine finishes to its Works, waiting for each unless
    // abandoning, and fails the rest.
    void finish_without_thread();
    static void on_completion(void* self, uint64_t handle);

    void* engine_;
    py::object owner_;
    std::mutex mutex_;
    std::unordered_map<uint64_t, c10::intrusive_ptr<CpuWork>> works_;
    std::atomic<bool> stop_{false};
    std::atomic<bool> abandon_{false};    // exiting: do not wait for pending operations
    std::atomic<uint64_t> completed_{0};  // by on_completion, from any thread
    std::mutex thread_mutex_;             // guards starting, joining and detaching thread_
    std::atomic<bool> thread_started_{false};
    std::thread thread_;
  };

  // One collective on CPU tensors: engine handles, completed by the EngineLink's thread.
  class CpuWork : public c10d::Work {
   public:
    CpuWork(std::shared_ptr<EngineLink> link, c10d::OpType type, std::vector<at::Tensor> outputs,
            std::vector<at::Tensor> keep, std::vector<uint64_t> handles);
    bool wait(std::chrono::milliseconds timeout) override;
    bool isCompleted() override;
    bool isSuccess() const override;
    std::exception_ptr exception() const override;
    std::vector<at::Tensor> result() override;
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
    // One handle finished (error empty on success); from whichever thread took its result.
    void handle_done(const std::string& error);
    // Waits until every handle finished, without raising its error (that is the Work's owner's).
    void wait_quietly();
    bool watched() const { return watched_.load(); }

   private:
    // Waits for the engine to finish every handle (seconds < 0: no limit; 0: a poll) and takes
    // their results on this thread; whether all were finished in time.
    bool take_results(double seconds);
    std::shared_ptr<EngineLink> link_;
    const std::vector<uint64_t> handles_;
    std::atomic<bool> watched_{false};
    std::vector<at::Tensor> outputs_;
    std::vector<at::Tensor> keep_;  // inputs and staging the engine reads or writes
    size_t remaining_;
    std::string error_;
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    c10::intrusive_ptr<c10::ivalue::Future> future_;
  };

  // A group's NCCL communicator on one device, and the stream it runs on as torch sees it.
  struct CudaLink {
    CudaLink(void* group, c10::Stream stream, py::object owner);
    ~CudaLink();
    void* group;
    c10::Stream stream;
    py::object owner;
    std::string error() const;
  };

  // One batch of NCCL work: an event on the group's stream.
  class CudaWork : public c10d::Work {
   public:
    CudaWork(std::shared_ptr<CudaLink> link, c10d::OpType type, void* event, std::vector<at::Tensor> outputs);
    ~CudaWork() override;
    bool wait(std::chrono::milliseconds timeout) override;
    void synchronize() override;
    bool isCompleted() override;
    bool isSuccess() const override;
    std::exception_ptr exception() const override;
    std::vector<at::Tensor> result() override;
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

   private:
    std::shared_ptr<CudaLink> link_;
    void* event_;
    std::vector<at::Tensor> outputs_;
    c10::intrusive_ptr<c10::ivalue::Future> future_;
  };

  // The group's options as torch's split_group copies them (copy.deepcopy(backend.options)).
  struct OptionsSMDDP : c10d::Backend::Options {
    explicit OptionsSMDDP(std::chrono::milliseconds timeout) : Options("smddp", timeout) {}
  };

  // A Work the Python implementation returned. It keeps the Python object alive as long as
  // torch holds the Work, and answers every question through it (torch's own holder forwards
  // only wait and get_future; is_completed would read the empty C++ base).
  class DelegatedWork : public c10d::Work {
   public:
    explicit DelegatedWork(py::object work);
    ~DelegatedWork() override;
    bool wait(std::chrono::milliseconds timeout) override;
    bool isCompleted() override;
    bool isSuccess() const override;
    std::exception_ptr exception() const override;
    std::vector<at::Tensor> result() override;
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

   private:
    c10::intrusive_ptr<c10d::Work> work_;  // the Python Work, through torch's trampoline
    py::object py_;
  };

  class BackendSMDDP : public c10d::Backend {
   public:
    // `impl`: the group's Python implementation (ProcessGroupSMDDP).
    BackendSMDDP(py::object impl, int rank, int size, std::chrono::milliseconds timeout);
    ~BackendSMDDP() override;

    const std::string getBackendName() const override { return "smddp"; }
    c10::intrusive_ptr<Options> getBackendOptions() override;
    bool supportsSplitting() const override { return true; }
    void setSequenceNumberForGroup() override {}
    uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }

    c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::ReduceScatterOptions& opts) override;

    // Handed to the Python implementation.
    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceCoalescedOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const c10d::AllgatherOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::AllgatherOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                           std::vector<std::vector<at::Tensor>>& inputs,
                                           const c10d::ScatterOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const c10d::ReduceScatterOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_splits,
                                                 std::vector<int64_t>& input_splits,
                                                 const c10d::AllToAllOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                            const c10d::AllToAllOptions& opts) override;
    c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
    c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
    c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
    c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
    c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                            const c10::intrusive_ptr<Options>& opts) override;
    void shutdown() override;
    void abort() override;

    py::object impl() const { return impl_; }
    // Submissions the engine answered from its response cache, and in full (for tests and tools).
    std::vector<uint64_t> engine_counters();

   private:
    // Calls the Python implementation's method of the same name; its Work is returned as is.
    template <typename... Args>
    c10::intrusive_ptr<c10d::Work> delegate(const char* method, Args&&... args);
    std::shared_ptr<EngineLink> cpu();  // made on first use
    // Made on first use, on t's device; null when the group's ranks share a GPU (no NCCL there).
    std::shared_ptr<CudaLink> cuda(const at::Tensor& t);
    std::string next_name(const char* kind);
    // A name that repeats from step to step (see backend.cc), waiting first for this rank's
    // previous operation of that name.
    std::string reusable_name(const char* kind);
    c10::intrusive_ptr<c10d::Work> submit_cpu(c10d::OpType type, const char* kind, const std::vector<at::Tensor>& ins,
                                              const std::vector<at::Tensor>& outs,
                                              const std::vector<smddp_signature>& sigs,
                                              const std::vector<std::vector<int64_t>>& per_rank,
                                              std::vector<at::Tensor> results, std::vector<at::Tensor> keep);
    // send or recv of one contiguous CPU tensor, through the engine.
    c10::intrusive_ptr<c10d::Work> submit_cpu_p2p(c10d::OpType type, std::vector<at::Tensor>& tensors, int peer,
                                                  int tag);
    // One NCCL collective on the group's stream: the argument check, the wait for the caller's
    // stream, `enqueue` (returns 0 or fills the error), and the end event it returns.
    template <typename Enqueue>
    void* launch_nccl(const std::shared_ptr<CudaLink>& link, const char* kind, const smddp_signature& sig,
                      const c10::Device& device, Enqueue enqueue);
    c10::intrusive_ptr<c10d::Work> finish_cuda(const std::shared_ptr<CudaLink>& link, c10d::OpType type, void* event,
                                               const std::vector<at::Tensor>& used, std::vector<at::Tensor> outputs);

    py::object impl_;
    std::chrono::milliseconds timeout_;
    std::mutex links_mutex_;
    std::shared_ptr<EngineLink> cpu_;
    std::shared_ptr<CudaLink> cuda_;
    bool cuda_staged_ = false;  // the ranks share a GPU: CUDA calls go to Python (host_staging.py)
    std::atomic<uint64_t> sequence_{0};
    std::mutex names_mutex_;
    std::unordered_map<std::string, uint64_t> occurrences_;                    // calls per kind
    std::unordered_map<std::string, c10::weak_intrusive_ptr<CpuWork>> named_;  // last Work per name
    // Point-to-point work on CUDA is held back by the Python side until it is waited on or a
    // collective follows; while any may be held, CUDA collectives go through Python too, so
    // they are launched after it, in program order.
    std::atomic<bool> p2p_may_be_held_{false};
  };

}  // namespace smddp_torch
