// Shared vocabulary of the native core: dtypes, reduction ops, collective kinds,
// the error type every layer throws, clocks and logging.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace smddp {

enum class DType : uint8_t {
  kFloat16 = 0,
  kBFloat16,
  kFloat32,
  kFloat64,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kBool,
  kCount
};

enum class ReduceOp : uint8_t { kSum = 0, kAverage, kMin, kMax, kProduct, kCount };

enum class OpType : uint8_t {
  kAllreduce = 0,
  kBroadcast,
  kReduce,
  kAllgather,
  kReduceScatter,
  kAlltoall,
  kBarrier,
  kCount
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);
const char* op_type_name(OpType op);
// "[1, 2, 3]": shapes, splits and counts in error messages.
std::string list_text(const std::vector<int64_t>& values);
bool dtype_is_floating(DType t);

// Every failure the user can see is an Error with a message that names what went wrong.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A peer vanished or stopped answering: distinct so callers can abort the whole engine.
class PeerError : public Error {
 public:
  explicit PeerError(const std::string& msg) : Error(msg) {}
};

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

// Log to stderr with a rank prefix; level 0 = errors only, 1 = warnings, 2 = info, 3 = debug.
void set_log_identity(int rank, int level);
int log_level();
void log_message(int level, const std::string& msg);

#define SMDDP_LOG(level, expr)               \
  do {                                       \
    if (::smddp::log_level() >= (level)) {   \
      ::smddp::log_message((level), (expr)); \
    }                                        \
  } while (0)

// CPU relax hint for spin loops.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace smddp
