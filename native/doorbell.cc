#include "doorbell.h"

#include <climits>
#include <ctime>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace smddp {

namespace {
long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* timeout) {
  // Shared (not PRIVATE) futex: the word lives in memory mapped by several processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, timeout, nullptr, 0);
}
}  // namespace

void ring_doorbell(Doorbell& bell) {
  bell.rings.fetch_add(1, std::memory_order_acq_rel);
  if (bell.sleepers.load(std::memory_order_acquire) > 0) futex(&bell.rings, FUTEX_WAKE, INT_MAX, nullptr);
}

void wait_doorbell(Doorbell& bell, uint32_t seen, int64_t timeout_us) {
  timespec ts{time_t(timeout_us / 1000000), long((timeout_us % 1000000) * 1000)};
  bell.sleepers.fetch_add(1, std::memory_order_acq_rel);
  if (bell.rings.load(std::memory_order_acquire) == seen) futex(&bell.rings, FUTEX_WAIT, seen, &ts);
  bell.sleepers.fetch_sub(1, std::memory_order_acq_rel);
}

}  // namespace smddp
