// One POSIX shared-memory segment per host, shared by that host's ranks. It holds the
// host's control block (abort flag, barrier, pids), the staging slots of the intra-host
// allreduce and broadcast, and the rings of the point-to-point channels between local ranks.
//
// The segment is unlinked as soon as every local rank has mapped it, so nothing is left in
// /dev/shm after a crash; the mapping itself lives as long as the processes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common.h"
#include "doorbell.h"

namespace smddp {

struct alignas(64) PaddedU64 {
  std::atomic<uint64_t> v;
  char pad[64 - sizeof(std::atomic<uint64_t>)];
};

struct HostControl {
  uint64_t magic;
  uint32_t local_size;
  uint32_t pad0;
  alignas(64) std::atomic<uint32_t> aborted;
  char abort_message[1024];
  alignas(64) std::atomic<uint32_t> barrier_count;
  alignas(64) std::atomic<uint32_t> barrier_generation;
  alignas(64) int32_t pids[256];
  int32_t global_ranks[256];
  // Cross-memory attach: each rank's buffer address for the current collective, and
  // whether reading every local peer's memory worked at start-up.
  alignas(64) uint64_t buffer_address[256];
  uint64_t probe_address[256];
  int32_t cma_ok[256];
  Doorbell doorbells[256];
};

// Single-producer single-consumer byte ring.
struct RingHeader {
  PaddedU64 head;  // total bytes written (producer)
  PaddedU64 tail;  // total bytes read (consumer)
};

class ShmRing {
 public:
  ShmRing() = default;
  ShmRing(RingHeader* header, char* data, size_t capacity) : h_(header), data_(data), cap_(capacity) {}
  size_t try_write(const void* src, size_t n);
  size_t try_read(void* dst, size_t n);

 private:
  RingHeader* h_ = nullptr;
  char* data_ = nullptr;
  size_t cap_ = 0;
};

class HostSegment {
 public:
  static constexpr int kMaxLocalRanks = 256;
  static constexpr int kChannelKinds = 3;  // data, control, point-to-point (see channel.h)

  HostSegment(const std::string& name, int local_rank, int local_size, int global_rank, size_t slot_bytes,
              size_t ring_bytes, bool create);
  ~HostSegment();
  HostSegment(const HostSegment&) = delete;
  HostSegment& operator=(const HostSegment&) = delete;

  // Removes the name from /dev/shm (the mapping stays valid). Idempotent.
  void unlink();

  HostControl* control() { return ctrl_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  // Staging slot `slot_set` (0 or 1) of local rank `lr`.
  char* slot(int slot_set, int lr);
  // Ring carrying bytes from local rank `from` to local rank `to` on channel `kind`.
  ShmRing ring(int from, int to, int kind);

  // Marks the host aborted with a message (first writer wins) so every local rank fails.
  void raise_abort(const std::string& message);
  // Throws PeerError if the host was aborted or a local peer process is gone.
  void check_alive(const char* context);

  Doorbell& doorbell(int lr) { return ctrl_->doorbells[lr]; }
  void ring_all_doorbells();

  // Barrier among the local ranks. `check` runs periodically while waiting.
  void barrier(int64_t spin_us, const std::function<void()>& check);

 private:
  std::string name_;
  int local_rank_;
  int local_size_;
  size_t slot_bytes_;
  size_t ring_bytes_;
  size_t total_bytes_ = 0;
  void* base_ = nullptr;
  HostControl* ctrl_ = nullptr;
  char* slots_ = nullptr;
  char* rings_ = nullptr;
  bool linked_ = false;
};

// True while process `pid` exists and is not a zombie.
bool process_alive(int pid);

}  // namespace smddp
