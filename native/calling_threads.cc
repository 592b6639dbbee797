// Numbering of calling threads (calling_threads.h).
#include "calling_threads.h"

#include <utility>
#include <vector>

namespace smddp {

namespace {
std::atomic<uint64_t> next_serial{1};

// This thread's number in each numbering it has called, by serial. Thread-local, so a thread's
// numbers go with it when it exits; a process has few engines, so a short list is searched.
thread_local std::vector<std::pair<uint64_t, uint32_t>> numbers_of_this_thread;
}  // namespace

CallingThreads::CallingThreads() : serial_(next_serial.fetch_add(1)) {}

uint32_t CallingThreads::number_of_this_thread() {
  for (const auto& [serial, number] : numbers_of_this_thread)
    if (serial == serial_) return number;
  const uint32_t number = next_.fetch_add(1) + 1;
  numbers_of_this_thread.emplace_back(serial_, number);
  return number;
}

}  // namespace smddp
