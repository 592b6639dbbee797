// The coordinator: rank 0's half of negotiation, as a unit with no sockets and no threads.
//
// Every rank announces the collectives it has queued (messages.h). The coordinator tallies
// the announcements by name; once every rank has announced a name it checks that all agree
// (op, dtype, shape, root, ...), and answers with one response message, the same for every
// rank, that says what runs next and in which order:
// - collectives in the order they became ready, allreduces that agree on dtype, reduction and
//   scaling fused into buckets of at most the fusion threshold;
// - an error for a name the ranks disagree on (naming the field and each rank's value), for
//   ragged sizes that do not fit a receiver, and for a name some ranks announced but others
//   did not within the stall timeout or never will (they shut down).
// It also owns the response cache (response_cache.h): ids are assigned and evicted here, and
// the message carries what changed.
//
// The Engine moves bytes in and out of it; tests drive it directly (tests/test_coordinator.py).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "messages.h"
#include "response_cache.h"

namespace smddp {

class Coordinator {
 public:
  // hit_cycles: the engine also agrees on cached collectives in hit cycles (hit_agreement.h).
  Coordinator(int world_size, size_t cache_capacity, double stall_timeout_s, double stall_warning_s,
              bool hit_cycles = false);

  // Rank `from`'s announcements, in the order it made them. `applied`: how many response
  // messages that rank had applied when it sent them (it may still name ids evicted since).
  // `now_us` starts the stall clock of names announced for the first time.
  void receive(int from, const std::vector<Announcement>& list, uint64_t applied, int64_t now_us);
  // `rank` said goodbye: a collective it has not announced can never run.
  void rank_left(int rank);
  // How many response messages rank `from` has applied (it says so in every message).
  void acknowledge(int from, uint64_t applied);
  // Hit cycles rank 0 has completed: a response built now runs after that many, and ids
  // evicted before the last of them may be reused once acknowledged (response_cache.h).
  void cycle_completed(uint64_t cycles);
  // The next response message, carrying `handed_over` (hit ids the coordinator takes over,
  // see messages.h); no responses and no hand-overs means there is nothing to send. Stall
  // checks run at most every 100 ms of `now_us`.
  ResponseMessage respond(int64_t fusion_bytes, int64_t now_us, std::vector<uint32_t> handed_over = {});
  // Whether some ranks have announced `name` and others not yet.
  bool has_tally(const std::string& name) const { return tallies_.count(name) != 0; }

  ResponseCache& cache() { return cache_; }
  // Response messages built so far (the sequence number of the last one).
  uint64_t messages_built() const { return seq_; }
  // Names announced by some ranks and not yet by all.
  size_t waiting() const { return tallies_.size(); }

 private:
  struct Tally {
    std::vector<bool> seen;
    std::vector<Signature> sigs;
    std::vector<std::vector<int64_t>> per_rank;
    int count = 0;
    int64_t first_us = 0;  // when the first rank's announcement arrived
    bool stall_warned = false;
  };
  std::string describe_mismatch(const std::string& name, const Tally& t) const;
  void add_ready(const std::string& name, Tally t, class ResponseBuilder& build, ResponseMessage& m);
  void add_stall_errors(int64_t now_us, ResponseMessage& m);
  void release_retired_ids();

  int size_;
  bool hit_cycles_;
  double stall_timeout_s_, stall_warning_s_;
  ResponseCache cache_;
  std::unordered_map<std::string, Tally> tallies_;
  std::vector<std::string> ready_;  // names every rank has announced, in readiness order
  std::vector<bool> gone_;          // ranks that said goodbye
  std::vector<uint64_t> applied_;   // per rank: response messages it has acknowledged
  uint64_t seq_ = 0;
  uint64_t cycles_completed_ = 0;
  int64_t last_stall_check_us_ = 0;
};

}  // namespace smddp
