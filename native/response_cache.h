// The response cache: collectives every rank has agreed on before, each under a small id, so
// the next announcement of the same collective is 4 bytes instead of its full description.
//
// Who owns what (the protocol is written out in messages.h):
// - Rank 0, the coordinator, owns the table. It assigns ids while it builds responses and,
//   when the table is full, evicts the least recently used entry.
// - Every other rank keeps a replica that changes only as rank 0's responses say, in the
//   order they arrive: "id k now means (name, signature)" and "id k is evicted".
// - An evicted id is retired, not reused at once. A rank may announce it before it has read
//   the response that evicted it, so rank 0 still resolves it until every rank has
//   acknowledged that response (each announcement message carries how many responses its
//   sender has applied) and the hit cycle after the eviction has completed on rank 0 (a kHits
//   sent just before its sender applied the eviction may still name it: hit_agreement.h
//   drops such listings). Only then does the id go back to the free list. So an id never
//   means two things to two ranks at the same time, and ids stay below capacity plus the
//   few evictions in flight.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "messages.h"

namespace smddp {

class ResponseCache {
 public:
  static constexpr uint32_t kNone = Announcement::kNoCacheId;
  explicit ResponseCache(size_t capacity) : capacity_(capacity) {}

  struct Item {
    std::string name;
    Signature sig;
  };

  // Any rank: the id (name, sig) is cached under, or kNone. Looking does not count as a use.
  uint32_t find(const std::string& name, const Signature& sig) const;

  // Rank 0: what an id announced by rank `from` stands for, live or retired; an id rank 0
  // never gave out is a protocol error naming that rank.
  const Item& resolve(uint32_t id, int from) const;
  // Any rank: what a live id stands for, or null once evicted (or never assigned).
  const Item* live_item(uint32_t id) const;
  // Rank 0: a live id was used again (a hit cycle ran it): the most recently used now.
  void touch(uint32_t id);

  // Rank 0, while building response message number `seq` after `cycle` hit cycles: the id
  // of (name, sig), now the most recently used. A pair not cached yet gets an id, evicting
  // the least recently used entry if the table is full (its id is appended to `evicted` and
  // retired as of `seq` and `cycle`). kNone when the capacity is 0.
  uint32_t use(const std::string& name, const Signature& sig, uint64_t seq, uint64_t cycle,
               std::vector<uint32_t>* evicted);

  // Rank 0: every rank has applied the responses up to message `seq`, and `cycles` hit
  // cycles have completed; ids retired by message s after cycle k can be given out again
  // once seq >= s and cycles > k.
  void acknowledged(uint64_t seq, uint64_t cycles);

  // Other ranks (replicas): apply what a response says, in response order. Rank 0 never
  // calls these: its table changed as it built the response.
  void learn(uint32_t id, const std::string& name, const Signature& sig);
  void forget(uint32_t id);

  size_t size() const { return live_.size(); }
  size_t capacity() const { return capacity_; }
  size_t retired() const { return retired_.size(); }
  uint64_t evictions() const { return evictions_; }
  // Ids rank 0 has ever handed out (the high-water mark of the id space).
  uint32_t ids_made() const { return next_id_; }

 private:
  struct Live {
    Item item;
    std::string key;
    std::list<uint32_t>::iterator recency;  // position in recency_ (rank 0 only)
  };
  struct Retired {
    Item item;
    uint64_t seq;    // the response message that evicted it
    uint64_t cycle;  // the hit cycle that message ran after
  };
  static std::string key_of(const std::string& name, const Signature& sig);
  uint32_t take_free_id();

  size_t capacity_;
  std::unordered_map<std::string, uint32_t> by_key_;
  std::unordered_map<uint32_t, Live> live_;
  std::list<uint32_t> recency_;  // most recently used first
  std::unordered_map<uint32_t, Retired> retired_;
  std::vector<uint32_t> free_ids_;
  uint32_t next_id_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace smddp
