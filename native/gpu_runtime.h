// The CUDA runtime and NCCL, loaded at run time with dlopen. The core is built without any
// CUDA headers or libraries, so a CPU-only machine builds and runs it unchanged; the first
// CUDA tensor loads these and, when either is missing, fails with an error that says which
// and where it looked. Only the few entry points the NCCL data plane uses are declared, with
// the C signatures the two libraries have kept stable across their major versions.
#pragma once

#include <cstddef>
#include <string>

namespace smddp {
namespace gpu {

using Stream = void*;  // cudaStream_t
using Event = void*;   // cudaEvent_t
using NcclComm = void*;

struct NcclUniqueId {
  char internal[128];
};

// The prefix of ncclConfig_t that NCCL 2.17 defined. NCCL reads a config by its own `size`
// field, so a newer library accepts this shorter one and keeps its defaults for the rest.
struct NcclConfig {
  size_t size = sizeof(NcclConfig);
  unsigned int magic = 0xcafebeef;
  unsigned int version = 21700;
  int blocking = 1;
  int cga_cluster_size = kUndefined;
  int min_ctas = kUndefined;
  int max_ctas = kUndefined;
  const char* net_name = nullptr;
  int split_share = kUndefined;
  static constexpr int kUndefined = -2147483647 - 1;  // NCCL_CONFIG_UNDEF_INT
};

constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorNotReady = 600;
constexpr unsigned kEventDisableTiming = 2;
constexpr unsigned kStreamNonBlocking = 1;
constexpr int kMemcpyDeviceToDevice = 3;

struct Runtime {
  // CUDA runtime.
  int (*cudaGetDevice)(int*);
  int (*cudaSetDevice)(int);
  int (*cudaDeviceGetStreamPriorityRange)(int*, int*);
  int (*cudaStreamCreateWithPriority)(Stream*, unsigned, int);
  int (*cudaStreamDestroy)(Stream);
  int (*cudaEventCreateWithFlags)(Event*, unsigned);
  int (*cudaEventDestroy)(Event);
  int (*cudaEventRecord)(Event, Stream);
  int (*cudaEventQuery)(Event);
  int (*cudaEventSynchronize)(Event);
  int (*cudaStreamWaitEvent)(Stream, Event, unsigned);
  int (*cudaMemcpyAsync)(void*, const void*, size_t, int, Stream);
  const char* (*cudaGetErrorString)(int);
  // NCCL.
  int (*ncclGetVersion)(int*);
  int (*ncclGetUniqueId)(NcclUniqueId*);
  int (*ncclCommInitRank)(NcclComm*, int, NcclUniqueId, int);
  int (*ncclCommInitRankConfig)(NcclComm*, int, NcclUniqueId, int, NcclConfig*);  // may be null
  int (*ncclCommDestroy)(NcclComm);
  int (*ncclCommAbort)(NcclComm);
  int (*ncclCommGetAsyncError)(NcclComm, int*);
  const char* (*ncclGetErrorString)(int);
  int (*ncclAllReduce)(const void*, void*, size_t, int, int, NcclComm, Stream);
  int (*ncclBroadcast)(const void*, void*, size_t, int, int, NcclComm, Stream);
  int (*ncclReduce)(const void*, void*, size_t, int, int, int, NcclComm, Stream);
  int (*ncclAllGather)(const void*, void*, size_t, int, NcclComm, Stream);
  int (*ncclReduceScatter)(const void*, void*, size_t, int, int, NcclComm, Stream);
  int (*ncclSend)(const void*, size_t, int, int, NcclComm, Stream);
  int (*ncclRecv)(void*, size_t, int, int, NcclComm, Stream);
  int (*ncclGroupStart)();
  int (*ncclGroupEnd)();

  std::string cudart_path, nccl_path;
  int nccl_version = 0;
};

// Loads both libraries once. Throws Error naming what is missing.
const Runtime& runtime();

// "" when both load, else why not (never throws): frontends ask before routing CUDA tensors.
std::string unavailable_reason();

// Throws Error("<what>: <cuda message>") unless `code` is success.
void check_cuda(int code, const char* what);
void check_nccl(int code, const char* what);

// Sets the calling thread's current device for a scope and puts the caller's back after, so
// the framework sharing the runtime never sees its device changed.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();

 private:
  int previous_ = -1;
  int device_;
};

}  // namespace gpu
}  // namespace smddp
