// The response cache's table: see response_cache.h for who changes it and when.
#include "response_cache.h"

#include "wire.h"

namespace smddp {

std::string ResponseCache::key_of(const std::string& name, const Signature& sig) {
  // A name that recurs with a few signatures in turn (the torch Backend's names repeat by
  // position, see frontends/torch/csrc/backend.cc) gets an entry for each.
  Writer w;
  w.put_string(name);
  sig.write(w);
  return w.take();
}

uint32_t ResponseCache::find(const std::string& name, const Signature& sig) const {
  auto it = by_key_.find(key_of(name, sig));
  return it == by_key_.end() ? kNone : it->second;
}

const ResponseCache::Item& ResponseCache::resolve(uint32_t id, int from) const {
  auto live = live_.find(id);
  if (live != live_.end()) return live->second.item;
  auto retired = retired_.find(id);
  if (retired != retired_.end()) return retired->second.item;
  throw Error("rank " + std::to_string(from) + " announced response-cache id " + std::to_string(id) +
              ", which rank 0 never assigned (a corrupt message, or ranks of different versions)");
}

const ResponseCache::Item* ResponseCache::live_item(uint32_t id) const {
  auto it = live_.find(id);
  return it == live_.end() ? nullptr : &it->second.item;
}

void ResponseCache::touch(uint32_t id) {
  auto it = live_.find(id);
  if (it != live_.end() && it->second.recency != recency_.end())
    recency_.splice(recency_.begin(), recency_, it->second.recency);
}

uint32_t ResponseCache::take_free_id() {
  if (!free_ids_.empty()) {
    uint32_t id = free_ids_.back();
    free_ids_.pop_back();
    return id;
  }
  if (next_id_ == kNone) throw Error("internal: response-cache ids exhausted");
  return next_id_++;
}

uint32_t ResponseCache::use(const std::string& name, const Signature& sig, uint64_t seq, uint64_t cycle,
                            std::vector<uint32_t>* evicted) {
  if (capacity_ == 0) return kNone;
  std::string key = key_of(name, sig);
  auto hit = by_key_.find(key);
  if (hit != by_key_.end()) {
    Live& l = live_.at(hit->second);
    recency_.splice(recency_.begin(), recency_, l.recency);
    return hit->second;
  }
  if (live_.size() >= capacity_) {
    const uint32_t victim = recency_.back();
    recency_.pop_back();
    Live& old = live_.at(victim);
    by_key_.erase(old.key);
    retired_[victim] = Retired{std::move(old.item), seq, cycle};
    live_.erase(victim);
    evicted->push_back(victim);
    ++evictions_;
  }
  const uint32_t id = take_free_id();
  recency_.push_front(id);
  by_key_[key] = id;
  live_[id] = Live{{name, sig}, std::move(key), recency_.begin()};
  return id;
}

void ResponseCache::acknowledged(uint64_t seq, uint64_t cycles) {
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (it->second.seq <= seq && it->second.cycle < cycles) {
      free_ids_.push_back(it->first);
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
}

void ResponseCache::learn(uint32_t id, const std::string& name, const Signature& sig) {
  if (id == kNone) return;
  auto it = live_.find(id);
  if (it != live_.end()) {
    if (it->second.item.name == name && it->second.item.sig == sig) return;
    forget(id);  // rank 0 reassigned it; the eviction must have come first, but be safe
  }
  std::string key = key_of(name, sig);
  auto stale = by_key_.find(key);
  if (stale != by_key_.end()) live_.erase(stale->second);
  by_key_[key] = id;
  live_[id] = Live{{name, sig}, std::move(key), recency_.end()};
}

void ResponseCache::forget(uint32_t id) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  auto k = by_key_.find(it->second.key);
  if (k != by_key_.end() && k->second == id) by_key_.erase(k);
  live_.erase(it);
}

}  // namespace smddp
