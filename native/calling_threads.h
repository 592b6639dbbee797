// Which thread made a call: threads are numbered per engine in the order of their first call.
//
// Collectives without a user-given name (every torch.distributed call, and the CUDA argument
// checks) are matched across ranks by their order alone. Threads that issue them at the same
// time reach the engine in a different order on every rank, so the k-th call of one rank would
// meet another thread's k-th call on another rank: with equal shapes the tensors of different
// threads would be reduced together, silently. Carrying the caller's number in the signature
// (Signature::caller) turns that into a mismatch every rank reports. A program that fixes its
// order (DDP's reducer on the autograd thread after the main thread's forward) makes its
// threads' first calls in the same order on every rank, so they get the same numbers.
#pragma once

#include <atomic>
#include <cstdint>

namespace smddp {

class CallingThreads {
 public:
  CallingThreads();
  // 1 for the first thread that calls, 2 for the next, ...; a thread keeps its number for as
  // long as it lives, and a thread started later (even one that reuses an exited thread's id)
  // gets a new number, as it does on the other ranks.
  uint32_t number_of_this_thread();

 private:
  const uint64_t serial_;  // unique for the process's life: a thread's entries never outlive their meaning
  std::atomic<uint32_t> next_{0};
};

}  // namespace smddp
