// How the core waits on shared memory or sockets: spin briefly (latency), then yield (the
// machine may have fewer cores than processes), then sleep in short steps (CPU). Every
// waiting loop calls a liveness check at a bounded interval so a dead peer or an abort
// raised by another rank turns into an error instead of a hang.
#pragma once

#include <functional>
#include <sched.h>
#include <thread>

#include "common.h"

namespace smddp {

class Backoff {
 public:
  explicit Backoff(int64_t spin_us) : spin_us_(spin_us), start_(Clock::now()) {}

  // One step of waiting. Returns true when the caller should run its liveness check.
  bool pause() {
    ++iter_;
    if (iter_ < 64) {
      cpu_relax();
      return false;
    }
    int64_t waited = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start_).count();
    if (waited < spin_us_) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(waited < 50000 ? 50 : 500));
    }
    if (waited - last_check_us_ >= 5000) {
      last_check_us_ = waited;
      return true;
    }
    return false;
  }

  void reset() {
    iter_ = 0;
    start_ = Clock::now();
    last_check_us_ = 0;
  }

 private:
  int64_t spin_us_;
  Clock::time_point start_;
  int64_t iter_ = 0;
  int64_t last_check_us_ = 0;
};

}  // namespace smddp
