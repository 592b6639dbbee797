// Negotiation, the engine's side: announcing queued tensors to the coordinator (rank 0),
// listing cached ones in hit cycles, reading every peer's control messages, and running
// what the responses and the cycles decide, in the one order all ranks share. What the
// coordinator decides is in coordinator.h, what a hit cycle decides in hit_agreement.h; the
// messages are in messages.h.
#include <algorithm>

#include "engine.h"
#include "wire.h"

namespace smddp {

namespace {
// A listed hit that has waited this long goes to the coordinator, whose stall checks and
// mismatch descriptions then apply (messages.h, "Hand-over").
constexpr int64_t kHandOverUs = 1000000;
}  // namespace

uint64_t Engine::responses_applied() const {
  return coordinator_ ? coordinator_->messages_built() : responses_applied_;
}

bool Engine::announce_new_entries() {
  std::deque<std::shared_ptr<Entry>> fresh;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (batch_depth_ > 0 && !flush_batch_) return false;
    flush_batch_ = false;
    fresh.swap(incoming_);
  }
  if (fresh.empty()) return false;
  std::vector<Announcement> list;
  for (auto& e : fresh) {
    if (e->is_p2p) {
      if (p2p_sends_.empty() && p2p_recvs_.empty()) last_p2p_progress_us_ = now_us();
      (e->is_send ? p2p_sends_ : p2p_recvs_)[e->peer].push_back(e);
      continue;
    }
    pending_[e->name] = e;
    e->announce_us = now_us();
    Announcement a;
    a.per_rank = e->per_rank;
    a.cache_id = known_ids().find(e->name, e->sig);
    if (a.cache_id != Announcement::kNoCacheId) {
      counters_.cache_hits++;
      // Ragged collectives carry per_rank, which a hit cycle cannot: they go by id to rank 0.
      if (hits_ && e->per_rank.empty()) {
        e->hit_id = a.cache_id;
        hit_entries_[a.cache_id] = e;
        unlisted_hits_.push_back(a.cache_id);
        continue;
      }
    } else {
      a.name = e->name;
      a.sig = e->sig;
      counters_.cache_misses++;
    }
    list.push_back(std::move(a));
  }
  send_announcements(std::move(list));
  return true;
}

void Engine::send_announcements(std::vector<Announcement> list) {
  if (list.empty()) return;
  if (coordinator_) {
    coordinator_->receive(0, list, coordinator_->messages_built(), now_us());
    return;
  }
  // After rank 0's goodbye these can never run: finish_after_rank0_left fails them.
  if (rank_gone_[0]) return;
  std::string msg = encode_announcements({responses_applied_, std::move(list)});
  counters_.negotiation_bytes += msg.size();
  comm_->send_message(0, kControlChannel, msg, "announcing tensors to rank 0");
}

void Engine::announce_in_full(uint32_t hit_id) {
  auto it = hit_entries_.find(hit_id);
  if (it == hit_entries_.end()) return;  // already run, failed or taken over
  std::shared_ptr<Entry> e = it->second;
  hit_entries_.erase(it);
  unlisted_hits_.erase(std::remove(unlisted_hits_.begin(), unlisted_hits_.end(), hit_id), unlisted_hits_.end());
  e->hit_id = Announcement::kNoCacheId;
  Announcement a;
  a.name = e->name;
  a.sig = e->sig;
  a.per_rank = e->per_rank;
  send_announcements({std::move(a)});
}

void Engine::taken_by_coordinator(int rank, uint32_t hit_id) {
  if (rank != rank_) return;
  auto it = hit_entries_.find(hit_id);
  if (it == hit_entries_.end()) return;
  it->second->hit_id = Announcement::kNoCacheId;  // its response will come from rank 0
  hit_entries_.erase(it);
}

bool Engine::poll_control_messages() {
  bool busy = false;
  std::string msg;
  if (quiet_peers_.empty()) quiet_peers_.assign(size(), false);
  for (int r = 0; r < size(); ++r) {
    if (r == rank() || rank_gone_[r] || quiet_peers_[r]) continue;
    Channel* ch = comm_->channel(r, kControlChannel);
    for (;;) {
      try {
        if (!ch->poll_message(&msg)) break;
      } catch (const PeerError&) {
        // Rank 0 and the coordinator's peers must not vanish. Between other ranks a
        // connection closed without a goodbye is not a failure by itself (that rank may be
        // done, and an operation that needs it reports it), unless a hit cycle waits on it
        // (check_hit_cycle_alive).
        if (r == 0 || rank() == 0) throw;
        quiet_peers_[r] = true;
        break;
      }
      busy = true;
      Reader reader(std::move(msg));
      const auto type = MessageType(reader.get<uint8_t>());
      if (type == MessageType::kAbort) throw PeerError(reader.get_string());
      if (r == 0) last_heard_from_coordinator_us_ = now_us();
      heard_from(r, now_us());
      if (type == MessageType::kPing) {
        const std::string pong(1, char(MessageType::kPong));
        comm_->send_message(r, kControlChannel, pong, "answering a ping");
        continue;
      }
      if (type == MessageType::kPong) continue;
      if (type == MessageType::kGoodbye) {
        rank_gone_[r] = true;
        if (hits_) hits_->receive_goodbye(r);
        if (coordinator_) coordinator_->rank_left(r);
        // Rank 0 closes its connections next: stop reading them, it is not a failure. What
        // it decided before leaving still runs (finish_after_rank0_left).
        break;
      }
      if (type == MessageType::kHits) {
        if (!hits_)
          throw Error("rank " + std::to_string(r) +
                      " agrees on cached collectives in hit cycles and this rank does not: set SMDDP_HIT_EXCHANGE "
                      "the same on every rank");
        HitsMessage m = decode_hits(reader);
        if (coordinator_) coordinator_->acknowledge(r, m.responses_applied);
        hits_->receive(r, std::move(m));
      } else if (type == MessageType::kAnnounce && coordinator_) {
        AnnouncementMessage m = decode_announcements(reader);
        coordinator_->receive(r, m.announcements, m.responses_applied, now_us());
      } else if (type == MessageType::kRespond && r == 0) {
        counters_.negotiation_round_trips++;
        waiting_responses_.push_back(decode_responses(reader));
      } else if (type == MessageType::kHeartbeat && r == 0) {
      } else {
        throw Error("unexpected negotiation message (type " + std::to_string(int(type)) + ") from rank " +
                    std::to_string(r));
      }
    }
  }
  return busy;
}

bool Engine::progress_negotiation() {
  bool busy = false;
  for (;;) {
    bool moved = false;
    // Rank 0's responses, each at its place among the hit cycles (after_cycle).
    while (!waiting_responses_.empty() && waiting_responses_.front().after_cycle <= cycles_completed()) {
      ResponseMessage m = std::move(waiting_responses_.front());
      waiting_responses_.pop_front();
      apply(m);
      moved = true;
    }
    if (hits_) {
      HitAgreement::Outcome out;
      if (hits_->complete(known_ids(), now_us(), &out)) {
        run_hit_cycle(out);
        moved = true;
      }
    }
    // Rank 0 builds a response only between its cycles, so it has one place in the order.
    if (coordinator_ && !(hits_ && hits_->open())) moved |= send_responses();
    if (hits_ && hits_->should_begin(!unlisted_hits_.empty())) {
      HitsMessage m =
          hits_->begin(std::move(unlisted_hits_), responses_applied(), rank_ == 0 ? fusion_bytes_.load() : 0, now_us());
      unlisted_hits_.clear();
      std::string msg = encode_hits(m);
      for (int r = 0; r < size(); ++r) {
        if (r == rank_ || rank_gone_[r]) continue;
        try {
          comm_->send_message(r, kControlChannel, msg, "listing cached collectives");
        } catch (const PeerError&) {
          // That rank has left or died. Reading its channel tells which: its goodbye (it
          // no longer counts in cycles), or a close without one (check_hit_cycle_alive).
          continue;
        }
        counters_.negotiation_bytes += msg.size();
      }
      moved = true;
    }
    if (!moved) break;
    busy = true;
  }
  return busy;
}

void Engine::run_hit_cycle(HitAgreement::Outcome& out) {
  counters_.hit_cycles++;
  for (uint32_t id : out.dropped) announce_in_full(id);
  if (coordinator_) {
    for (const auto& ack : out.acks) coordinator_->acknowledge(ack.first, ack.second);
    for (const auto& l : out.forwarded) forward_to_coordinator(l);
    for (uint32_t id : out.ran) coordinator_->cache().touch(id);
    coordinator_->cycle_completed(hits_->completed());
  } else {
    for (const auto& l : out.forwarded) taken_by_coordinator(l.rank, l.id);
  }
  for (const auto& resp : out.responses) execute(resp);
}

void Engine::forward_to_coordinator(const HitAgreement::Listing& l) {
  const ResponseCache::Item& item = coordinator_->cache().resolve(l.id, l.rank);
  Announcement a;
  a.name = item.name;
  a.sig = item.sig;
  coordinator_->receive(l.rank, {a}, 0, l.first_us);
  taken_by_coordinator(l.rank, l.id);
}

bool Engine::send_responses() {
  std::vector<uint32_t> due;
  if (hits_ && hits_->listed() > 0) {
    due = hits_->due_for_hand_over(now_us(), kHandOverUs,
                                   [&](const std::string& name) { return coordinator_->has_tally(name); });
    // The coordinator takes these listings before it answers, so a tally they complete is
    // answered in this same message.
    for (const auto& l : hits_->hand_over(due)) forward_to_coordinator(l);
  }
  ResponseMessage m = coordinator_->respond(fusion_bytes_.load(), now_us(), std::move(due));
  if (m.responses.empty() && m.handed_over.empty()) return false;
  std::string msg = encode_responses(m);
  for (int r = 1; r < size(); ++r) {
    if (rank_gone_[r]) continue;
    comm_->send_message(r, kControlChannel, msg, "sending negotiation responses");
  }
  counters_.negotiation_round_trips++;
  apply(m);
  return true;
}

void Engine::apply(const ResponseMessage& m) {
  // Rank 0 handed its listings over while it built the message (send_responses).
  if (hits_ && !coordinator_)
    for (const auto& l : hits_->hand_over(m.handed_over)) taken_by_coordinator(l.rank, l.id);
  const uint64_t seq = coordinator_ ? coordinator_->messages_built() : responses_applied_ + 1;
  counters_.cache_evictions += m.evicted.size();
  for (const auto& resp : m.responses) {
    if (hits_)
      for (const auto& e : resp.entries) hits_->settled(e.name, seq, resp.is_error);
    execute(resp);
  }
  // After the responses: an entry of this message may have been given an id that a later
  // entry of the same message evicted (execute() has just learned it).
  for (uint32_t id : m.evicted) {
    if (!coordinator_) replica_.forget(id);
    if (hits_) {
      hits_->evicted(id);
      announce_in_full(id);  // this rank's hit under that id, if any, goes to rank 0 now
    }
  }
  if (!coordinator_) ++responses_applied_;
}

void Engine::finish_after_rank0_left() {
  if (rank0_left_handled_) return;
  // Rank 0 may leave as soon as its part is done (a broadcast's root, say): first run every
  // response it sent and every cycle it listed in, then nothing more can be agreed.
  if (!waiting_responses_.empty() || (hits_ && hits_->completed() < hits_->last_cycle_from(0))) return;
  rank0_left_handled_ = true;
  fail_everything("rank 0 has shut down; no further collectives are possible", "");
}

void Engine::check_coordinator_alive() {
  if (pending_.empty() || rank_gone_[0]) return;
  const int64_t now = now_us();
  int64_t waiting_since = now;
  for (const auto& kv : pending_) waiting_since = std::min(waiting_since, kv.second->announce_us);
  const int64_t silent_since = std::max(waiting_since, last_heard_from_coordinator_us_);
  const double silent_s = double(now - silent_since) / 1e6;
  if (silent_s <= stall_timeout_s_) return;
  throw PeerError("rank 0 (the coordinator) has not answered for " + std::to_string(int(silent_s)) +
                  " s while this rank waits on '" + pending_.begin()->first +
                  "': it is stalled (stopped, hung) or its host is unreachable (SMDDP_TIMEOUT, or the framework's "
                  "timeout)");
}

void Engine::check_hit_cycle_alive() {
  if (!hits_ || !hits_->open()) return;
  std::vector<int> missing = hits_->missing();
  std::string closed, silent;
  for (int r : missing) {
    if (r == rank_) continue;
    std::string& list = quiet_peers_.size() > size_t(r) && quiet_peers_[r] ? closed : silent;
    list += (list.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!closed.empty())
    throw PeerError("rank(s) " + closed +
                    " closed their connection without a goodbye while this rank waits for their list of cached "
                    "collectives (they died or exited early)");
  const double waited_s = double(now_us() - hits_->open_since_us()) / 1e6;
  if (silent.empty() || waited_s <= stall_timeout_s_) return;
  throw PeerError("rank(s) " + silent + " have not answered for " + std::to_string(int(waited_s)) +
                  " s while this rank waits for their list of cached collectives: stalled (stopped, hung) or "
                  "unreachable (SMDDP_TIMEOUT, or the framework's timeout)");
}

}  // namespace smddp
