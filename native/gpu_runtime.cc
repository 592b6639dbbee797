#include "gpu_runtime.h"

#include <dlfcn.h>

#include <fstream>
#include <mutex>
#include <vector>

#include "common.h"
#include "config.h"

namespace smddp {
namespace gpu {

namespace {

// A library the process already holds, found by its file name in /proc/self/maps (the
// framework loaded it by full path, often from a wheel's folder).
std::string loaded_path_containing(const std::string& stem) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    auto base = path.substr(path.rfind('/') + 1);
    if (base.rfind(stem, 0) == 0) return path;
  }
  return "";
}

// Order: an explicit path from the environment, the copy the framework already loaded (so
// we share its CUDA context and its NCCL), then the loader's search path.
void* open_library(const std::string& env_var, const std::string& stem, const std::vector<std::string>& sonames,
                   std::string* path, std::string* tried) {
  std::string explicit_path = config_string(env_var);
  if (!explicit_path.empty()) {
    void* h = dlopen(explicit_path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    *tried += " " + env_var + "=" + explicit_path + " (" + (h ? "ok" : dlerror()) + ")";
    if (h) *path = explicit_path;
    return h;
  }
  for (const auto& name : sonames) {
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      *path = name + " (already loaded)";
      return h;
    }
  }
  std::string loaded = loaded_path_containing(stem);
  if (!loaded.empty()) {
    if (void* h = dlopen(loaded.c_str(), RTLD_NOW)) {
      *path = loaded;
      return h;
    }
  }
  for (const auto& name : sonames) {
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      *path = name;
      return h;
    }
    *tried += " " + name;
  }
  return nullptr;
}

template <typename F>
void bind(void* lib, const char* name, F*& fn, bool required, const std::string& lib_name) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  if (!fn && required) throw Error(lib_name + " has no symbol " + name + " (too old a version?)");
}

struct Loaded {
  Runtime rt;
  std::string error;
};

const Loaded& load() {
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      Runtime& r = loaded.rt;
      std::string tried;
      void* cudart = open_library("SMDDP_CUDART_LIBRARY", "libcudart.so",
                                  {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"},
                                  &r.cudart_path, &tried);
      if (!cudart)
        throw Error("the CUDA runtime (libcudart.so) could not be loaded; tried:" + tried +
                    ". Import the framework's CUDA support first or set SMDDP_CUDART_LIBRARY");
      const std::string c = "libcudart";
      bind(cudart, "cudaGetDevice", r.cudaGetDevice, true, c);
      bind(cudart, "cudaSetDevice", r.cudaSetDevice, true, c);
      bind(cudart, "cudaDeviceGetStreamPriorityRange", r.cudaDeviceGetStreamPriorityRange, true, c);
      bind(cudart, "cudaStreamCreateWithPriority", r.cudaStreamCreateWithPriority, true, c);
      bind(cudart, "cudaStreamDestroy", r.cudaStreamDestroy, true, c);
      bind(cudart, "cudaEventCreateWithFlags", r.cudaEventCreateWithFlags, true, c);
      bind(cudart, "cudaEventDestroy", r.cudaEventDestroy, true, c);
      bind(cudart, "cudaEventRecord", r.cudaEventRecord, true, c);
      bind(cudart, "cudaEventQuery", r.cudaEventQuery, true, c);
      bind(cudart, "cudaEventSynchronize", r.cudaEventSynchronize, true, c);
      bind(cudart, "cudaStreamWaitEvent", r.cudaStreamWaitEvent, true, c);
      bind(cudart, "cudaMemcpyAsync", r.cudaMemcpyAsync, true, c);
      bind(cudart, "cudaGetErrorString", r.cudaGetErrorString, true, c);

      tried.clear();
      void* nccl =
          open_library("SMDDP_NCCL_LIBRARY", "libnccl.so", {"libnccl.so.2", "libnccl.so"}, &r.nccl_path, &tried);
      if (!nccl)
        throw Error("NCCL (libnccl.so.2) could not be loaded; tried:" + tried +
                    ". Install the nvidia-nccl-cu12/cu13 wheel (PyTorch's CUDA builds depend on it) or "
                    "set SMDDP_NCCL_LIBRARY to its path");
      const std::string n = "libnccl";
      bind(nccl, "ncclGetVersion", r.ncclGetVersion, true, n);
      bind(nccl, "ncclGetUniqueId", r.ncclGetUniqueId, true, n);
      bind(nccl, "ncclCommInitRank", r.ncclCommInitRank, true, n);
      bind(nccl, "ncclCommInitRankConfig", r.ncclCommInitRankConfig, false, n);
      bind(nccl, "ncclCommDestroy", r.ncclCommDestroy, true, n);
      bind(nccl, "ncclCommAbort", r.ncclCommAbort, true, n);
      bind(nccl, "ncclCommGetAsyncError", r.ncclCommGetAsyncError, true, n);
      bind(nccl, "ncclGetErrorString", r.ncclGetErrorString, true, n);
      bind(nccl, "ncclAllReduce", r.ncclAllReduce, true, n);
      bind(nccl, "ncclBroadcast", r.ncclBroadcast, true, n);
      bind(nccl, "ncclReduce", r.ncclReduce, true, n);
      bind(nccl, "ncclAllGather", r.ncclAllGather, true, n);
      bind(nccl, "ncclReduceScatter", r.ncclReduceScatter, true, n);
      bind(nccl, "ncclSend", r.ncclSend, true, n);
      bind(nccl, "ncclRecv", r.ncclRecv, true, n);
      bind(nccl, "ncclGroupStart", r.ncclGroupStart, true, n);
      bind(nccl, "ncclGroupEnd", r.ncclGroupEnd, true, n);
      r.ncclGetVersion(&r.nccl_version);
      // bfloat16 and ncclAvg arrived in 2.10.
      if (r.nccl_version < 21000)
        throw Error("NCCL " + std::to_string(r.nccl_version) + " at " + r.nccl_path +
                    " is too old; 2.10 or newer is needed");
    } catch (const Error& e) {
      loaded.error = e.what();
    }
  });
  return loaded;
}

}  // namespace

const Runtime& runtime() {
  const Loaded& l = load();
  if (!l.error.empty()) throw Error("CUDA tensors need NCCL: " + l.error);
  return l.rt;
}

std::string unavailable_reason() { return load().error; }

void check_cuda(int code, const char* what) {
  if (code == kCudaSuccess) return;
  const char* msg = load().rt.cudaGetErrorString ? load().rt.cudaGetErrorString(code) : "unknown";
  throw Error(std::string(what) + " failed: CUDA error " + std::to_string(code) + " (" + msg + ")");
}

void check_nccl(int code, const char* what) {
  if (code == 0) return;
  const char* msg = load().rt.ncclGetErrorString ? load().rt.ncclGetErrorString(code) : "unknown";
  throw Error(std::string(what) + " failed: NCCL error " + std::to_string(code) + " (" + msg +
              "); NCCL_DEBUG=WARN prints NCCL's own account");
}

DeviceGuard::DeviceGuard(int device) : device_(device) {
  const Runtime& r = runtime();
  check_cuda(r.cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device_) check_cuda(r.cudaSetDevice(device_), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && previous_ != device_) runtime().cudaSetDevice(previous_);
}

}  // namespace gpu
}  // namespace smddp
