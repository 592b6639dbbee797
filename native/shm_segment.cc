#include "shm_segment.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "wait.h"

namespace smddp {

namespace {
constexpr uint64_t kMagic = 0x736d646470736567ull;  // "smddpseg"

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
}  // namespace

bool process_alive(int pid) {
  if (pid <= 0) return true;  // unknown yet
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child stays a zombie until its parent reaps it: treat that as dead.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;  // no procfs: rely on kill()
  std::string line;
  std::getline(stat, line);
  size_t close = line.rfind(')');
  if (close != std::string::npos && close + 2 < line.size()) {
    char state = line[close + 2];
    return state != 'Z' && state != 'X';
  }
  return true;
}

size_t ShmRing::try_write(const void* src, size_t n) {
  uint64_t head = h_->head.v.load(std::memory_order_relaxed);
  uint64_t tail = h_->tail.v.load(std::memory_order_acquire);
  size_t space = cap_ - size_t(head - tail);
  size_t len = std::min(n, space);
  if (len == 0) return 0;
  size_t pos = size_t(head % cap_);
  size_t first = std::min(len, cap_ - pos);
  std::memcpy(data_ + pos, src, first);
  if (len > first) std::memcpy(data_, static_cast<const char*>(src) + first, len - first);
  h_->head.v.store(head + len, std::memory_order_release);
  return len;
}

size_t ShmRing::try_read(void* dst, size_t n) {
  uint64_t tail = h_->tail.v.load(std::memory_order_relaxed);
  uint64_t head = h_->head.v.load(std::memory_order_acquire);
  size_t len = std::min(n, size_t(head - tail));
  if (len == 0) return 0;
  size_t pos = size_t(tail % cap_);
  size_t first = std::min(len, cap_ - pos);
  std::memcpy(dst, data_ + pos, first);
  if (len > first) std::memcpy(static_cast<char*>(dst) + first, data_, len - first);
  h_->tail.v.store(tail + len, std::memory_order_release);
  return len;
}

HostSegment::HostSegment(const std::string& name, int local_rank, int local_size, int global_rank, size_t slot_bytes,
                         size_t ring_bytes, bool create)
    : name_(name), local_rank_(local_rank), local_size_(local_size), slot_bytes_(slot_bytes), ring_bytes_(ring_bytes) {
  if (local_size > kMaxLocalRanks)
    throw Error("at most " + std::to_string(kMaxLocalRanks) + " ranks per host are supported");
  size_t ctrl_bytes = round_up(sizeof(HostControl), 4096);
  size_t slots_bytes = 2 * size_t(local_size) * slot_bytes_;
  size_t ring_unit = round_up(sizeof(RingHeader), 64) + ring_bytes_;
  size_t rings_bytes = size_t(local_size) * local_size * kChannelKinds * ring_unit;
  total_bytes_ = ctrl_bytes + slots_bytes + rings_bytes;

  int fd = -1;
  if (create) {
    ::shm_unlink(name_.c_str());  // a stale segment of a crashed job with the same name
    fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw Error("shm_open(" + name_ + ") failed: " + std::strerror(errno));
    linked_ = true;
    if (::ftruncate(fd, off_t(total_bytes_)) != 0) {
      int e = errno;
      ::close(fd);
      unlink();
      throw Error("cannot size shared memory segment " + name_ + " to " + std::to_string(total_bytes_) +
                  " bytes: " + std::strerror(e) + " (is /dev/shm large enough? lower SMDDP_SHM_SLOT_BYTES)");
    }
  } else {
    fd = ::shm_open(name_.c_str(), O_RDWR, 0600);
    if (fd < 0) throw Error("cannot open shared memory segment " + name_ + ": " + std::strerror(errno));
  }
  base_ = ::mmap(nullptr, total_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    if (create) unlink();
    throw Error("mmap of shared memory segment " + name_ + " failed: " + std::strerror(errno));
  }
  ctrl_ = static_cast<HostControl*>(base_);
  slots_ = static_cast<char*>(base_) + ctrl_bytes;
  rings_ = slots_ + slots_bytes;
  if (create) {
    // ftruncate zero-fills, so every atomic and ring counter starts at 0.
    ctrl_->local_size = uint32_t(local_size);
    ctrl_->magic = kMagic;
  } else if (ctrl_->magic != kMagic || ctrl_->local_size != uint32_t(local_size)) {
    throw Error("shared memory segment " + name_ + " does not belong to this job");
  }
  ctrl_->global_ranks[local_rank] = int32_t(global_rank);
  ctrl_->pids[local_rank] = int32_t(::getpid());
}

HostSegment::~HostSegment() {
  unlink();
  if (base_) ::munmap(base_, total_bytes_);
}

void HostSegment::unlink() {
  if (linked_) {
    ::shm_unlink(name_.c_str());
    linked_ = false;
  }
}

char* HostSegment::slot(int slot_set, int lr) { return slots_ + (size_t(slot_set) * local_size_ + lr) * slot_bytes_; }

ShmRing HostSegment::ring(int from, int to, int kind) {
  if (kind < 0 || kind >= kChannelKinds || from < 0 || from >= local_size_ || to < 0 || to >= local_size_)
    throw Error("internal: no shared-memory ring " + std::to_string(from) + "->" + std::to_string(to) + " kind " +
                std::to_string(kind));
  size_t ring_unit = round_up(sizeof(RingHeader), 64) + ring_bytes_;
  size_t index = (size_t(from) * local_size_ + to) * kChannelKinds + kind;
  char* unit = rings_ + index * ring_unit;
  return ShmRing(reinterpret_cast<RingHeader*>(unit), unit + round_up(sizeof(RingHeader), 64), ring_bytes_);
}

void HostSegment::raise_abort(const std::string& message) {
  uint32_t expected = 0;
  if (ctrl_->aborted.compare_exchange_strong(expected, 2)) {
    std::strncpy(ctrl_->abort_message, message.c_str(), sizeof(ctrl_->abort_message) - 1);
    ctrl_->aborted.store(1, std::memory_order_release);
  }
}

void HostSegment::check_alive(const char* context) {
  uint32_t a = ctrl_->aborted.load(std::memory_order_acquire);
  if (a == 1) throw PeerError(std::string(ctrl_->abort_message));
  if (a == 2) return;  // message being written; the next check sees it
  for (int lr = 0; lr < local_size_; ++lr) {
    if (lr == local_rank_) continue;
    if (!process_alive(ctrl_->pids[lr]))
      throw PeerError("rank " + std::to_string(ctrl_->global_ranks[lr]) + " (pid " + std::to_string(ctrl_->pids[lr]) +
                      ") died during " + context);
  }
}

void HostSegment::ring_all_doorbells() {
  for (int lr = 0; lr < local_size_; ++lr) ring_doorbell(ctrl_->doorbells[lr]);
}

void HostSegment::barrier(int64_t spin_us, const std::function<void()>& check) {
  if (local_size_ == 1) return;
  uint32_t gen = ctrl_->barrier_generation.load(std::memory_order_acquire);
  if (ctrl_->barrier_count.fetch_add(1, std::memory_order_acq_rel) + 1 == uint32_t(local_size_)) {
    ctrl_->barrier_count.store(0, std::memory_order_relaxed);
    ctrl_->barrier_generation.fetch_add(1, std::memory_order_release);
    ring_all_doorbells();
    return;
  }
  Doorbell& bell = doorbell(local_rank_);
  Backoff backoff(spin_us, &bell);
  auto released = [&] { return ctrl_->barrier_generation.load(std::memory_order_acquire) != gen; };
  while (true) {
    uint32_t seen = bell.rings.load(std::memory_order_acquire);
    if (released()) break;
    // Re-test before the liveness check: a peer may release us and then exit.
    if (backoff.pause(seen) && !released()) check();
  }
}

}  // namespace smddp
