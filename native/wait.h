// How the core waits: a few pause instructions (latency), yielding while the spin budget
// lasts (only worth it when every rank has a spare core), then sleeping: on the caller's
// doorbell when progress can only come through shared memory, otherwise in short naps.
// Every waiting loop runs a liveness check at a bounded interval so a dead peer or an abort
// raised by another rank turns into an error instead of a hang.
#pragma once

#include <functional>
#include <sched.h>
#include <thread>

#include "common.h"
#include "doorbell.h"

namespace smddp {

class Backoff {
 public:
  // `bell`: the waiter's doorbell, or null when progress may come from a socket.
  Backoff(int64_t spin_us, Doorbell* bell) : spin_us_(spin_us), bell_(bell), start_(Clock::now()) {}

  // One step of waiting; `seen` is the doorbell value read before the caller last looked
  // for progress. Returns true when the caller should run its liveness check.
  bool pause(uint32_t seen) {
    ++iter_;
    if (iter_ < 64) {
      cpu_relax();
      return false;
    }
    int64_t waited = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start_).count();
    if (waited < spin_us_) {
      sched_yield();
    } else if (bell_) {
      wait_doorbell(*bell_, seen, 2000);
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(waited < 50000 ? 20 : 200));
    }
    if (waited - last_check_us_ >= 5000) {
      last_check_us_ = waited;
      return true;
    }
    return false;
  }

 private:
  int64_t spin_us_;
  Doorbell* bell_;
  Clock::time_point start_;
  int64_t iter_ = 0;
  int64_t last_check_us_ = 0;
};

}  // namespace smddp
