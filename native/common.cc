#include "common.h"

#include <mutex>

namespace smddp {

namespace {
int g_rank = -1;
int g_level = 1;
std::mutex g_log_mutex;
}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
    default:
      throw Error("unknown dtype code " + std::to_string(int(t)));
  }
}

const char* dtype_name(DType t) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"};
  return int(t) < int(DType::kCount) ? names[int(t)] : "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  static const char* names[] = {"SUM", "AVERAGE", "MIN", "MAX", "PRODUCT"};
  return int(op) < int(ReduceOp::kCount) ? names[int(op)] : "unknown";
}

const char* op_type_name(OpType op) {
  static const char* names[] = {"allreduce",      "broadcast", "reduce", "allgather",
                                "reduce_scatter", "alltoall",  "barrier"};
  return int(op) < int(OpType::kCount) ? names[int(op)] : "unknown";
}

bool dtype_is_floating(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 || t == DType::kFloat64;
}

void set_log_identity(int rank, int level) {
  g_rank = rank;
  g_level = level;
}

int log_level() { return g_level; }

void log_message(int level, const std::string& msg) {
  static const char* tags[] = {"ERROR", "WARNING", "INFO", "DEBUG"};
  std::lock_guard<std::mutex> lock(g_log_mutex);
  std::fprintf(stderr, "[smddp rank %d %s] %s\n", g_rank, tags[level < 0 ? 0 : (level > 3 ? 3 : level)], msg.c_str());
  std::fflush(stderr);
}

std::string list_text(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

}  // namespace smddp
