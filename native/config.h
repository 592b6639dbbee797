// The one table of configuration variables (name, default, meaning), in the manner of
// NCCL's declared parameters. Everything that reads the environment goes through here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smddp {

struct ConfigVar {
  const char* name;
  const char* default_value;
  const char* meaning;
};

// All variables, in the order the launcher's --help prints them.
const std::vector<ConfigVar>& config_table();

// Value from the environment, or the table's default. Throws for a name not in the table.
std::string config_string(const std::string& name);
int64_t config_int(const std::string& name);
double config_double(const std::string& name);

// The values the engine runs with, read once at start.
struct EngineConfig {
  double timeout_s;            // a collective or a peer silent this long fails
  int64_t fusion_bytes;        // fuse ready allreduces up to this many bytes
  int64_t cache_capacity;      // response-cache entries
  bool hit_exchange;           // agree on cached collectives in hit cycles (hit_agreement.h)
  bool check_calling_thread;   // order-matched calls carry their thread's number (calling_threads.h)
  int64_t cuda_check_backlog;  // CUDA argument checks queued behind a name still in use (nccl_group.h)
  int64_t shm_slot_bytes;      // per-rank staging slot of the intra-host allreduce
  int64_t shm_ring_bytes;      // per-direction ring of an intra-host point-to-point channel
  int64_t ring_threshold;      // multi-host allreduce at or above this size uses the flat ring
  std::string algorithm;       // auto | ring | hierarchical
  std::string cma;             // auto | 0 | 1: cross-memory attach inside a host
  int64_t cma_threshold;       // intra-host allreduce at or above this size uses it
  int64_t spin_us;             // keep yielding this long before sleeping; -1 = decide (Comm)
  std::string timeline_path;   // chrome-trace file prefix, empty = off
  int log_level;
  double stall_warning_s;  // warn about tensors waiting for missing ranks after this

  static EngineConfig from_environment();
};

}  // namespace smddp
