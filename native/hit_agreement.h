// Hit cycles: how ranks agree on cached collectives without a round trip through rank 0.
//
// Horovod ANDs a bit vector of cached, ready tensors across ranks every cycle; this is the
// same agreement, peer to peer and only when there is news. In cycle c every rank sends
// every other rank the cache ids it has queued since its previous cycle (kHits, messages.h).
// A rank completes cycle c once it holds every rank's kHits for c (or that rank's goodbye).
// All ranks then hold the same messages, so this class, fed the same messages in the same
// order, computes the same result on every rank:
// - an id listed by every rank runs, all such ids of one cycle in the order rank 0 listed
//   them, allreduces fused by rank 0's threshold (ResponseBuilder, as the coordinator does);
// - a listing of an id that is no longer live in the cache (evicted, see response_cache.h) is
//   dropped; its owner announces that collective to rank 0 in full instead;
// - a listing of a handed-over id goes to the coordinator instead (forwarded).
// Rank 0's responses interleave with cycles at fixed points (ResponseMessage::after_cycle),
// and what they say about hits (hand-overs, settled names, evictions) is applied here at that
// point on every rank.
//
// No sockets, no threads: the Engine moves messages in and out, tests drive it directly
// (tests/test_coordinator.py).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "messages.h"
#include "response_cache.h"

namespace smddp {

class HitAgreement {
 public:
  HitAgreement(int world_size, int rank);

  // Cycles this rank has completed.
  uint64_t completed() const { return completed_; }
  // This rank has sent its kHits for cycle completed() + 1 and waits for the others'.
  bool open() const { return open_; }
  // Whether this rank must begin cycle completed() + 1 now: it is not open, and it has new
  // hits to list or another rank has already begun that cycle (which waits for this rank).
  bool should_begin(bool have_new_hits) const;
  // This rank's kHits for cycle completed() + 1; kept as this rank's own listing.
  HitsMessage begin(std::vector<uint32_t> ids, uint64_t responses_applied, int64_t fusion_bytes, int64_t now_us);
  // Another rank's kHits, or its goodbye, in the order its channel delivered them.
  void receive(int from, HitsMessage m);
  void receive_goodbye(int from);

  // A listing that changes hands: rank `rank` listed `id` (first listed by anyone at
  // `first_us` on this rank's clock).
  struct Listing {
    int rank;
    uint32_t id;
    int64_t first_us;
  };
  struct Outcome {
    std::vector<Response> responses;             // what runs now, in order
    std::vector<uint32_t> ran;                   // the ids that run (rank 0 marks them used)
    std::vector<uint32_t> dropped;               // this rank's listings of ids no longer live
    std::vector<Listing> forwarded;              // listings of handed-over ids (for the coordinator)
    std::vector<std::pair<int, uint64_t>> acks;  // (rank, responses_applied) of each listing
  };
  // Completes cycle completed() + 1 if every rank's listing (or goodbye) for it is in.
  // `cache` is this rank's view of the ids as the previous cycle left it.
  bool complete(const ResponseCache& cache, int64_t now_us, Outcome* out);
  // Ranks whose listing for the open cycle has not arrived (empty when not open).
  std::vector<int> missing() const;
  int64_t open_since_us() const { return open_since_us_; }
  // The cycle of the latest kHits received from `rank` (this rank's own latest, for itself).
  uint64_t last_cycle_from(int rank) const { return last_cycle_from_[rank]; }

  // Applying kRespond number `seq`, at its point in the order, on every rank: first its
  // hand-overs (returns the listings the coordinator takes over), then settled() for every
  // name it answers, then evicted() for every id it evicts.
  std::vector<Listing> hand_over(const std::vector<uint32_t>& ids);
  // The collective `name` was answered (run or failed) by response `seq`: listings of it
  // made before their rank applied that response belong to the answered one and are
  // dropped, now and when they arrive later (a rank's kHits says how many responses it had
  // applied); its hand-over ends.
  void settled(const std::string& name, uint64_t seq, bool failed = false);
  void evicted(uint32_t id);

  // Rank 0: listed ids to hand over to the coordinator now: those waiting longer than
  // `max_wait_us`, all of them once a rank has left, and those whose name `contested`
  // says the coordinator is also tallying (some rank announced it in full).
  template <typename Contested>
  std::vector<uint32_t> due_for_hand_over(int64_t now_us, int64_t max_wait_us, Contested contested) const {
    std::vector<uint32_t> due;
    for (const auto& kv : listed_)
      if (any_gone_ || now_us - kv.second.first_us > max_wait_us || contested(kv.second.name)) due.push_back(kv.first);
    return due;
  }
  size_t listed() const { return listed_.size(); }
  bool is_gone(int rank) const { return gone_[rank]; }

 private:
  struct Listed {
    std::string name;
    Signature sig;
    std::vector<bool> ranks;
    int count = 0;
    uint64_t rank0_order = 0;  // position in rank 0's listings (every ready id has one)
    int64_t first_us = 0;
  };
  struct Inbound {
    bool goodbye = false;
    HitsMessage hits;
  };
  int size_, rank_;
  uint64_t completed_ = 0;
  bool open_ = false;
  int64_t open_since_us_ = 0;
  uint64_t rank0_listings_ = 0;
  bool any_gone_ = false;
  std::vector<bool> gone_;
  std::vector<uint64_t> last_cycle_from_;  // the cycle of each rank's latest kHits
  std::vector<std::deque<Inbound>> inbox_;
  std::map<uint32_t, Listed> listed_;
  std::map<uint32_t, std::string> handed_over_;  // id -> its name, until a response settles it
  // Answered names: a listing of one from a rank that had applied fewer responses is stale.
  std::map<std::string, uint64_t> settled_at_;
};

}  // namespace smddp
