// Hit cycles (hit_agreement.h).
#include "hit_agreement.h"

#include <algorithm>

#include "response_builder.h"

namespace smddp {

HitAgreement::HitAgreement(int world_size, int rank)
    : size_(world_size), rank_(rank), gone_(world_size, false), last_cycle_from_(world_size, 0), inbox_(world_size) {}

bool HitAgreement::should_begin(bool have_new_hits) const {
  if (open_) return false;
  if (have_new_hits) return true;
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && !inbox_[r].empty() && !inbox_[r].front().goodbye) return true;
  return false;
}

HitsMessage HitAgreement::begin(std::vector<uint32_t> ids, uint64_t responses_applied, int64_t fusion_bytes,
                                int64_t now_us) {
  if (open_) throw Error("internal: a hit cycle begun twice");
  HitsMessage m;
  m.cycle = completed_ + 1;
  m.responses_applied = responses_applied;
  m.fusion_bytes = fusion_bytes;
  m.ids = std::move(ids);
  open_ = true;
  open_since_us_ = now_us;
  last_cycle_from_[rank_] = m.cycle;
  inbox_[rank_].push_back({false, m});
  return m;
}

void HitAgreement::receive(int from, HitsMessage m) {
  if (from < 0 || from >= size_ || from == rank_) throw Error("internal: hits from rank " + std::to_string(from));
  // A rank begins cycle c + 1 only after completing c, which needs this rank's kHits for c:
  // so its cycles arrive in order, at most two ahead of this rank's.
  if (m.cycle != last_cycle_from_[from] + 1 || m.cycle > completed_ + 2)
    throw Error("rank " + std::to_string(from) + " sent hits for cycle " + std::to_string(m.cycle) + " after cycle " +
                std::to_string(last_cycle_from_[from]) + ", while this rank has completed " +
                std::to_string(completed_) + " (a corrupt message, or ranks of different versions)");
  last_cycle_from_[from] = m.cycle;
  inbox_[from].push_back({false, std::move(m)});
}

void HitAgreement::receive_goodbye(int from) {
  if (from < 0 || from >= size_ || from == rank_) return;
  inbox_[from].push_back({true, {}});
}

std::vector<int> HitAgreement::missing() const {
  std::vector<int> out;
  if (!open_) return out;
  for (int r = 0; r < size_; ++r)
    if (inbox_[r].empty()) out.push_back(r);
  return out;
}

bool HitAgreement::complete(const ResponseCache& cache, int64_t now_us, Outcome* out) {
  if (!open_) return false;
  for (int r = 0; r < size_; ++r)
    if (inbox_[r].empty()) return false;
  const uint64_t cycle = completed_ + 1;
  int64_t fusion_bytes = 0;
  uint64_t min_applied = UINT64_MAX;
  std::vector<uint32_t> ready;
  for (int r = 0; r < size_; ++r) {
    Inbound& in = inbox_[r].front();
    if (in.goodbye) {  // stays at the front: that rank lists nothing from now on
      if (!gone_[r]) any_gone_ = true;
      gone_[r] = true;
      continue;
    }
    if (in.hits.cycle != cycle) throw Error("internal: rank " + std::to_string(r) + "'s hits out of order");
    if (r == 0) fusion_bytes = in.hits.fusion_bytes;
    const uint64_t applied = in.hits.responses_applied;
    out->acks.push_back({r, applied});
    min_applied = std::min(min_applied, applied);
    for (uint32_t id : in.hits.ids) {
      const ResponseCache::Item* item = cache.live_item(id);
      if (!item) {  // evicted before this cycle: its owner announces it in full
        if (r == rank_) out->dropped.push_back(id);
        continue;
      }
      if (!settled_at_.empty()) {
        auto s = settled_at_.find(item->name);
        if (s != settled_at_.end() && applied < s->second) continue;  // answered already
      }
      if (handed_over_.count(id)) {
        out->forwarded.push_back({r, id, now_us});
        continue;
      }
      Listed& l = listed_[id];
      if (l.ranks.empty()) {
        l.name = item->name;
        l.sig = item->sig;
        l.ranks.assign(size_, false);
        l.first_us = now_us;
      }
      if (l.ranks[r])
        throw Error("rank " + std::to_string(r) + " listed cached '" + l.name +
                    "' twice (a corrupt message, or ranks of different versions)");
      l.ranks[r] = true;
      if (r == 0) l.rank0_order = rank0_listings_++;
      if (++l.count == size_) ready.push_back(id);
    }
    inbox_[r].pop_front();
  }
  // Every ready id was listed by rank 0: run them in the order it listed them.
  std::sort(ready.begin(), ready.end(),
            [&](uint32_t a, uint32_t b) { return listed_.at(a).rank0_order < listed_.at(b).rank0_order; });
  ResponseBuilder build(&out->responses, fusion_bytes);
  for (uint32_t id : ready) {
    auto it = listed_.find(id);
    build.add({it->second.name, id}, it->second.sig);
    listed_.erase(it);
  }
  out->ran = std::move(ready);
  // Every rank's later listings come after this one's on its channel: none can be stale
  // for a response all of them had applied.
  for (auto it = settled_at_.begin(); it != settled_at_.end();) {
    if (it->second <= min_applied)
      it = settled_at_.erase(it);
    else
      ++it;
  }
  completed_ = cycle;
  open_ = false;
  return true;
}

std::vector<HitAgreement::Listing> HitAgreement::hand_over(const std::vector<uint32_t>& ids) {
  std::vector<Listing> taken;
  for (uint32_t id : ids) {
    auto it = listed_.find(id);
    // Rank 0 hands over only ids listed when it built the message, and every rank holds the
    // same listings at the point where it applies it; an id without listings keeps no name.
    handed_over_[id] = it == listed_.end() ? std::string() : it->second.name;
    if (it == listed_.end()) continue;
    for (int r = 0; r < size_; ++r)
      if (it->second.ranks[r]) taken.push_back({r, id, it->second.first_us});
    listed_.erase(it);
  }
  return taken;
}

void HitAgreement::settled(const std::string& name, uint64_t seq, bool failed) {
  bool involved = false;
  for (auto it = listed_.begin(); it != listed_.end();) {
    if (it->second.name == name) {
      it = listed_.erase(it);
      involved = true;
    } else {
      ++it;
    }
  }
  // Few ids are ever handed over at once: a scan is cheaper than an index kept in step.
  for (auto it = handed_over_.begin(); it != handed_over_.end();) {
    if (it->second == name) {
      it = handed_over_.erase(it);
      involved = true;
    } else {
      ++it;
    }
  }
  // A listing of it may still be on its way only if hits were involved, or if the response
  // is an error (a rank's listing may come after the error that stalled on it). Remembering
  // only those keeps this table small when names never repeat (none is ever cached).
  if (involved || failed) settled_at_[name] = seq;
}

void HitAgreement::evicted(uint32_t id) {
  listed_.erase(id);
  handed_over_.erase(id);
}

}  // namespace smddp
