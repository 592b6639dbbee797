// BackendSMDDP: the fast paths in C++, the rest handed to the group's Python implementation.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "backend.h"

namespace smddp_torch {

namespace {

// The core's DType codes (common.h); -1: not one the core carries.
int32_t core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return 0;
    case at::kBFloat16:
      return 1;
    case at::kFloat:
      return 2;
    case at::kDouble:
      return 3;
    case at::kChar:
      return 4;
    case at::kByte:
      return 5;
    case at::kInt:
      return 6;
    case at::kLong:
      return 7;
    case at::kBool:
      return 8;
    default:
      return -1;
  }
}

// The core's ReduceOp codes; -1: not one it computes (the Python side then says so).
int32_t core_reduce(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return 0;
    case c10d::ReduceOp::AVG:
      return 1;
    case c10d::ReduceOp::MIN:
      return 2;
    case c10d::ReduceOp::MAX:
      return 3;
    case c10d::ReduceOp::PRODUCT:
      return 4;
    default:
      return -1;
  }
}

const std::vector<int64_t> kNone;  // no splits

enum CoreOpType : int32_t { kAllreduce = 0, kBroadcast = 1, kAllgather = 3, kReduceScatter = 4 };

// Tensors the fast paths take: dense, contiguous, of a dtype the core carries, on `device`.
bool plain(const at::Tensor& t, c10::DeviceType device) {
  return t.defined() && t.layout() == c10::kStrided && t.device().type() == device && t.is_contiguous() &&
         core_dtype(t.scalar_type()) >= 0 && !t.is_complex();
}

smddp_signature signature(int32_t op, const at::Tensor& t, int32_t reduce, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& splits) {
  smddp_signature s;
  s.op = op;
  s.dtype = core_dtype(t.scalar_type());
  s.reduce_op = reduce;
  s.root = 0;
  s.shape = shape.data();
  s.ndim = shape.size();
  s.splits = splits.data();
  s.nsplits = splits.size();
  return s;
}

uintptr_t address(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); }

uintptr_t current_stream(const c10::Device& device) {
  auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return reinterpret_cast<uintptr_t>(impl->getStream(device).native_handle());
}

}  // namespace

BackendSMDDP::BackendSMDDP(py::object impl, int rank, int size, std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size), impl_(std::move(impl)), timeout_(timeout) {}

BackendSMDDP::~BackendSMDDP() {
  try {
    shutdown();
  } catch (...) {
  }
  py::gil_scoped_acquire gil;
  impl_ = py::object();
}

c10::intrusive_ptr<c10d::Backend::Options> BackendSMDDP::getBackendOptions() {
  auto options = c10::make_intrusive<OptionsSMDDP>(timeout_);
  options->group_name = getGroupUid();
  options->group_desc = getGroupDesc();
  return options;
}

template <typename... Args>
c10::intrusive_ptr<c10d::Work> BackendSMDDP::delegate(const char* method, Args&&... args) {
  py::gil_scoped_acquire gil;
  py::object work = impl_.attr(method)(std::forward<Args>(args)...);
  return c10::make_intrusive<DelegatedWork>(std::move(work));
}

std::shared_ptr<EngineLink> BackendSMDDP::cpu() {
  std::lock_guard<std::mutex> lock(links_mutex_);
  if (!cpu_) {
    py::gil_scoped_acquire gil;
    py::object engine = impl_.attr("_native_engine")();  // bootstraps the engine, once
    cpu_ = std::make_shared<EngineLink>(reinterpret_cast<void*>(engine.attr("_address")().cast<uintptr_t>()), engine);
  }
  return cpu_;
}

std::shared_ptr<CudaLink> BackendSMDDP::cuda(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(links_mutex_);
  if (!cuda_ && !cuda_staged_) {
    py::gil_scoped_acquire gil;
    // (NcclGroup, stream id, device index, device type) of the communicator made for t's device,
    // or None: the group's ranks share a GPU, and Python stages its calls through host memory.
    py::object answer = impl_.attr("_native_cuda")(t);
    if (answer.is_none()) {
      cuda_staged_ = true;
      return nullptr;
    }
    py::tuple made = answer;
    py::object group = made[0];
    c10::Stream stream = c10::Stream::unpack3(made[1].cast<int64_t>(), made[2].cast<c10::DeviceIndex>(),
                                              static_cast<c10::DeviceType>(made[3].cast<int>()));
    cuda_ =
        std::make_shared<CudaLink>(reinterpret_cast<void*>(group.attr("_address")().cast<uintptr_t>()), stream, group);
  }
  return cuda_;
}

std::string BackendSMDDP::next_name(const char* kind) { return "t." + std::to_string(sequence_++) + "." + kind; }

// The engine answers a (name, signature) it has agreed on before from its response cache:
// ranks announce a 4-byte id instead of the description. c10d calls carry no names, so the CPU
// fast paths name each call by its kind and its position among calls of that kind, modulo
// kNameWindow: a training step that repeats (DDP's buckets, FSDP's shards) repeats its
// (name, signature) pairs, and every pair gets an id. All ranks make c10d calls in the same
// order, so they agree on every name, and ranks that pass different tensors to one call still
// meet under one name, where the coordinator names the difference. A name is reused only once
// this rank's previous operation of that name has finished (the engine refuses a name twice in
// flight); every rank reaches that wait at the same point of its program, and it waits only
// with more than kNameWindow operations of one kind in flight.
constexpr uint64_t kNameWindow = 16;

std::string BackendSMDDP::reusable_name(const char* kind) {
  std::string name;
  c10::intrusive_ptr<CpuWork> previous;
  {
    std::lock_guard<std::mutex> lock(names_mutex_);
    std::string base = std::string("t.") + kind;
    name = base + "#" + std::to_string(occurrences_[base]++ % kNameWindow);
    auto it = named_.find(name);
    if (it != named_.end()) previous = it->second.lock();
  }
  if (previous) previous->wait_quietly();
  return name;
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::submit_cpu(c10d::OpType type, const char* kind,
                                                        const std::vector<at::Tensor>& ins,
                                                        const std::vector<at::Tensor>& outs,
                                                        const std::vector<smddp_signature>& sigs,
                                                        const std::vector<std::vector<int64_t>>& per_rank,
                                                        std::vector<at::Tensor> results, std::vector<at::Tensor> keep) {
  auto link = cpu();
  std::vector<uint64_t> handles;
  std::vector<std::string> names;
  ErrorText err;
  std::string failure;
  for (size_t i = 0; i < ins.size(); ++i) {
    const at::Tensor& out = outs[i];
    // One tensor per call (DDP's buckets, FSDP's shards): a name that repeats each step. Several
    // in one call could need a name the same call still holds, so they take unique names.
    names.push_back(ins.size() == 1 ? reusable_name(kind) : next_name(kind));
    uint64_t h = core().engine_submit(link->engine(), names.back().c_str(), &sigs[i], ins[i].data_ptr(), out.data_ptr(),
                                      size_t(ins[i].numel()), out.nbytes(), per_rank[i].data(), per_rank[i].size(),
                                      err.text, sizeof(err.text));
    if (h == 0) {
      failure = err.text;
      break;
    }
    handles.push_back(h);
  }
  auto work = c10::make_intrusive<CpuWork>(link, type, std::move(results), std::move(keep), handles);
  // Tracked even when a later submission failed: the engine still uses the earlier buffers.
  link->track(work, handles);
  if (ins.size() == 1 && !handles.empty()) {
    std::lock_guard<std::mutex> lock(names_mutex_);
    named_.insert_or_assign(names[0], c10::weak_intrusive_ptr<CpuWork>(work));
  }
  TORCH_CHECK(failure.empty(), failure);
  return work;
}

template <typename Enqueue>
void* BackendSMDDP::launch_nccl(const std::shared_ptr<CudaLink>& link, const char* kind, const smddp_signature& sig,
                                const c10::Device& device, Enqueue enqueue) {
  ErrorText err;
  TORCH_CHECK(core().nccl_check(link->group, kind, &sig, err.text, sizeof(err.text)) == 0 &&
                  core().nccl_wait_for(link->group, current_stream(device), err.text, sizeof(err.text)) == 0 &&
                  enqueue(err) == 0,
              "smddp ", kind, ": ", err.text);
  void* event = core().nccl_record(link->group, err.text, sizeof(err.text));
  TORCH_CHECK(event != nullptr, "smddp ", kind, ": ", err.text);
  return event;
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::finish_cuda(const std::shared_ptr<CudaLink>& link, c10d::OpType type,
                                                         void* event, const std::vector<at::Tensor>& used,
                                                         std::vector<at::Tensor> outputs) {
  // The caching allocator must not hand these out again before the group's stream is done.
  auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  for (const auto& t : used) impl->recordDataPtrOnStream(t.storage().data_ptr(), link->stream);
  return c10::make_intrusive<CudaWork>(link, type, event, std::move(outputs));
}

// -- the fast paths ------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> BackendSMDDP::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  int32_t reduce = core_reduce(opts.reduceOp);
  if (tensors.size() == 1 && reduce >= 0 && plain(tensors[0], c10::DeviceType::CUDA) && !p2p_may_be_held_) {
    const at::Tensor& t = tensors[0];
    auto link = cuda(t);
    if (link && t.device() == link->stream.device()) {
      std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
      ErrorText err;
      // Waits for the caller's stream, checks the arguments with the other ranks, runs NCCL.
      void* event = core().nccl_allreduce_after(link->group, current_stream(t.device()), address(t), address(t),
                                                size_t(t.numel()), core_dtype(t.scalar_type()), reduce, shape.data(),
                                                shape.size(), err.text, sizeof(err.text));
      TORCH_CHECK(event != nullptr, "smddp allreduce: ", err.text);
      return finish_cuda(link, c10d::OpType::ALLREDUCE, event, {t}, tensors);
    }
  }
  bool all_cpu = !tensors.empty() && reduce >= 0;
  for (const auto& t : tensors) all_cpu = all_cpu && plain(t, c10::DeviceType::CPU);
  if (!all_cpu) {
    p2p_may_be_held_ = false;  // the Python side launches what it holds before a collective
    return delegate("allreduce", tensors, opts);
  }
  std::vector<smddp_signature> sigs;
  std::vector<std::vector<int64_t>> shapes, per_rank(tensors.size());
  shapes.reserve(tensors.size());
  for (const auto& t : tensors) {
    shapes.emplace_back(t.sizes().begin(), t.sizes().end());
    sigs.push_back(signature(kAllreduce, t, reduce, shapes.back(), kNone));
  }
  return submit_cpu(c10d::OpType::ALLREDUCE, "allreduce", tensors, tensors, sigs, per_rank, tensors, tensors);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  const int64_t P = getSize();
  bool same = output.defined() && input.defined() && output.scalar_type() == input.scalar_type() &&
              output.numel() == input.numel() * P;
  if (same && plain(output, c10::DeviceType::CUDA) && plain(input, c10::DeviceType::CUDA) && !p2p_may_be_held_) {
    auto link = cuda(input);
    if (link && input.device() == link->stream.device() && output.device() == input.device()) {
      std::vector<int64_t> shape = {input.numel(), 1};
      smddp_signature sig = signature(kAllgather, input, 0, shape, kNone);
      void* event = launch_nccl(link, "all_gather_into_tensor", sig, input.device(), [&](ErrorText& err) {
        return core().nccl_allgather(link->group, address(input), address(output), size_t(input.numel()), sig.dtype,
                                     err.text, sizeof(err.text));
      });
      return finish_cuda(link, c10d::OpType::_ALLGATHER_BASE, event, {input, output}, {output});
    }
  }
  if (!(same && plain(output, c10::DeviceType::CPU) && plain(input, c10::DeviceType::CPU))) {
    p2p_may_be_held_ = false;
    return delegate("_allgather_base", output, input, opts);
  }
  // Every rank sends input.numel() elements; each rank checks what it expects from the others.
  std::vector<int64_t> shape = {input.numel()};
  std::vector<std::vector<int64_t>> per_rank(1, std::vector<int64_t>(size_t(P) + 1, input.numel()));
  std::vector<smddp_signature> sigs = {signature(kAllgather, input, 0, shape, kNone)};
  return submit_cpu(c10d::OpType::_ALLGATHER_BASE, "allgather", {input}, {output}, sigs, per_rank, {output},
                    {input, output});
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  const int64_t P = getSize();
  int32_t reduce = core_reduce(opts.reduceOp);
  bool same = reduce >= 0 && output.defined() && input.defined() && output.scalar_type() == input.scalar_type() &&
              input.numel() == output.numel() * P;
  if (same && plain(output, c10::DeviceType::CUDA) && plain(input, c10::DeviceType::CUDA) && !p2p_may_be_held_) {
    auto link = cuda(input);
    if (link && input.device() == link->stream.device() && output.device() == input.device()) {
      std::vector<int64_t> shape = {input.numel()};
      smddp_signature sig = signature(kReduceScatter, input, reduce, shape, kNone);
      void* event = launch_nccl(link, "reduce_scatter_tensor", sig, input.device(), [&](ErrorText& err) {
        return core().nccl_reduce_scatter(link->group, address(input), address(output), size_t(output.numel()),
                                          sig.dtype, reduce, err.text, sizeof(err.text));
      });
      return finish_cuda(link, c10d::OpType::_REDUCE_SCATTER_BASE, event, {input, output}, {output});
    }
  }
  if (!(same && plain(output, c10::DeviceType::CPU) && plain(input, c10::DeviceType::CPU))) {
    p2p_may_be_held_ = false;
    return delegate("_reduce_scatter_base", output, input, opts);
  }
  std::vector<int64_t> shape = {input.numel()};
  std::vector<int64_t> splits(size_t(P), output.numel());
  std::vector<std::vector<int64_t>> per_rank(1);
  std::vector<smddp_signature> sigs = {signature(kReduceScatter, input, reduce, shape, splits)};
  return submit_cpu(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter", {input}, {output}, sigs, per_rank, {output},
                    {input, output});
}

// -- handed to Python ----------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> BackendSMDDP::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  // DDP broadcasts its buffers (BatchNorm statistics) as one flat tensor every step.
  if (tensors.size() == 1 && plain(tensors[0], c10::DeviceType::CUDA) && !p2p_may_be_held_ && opts.rootRank >= 0 &&
      opts.rootRank < getSize()) {
    const at::Tensor& t = tensors[0];
    auto link = cuda(t);
    if (link && t.device() == link->stream.device()) {
      std::vector<int64_t> shape = {t.numel()};
      smddp_signature sig = signature(kBroadcast, t, 0, shape, kNone);
      sig.root = int32_t(opts.rootRank);
      void* event = launch_nccl(link, "broadcast", sig, t.device(), [&](ErrorText& err) {
        return core().nccl_broadcast(link->group, address(t), address(t), size_t(t.numel()), sig.dtype, sig.root,
                                     err.text, sizeof(err.text));
      });
      return finish_cuda(link, c10d::OpType::BROADCAST, event, {t}, tensors);
    }
  }
  p2p_may_be_held_ = false;
  return delegate("broadcast", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceCoalescedOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("allreduce_coalesced", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("reduce", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("allgather", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::AllgatherOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("allgather_into_tensor_coalesced", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("gather", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("scatter", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("reduce_scatter", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::ReduceScatterOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                           std::vector<int64_t>& output_splits,
                                                           std::vector<int64_t>& input_splits,
                                                           const c10d::AllToAllOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("alltoall_base", output, input, output_splits, input_splits, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("alltoall", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  if (tensors.size() == 1 && plain(tensors[0], c10::DeviceType::CPU))
    return submit_cpu_p2p(c10d::OpType::SEND, tensors, dst, tag);
  for (const auto& t : tensors) p2p_may_be_held_ = p2p_may_be_held_ || t.is_cuda();
  return delegate("send", tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  if (tensors.size() == 1 && plain(tensors[0], c10::DeviceType::CPU))
    return submit_cpu_p2p(c10d::OpType::RECV, tensors, src, tag);
  for (const auto& t : tensors) p2p_may_be_held_ = p2p_may_be_held_ || t.is_cuda();
  return delegate("recv", tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::submit_cpu_p2p(c10d::OpType type, std::vector<at::Tensor>& tensors,
                                                            int peer, int tag) {
  // A pipeline stage's messages: straight to the engine, no Python and no GIL (the Python
  // process group's path, for other layouts, stages the tensor and copies back).
  auto link = cpu();
  at::Tensor& t = tensors[0];
  ErrorText err;
  uint64_t h = core().engine_p2p(link->engine(), type == c10d::OpType::SEND ? 1 : 0, peer, tag, t.data_ptr(),
                                 t.nbytes(), err.text, sizeof(err.text));
  TORCH_CHECK(h != 0, "smddp ", type == c10d::OpType::SEND ? "send" : "recv", ": ", err.text);
  auto work = c10::make_intrusive<CpuWork>(link, type, tensors, tensors, std::vector<uint64_t>{h});
  link->track(work, {h});
  return work;
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return delegate("recv_anysource", tensors, tag);
}

c10::intrusive_ptr<c10d::Work> BackendSMDDP::barrier(const c10d::BarrierOptions& opts) {
  p2p_may_be_held_ = false;
  return delegate("barrier", opts);
}

c10::intrusive_ptr<c10d::Backend> BackendSMDDP::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const std::vector<int>& ranks,
                                                      const c10::intrusive_ptr<Options>& opts) {
  py::gil_scoped_acquire gil;
  auto timeout = opts ? opts->timeout : timeout_;
  py::object child = impl_.attr("_split")(store, ranks, timeout.count());
  if (child.is_none()) return nullptr;  // this rank is not in `ranks`
  return child.cast<c10::intrusive_ptr<c10d::Backend>>();
}

void BackendSMDDP::shutdown() {
  std::shared_ptr<EngineLink> cpu;
  {
    std::lock_guard<std::mutex> lock(links_mutex_);
    cpu = cpu_;
  }
  {
    py::gil_scoped_acquire gil;
    if (impl_) impl_.attr("shutdown")();
  }
  // The engine has failed what was pending; its completion thread hands that out and ends.
  if (cpu) cpu->stop();
}

void BackendSMDDP::abort() { shutdown(); }

std::vector<uint64_t> BackendSMDDP::engine_counters() {
  // Called from Python (the GIL is held). On a CUDA-only group the engine exists (it carries the
  // argument checks) without the C++ CPU link, so it is looked up on the Python side then.
  void* engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(links_mutex_);
    if (cpu_) engine = cpu_->engine();
  }
  py::object held;
  if (engine == nullptr && impl_) {
    py::object core = impl_.attr("_core_obj");
    if (!core.is_none()) {
      held = core.attr("_engine");
      engine = reinterpret_cast<void*>(held.attr("_address")().cast<uintptr_t>());
    }
  }
  uint64_t submitted = 0, hits = 0, misses = 0;
  if (engine) core().engine_counters(engine, &submitted, &hits, &misses);
  return {submitted, hits, misses};
}

}  // namespace smddp_torch
