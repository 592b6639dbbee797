// Works of the smddp Backend: CPU collectives completed by one thread per engine, CUDA
// collectives as an event on the group's NCCL stream.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

#include "backend.h"

namespace smddp_torch {

namespace {

const smddp_c_api* g_core = nullptr;

std::mutex g_links_mutex;
std::vector<EngineLink*> g_links;  // every live EngineLink, for stop_all_at_exit

c10::intrusive_ptr<c10::ivalue::Future> tensor_list_future(std::vector<c10::Device> devices = {}) {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), std::move(devices));
}

}  // namespace

const smddp_c_api& core() {
  TORCH_CHECK(g_core != nullptr, "smddp: the native backend was used before the core was loaded");
  return *g_core;
}

void load_core(py::capsule capsule) {
  auto api = static_cast<const smddp_c_api*>(capsule.get_pointer());
  TORCH_CHECK(api != nullptr && api->version == SMDDP_C_API_VERSION && api->struct_size >= sizeof(smddp_c_api),
              "smddp: the native torch backend was built for core C API version ", SMDDP_C_API_VERSION,
              " but smdistributed._core offers version ", api ? api->version : 0,
              "; remove the backend's build cache (SMDDP_TORCH_EXTENSION_DIR) so it is rebuilt");
  g_core = api;
}

// -- EngineLink ----------------------------------------------------------------------------

EngineLink::EngineLink(void* engine, py::object owner) : engine_(engine), owner_(std::move(owner)) {
  std::lock_guard<std::mutex> lock(g_links_mutex);
  g_links.push_back(this);
}

void EngineLink::start_thread() {
  if (thread_started_.load()) return;
  std::lock_guard<std::mutex> lock(thread_mutex_);
  if (thread_started_.load() || stop_) return;
  thread_ = std::thread([this] { run(); });
  thread_started_ = true;
}

EngineLink::~EngineLink() {
  {
    std::lock_guard<std::mutex> lock(g_links_mutex);
    g_links.erase(std::remove(g_links.begin(), g_links.end(), this), g_links.end());
  }
  stop();
  py::gil_scoped_acquire gil;
  owner_ = py::object();
}

void EngineLink::stop() {
  bool had_thread;
  {
    std::lock_guard<std::mutex> lock(thread_mutex_);
    stop_ = true;
    had_thread = thread_started_.load();
    if (thread_.joinable()) {
      if (thread_.get_id() == std::this_thread::get_id()) {
        thread_.detach();  // the last Work was released by its own completion
      } else {
        thread_.join();
      }
    }
  }
  if (!had_thread) finish_without_thread();
}

void EngineLink::finish_without_thread() {
  std::vector<uint64_t> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& kv : works_) pending.push_back(kv.first);
  }
  // The engine finishes each (or fails it: a shut-down engine fails what was pending, a live
  // one at its timeout) before its buffers may go, as the thread would have waited for them.
  if (!abandon_)
    for (uint64_t h : pending) core().engine_wait_done(engine_, h, -1.0);
  sweep();
  std::unordered_map<uint64_t, c10::intrusive_ptr<CpuWork>> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    left.swap(works_);
  }
  for (auto& kv : left) kv.second->handle_done("smddp: the process group was shut down before this operation ended");
}

void EngineLink::stop_all_at_exit() {
  py::gil_scoped_release nogil;  // the threads may be inside a future's Python callback
  std::lock_guard<std::mutex> lock(g_links_mutex);
  for (EngineLink* link : g_links) {
    link->abandon_ = true;
    link->stop();
  }
}

namespace {
// Without a completion thread, Works never waited on are swept by the calls that track new
// ones once this many are tracked, so a fire-and-forget loop does not keep its buffers.
constexpr size_t kSweepWithoutThreadAt = 64;
}  // namespace

void EngineLink::track(const c10::intrusive_ptr<CpuWork>& work, const std::vector<uint64_t>& handles) {
  size_t tracked;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (uint64_t h : handles) works_[h] = work;
    tracked = works_.size();
  }
  if (tracked >= kSweepWithoutThreadAt && !thread_started_.load()) sweep();
}

void EngineLink::watch(const std::vector<uint64_t>& handles) {
  start_thread();
  for (uint64_t h : handles) core().engine_watch(engine_, h);  // a released handle is ignored
}

void EngineLink::sweep() {
  std::vector<uint64_t> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& kv : works_)
      if (!kv.second->watched() && core().engine_wait_done(engine_, kv.first, 0) == 1) done.push_back(kv.first);
  }
  for (uint64_t h : done) on_completion(this, h);
}

void EngineLink::on_completion(void* self, uint64_t handle) {
  auto* link = static_cast<EngineLink*>(self);
  c10::intrusive_ptr<CpuWork> work;
  {
    std::lock_guard<std::mutex> lock(link->mutex_);
    auto it = link->works_.find(handle);
    if (it == link->works_.end()) return;
    work = std::move(it->second);
    link->works_.erase(it);
  }
  ErrorText err;
  int rc = core().engine_wait(link->engine_, handle, 0, err.text, sizeof(err.text));
  link->completed_++;
  work->handle_done(rc == 0 ? std::string() : std::string(err.text));
}

void EngineLink::run() {
  // Until stopped, and after that until the engine (shut down) has handed back every
  // operation it failed, so no Work waits forever.
  while (true) {
    const uint64_t before = completed_.load();
    int closed = core().engine_next_completions(engine_, 0.2, &EngineLink::on_completion, this);
    // A quiet round (or the end): Works nobody waits on or watches, dropped unfinished.
    if (closed || completed_.load() == before) sweep();
    if (closed) break;
    if (stop_) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (works_.empty() || abandon_) break;
    }
  }
  std::unordered_map<uint64_t, c10::intrusive_ptr<CpuWork>> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    left.swap(works_);
  }
  for (auto& kv : left) kv.second->handle_done("smddp: the process group was shut down before this operation ended");
}

// -- CpuWork -------------------------------------------------------------------------------

CpuWork::CpuWork(std::shared_ptr<EngineLink> link, c10d::OpType type, std::vector<at::Tensor> outputs,
                 std::vector<at::Tensor> keep, std::vector<uint64_t> handles)
    : c10d::Work(-1, type),
      link_(std::move(link)),
      handles_(std::move(handles)),
      outputs_(std::move(outputs)),
      keep_(std::move(keep)),
      remaining_(handles_.size()),
      future_(tensor_list_future()) {
  if (remaining_ == 0) future_->markCompleted(c10::IValue(outputs_));
}

void CpuWork::handle_done(const std::string& error) {
  bool finished = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error.empty() && error_.empty()) error_ = error;
    finished = --remaining_ == 0;
    if (finished) keep_.clear();
  }
  if (!finished) return;
  cv_.notify_all();
  // DDP's reducer reads the future: a failure must be an error there, never a value.
  if (error_.empty()) {
    future_->markCompleted(c10::IValue(outputs_));
  } else {
    future_->setError(std::make_exception_ptr(std::runtime_error(error_)));
  }
}

bool CpuWork::take_results(double seconds) {
  // Woken by the engine itself: through the completion thread it would be a second wake-up
  // per operation (measured on send/recv: 2x the latency).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(seconds, 0.0));
  for (uint64_t h : handles_) {
    double left = -1.0;
    if (seconds >= 0)
      left = std::max(0.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
    if (core().engine_wait_done(link_->engine(), h, left) != 1) return false;
  }
  for (uint64_t h : handles_) link_->finish(h);
  return true;
}

bool CpuWork::wait(std::chrono::milliseconds timeout) {
  const bool finished = take_results(timeout == ::kNoTimeout ? -1.0 : timeout.count() / 1000.0);
  std::unique_lock<std::mutex> lock(mutex_);
  if (finished || timeout == ::kNoTimeout) {
    // Finished: a thread that took a result first may still be handing it over (a moment).
    cv_.wait(lock, [&] { return remaining_ == 0; });
  } else if (remaining_ != 0) {
    TORCH_CHECK(false, "smddp: operation timed out after ", timeout.count(), " ms");
  }
  if (!error_.empty()) TORCH_CHECK(false, error_);
  return true;
}

void CpuWork::wait_quietly() {
  take_results(-1.0);
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return remaining_ == 0; });
}

bool CpuWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (remaining_ == 0) return true;
  }
  take_results(0.0);
  std::lock_guard<std::mutex> lock(mutex_);
  return remaining_ == 0;
}

bool CpuWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return remaining_ == 0 && error_.empty();
}

std::exception_ptr CpuWork::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_.empty() ? nullptr : std::make_exception_ptr(std::runtime_error(error_));
}

std::vector<at::Tensor> CpuWork::result() {
  wait(::kNoTimeout);
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> CpuWork::getFuture() {
  // Its callbacks (DDP's reducer) must run when the engine finishes, whether or not anyone waits.
  if (!watched_.exchange(true)) link_->watch(handles_);
  return future_;
}

// -- DelegatedWork -------------------------------------------------------------------------

DelegatedWork::DelegatedWork(py::object work)
    : work_(work.cast<c10::intrusive_ptr<c10d::Work>>()), py_(std::move(work)) {}

DelegatedWork::~DelegatedWork() {
  py::gil_scoped_acquire gil;
  py_ = py::object();
}

bool DelegatedWork::wait(std::chrono::milliseconds timeout) { return work_->wait(timeout); }

bool DelegatedWork::isCompleted() {
  py::gil_scoped_acquire gil;
  return py_.attr("is_completed")().cast<bool>();
}

bool DelegatedWork::isSuccess() const {
  py::gil_scoped_acquire gil;
  return py_.attr("is_success")().cast<bool>();
}

std::exception_ptr DelegatedWork::exception() const {
  py::gil_scoped_acquire gil;
  py::object e = py_.attr("exception")();
  return e.is_none() ? nullptr : std::make_exception_ptr(std::runtime_error(py::str(e).cast<std::string>()));
}

namespace {
// Works of list collectives (all_gather, gather) hold a list of lists; torch's is flat.
void flatten_into(const py::handle& value, std::vector<at::Tensor>& out) {
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    for (const auto& item : value) flatten_into(item, out);
  } else if (!value.is_none()) {
    out.push_back(value.cast<at::Tensor>());
  }
}
}  // namespace

std::vector<at::Tensor> DelegatedWork::result() {
  py::gil_scoped_acquire gil;
  std::vector<at::Tensor> out;
  flatten_into(py_.attr("result")(), out);
  return out;
}

c10::intrusive_ptr<c10::ivalue::Future> DelegatedWork::getFuture() { return work_->getFuture(); }

// -- CUDA ----------------------------------------------------------------------------------

CudaLink::CudaLink(void* g, c10::Stream s, py::object o) : group(g), stream(s), owner(std::move(o)) {}

CudaLink::~CudaLink() {
  py::gil_scoped_acquire gil;
  owner = py::object();
}

std::string CudaLink::error() const {
  ErrorText err;
  return core().nccl_error(group, err.text, sizeof(err.text)) ? std::string(err.text) : std::string();
}

CudaWork::CudaWork(std::shared_ptr<CudaLink> link, c10d::OpType type, void* event, std::vector<at::Tensor> outputs)
    : c10d::Work(-1, type),
      link_(std::move(link)),
      event_(event),
      outputs_(std::move(outputs)),
      future_(tensor_list_future({link_->stream.device()})) {
  // Completed at once, on the group's stream: the future records its events there, so whoever
  // reads the value (DDP's hooks included) waits on the GPU, as with torch's NCCL backend.
  c10::StreamGuard guard(link_->stream);
  future_->markCompleted(c10::IValue(outputs_));
}

CudaWork::~CudaWork() { core().event_release(event_); }

bool CudaWork::wait(std::chrono::milliseconds) {
  auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Stream current = impl->getStream(link_->stream.device());
  ErrorText err;
  TORCH_CHECK(
      core().event_block(event_, reinterpret_cast<uintptr_t>(current.native_handle()), err.text, sizeof(err.text)) == 0,
      "smddp: ", err.text);
  std::string error = link_->error();
  TORCH_CHECK(error.empty(), "smddp: ", error);
  return true;
}

void CudaWork::synchronize() {
  core().event_synchronize(event_);
  std::string error = link_->error();
  TORCH_CHECK(error.empty(), "smddp: ", error);
}

bool CudaWork::isCompleted() { return core().event_query(event_) != 0; }

bool CudaWork::isSuccess() const { return core().event_query(event_) != 0 && link_->error().empty(); }

std::exception_ptr CudaWork::exception() const {
  std::string error = link_->error();
  return error.empty() ? nullptr : std::make_exception_ptr(std::runtime_error("smddp: " + error));
}

std::vector<at::Tensor> CudaWork::result() { return outputs_; }

c10::intrusive_ptr<c10::ivalue::Future> CudaWork::getFuture() { return future_; }

}  // namespace smddp_torch
