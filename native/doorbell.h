// A doorbell per local rank, in the host's shared memory: whoever makes progress that a
// rank may be waiting for (bytes into its ring, space freed in a ring it fills, a barrier
// released, work submitted to its engine) rings it, and a rank with nothing to do sleeps
// on it with a futex instead of spinning. Spinning steals the core from the training
// computation whenever ranks do not each have a spare core.
#pragma once

#include <atomic>
#include <cstdint>

namespace smddp {

struct alignas(64) Doorbell {
  std::atomic<uint32_t> rings{0};
  std::atomic<uint32_t> sleepers{0};
};

// Wakes a sleeper if there is one; costs one atomic increment otherwise.
void ring_doorbell(Doorbell& bell);

// Sleeps until the doorbell rings past `seen` (read before checking for work, so no ring is
// lost) or `timeout_us` passes.
void wait_doorbell(Doorbell& bell, uint32_t seen, int64_t timeout_us);

}  // namespace smddp
