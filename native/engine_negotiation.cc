// Negotiation, the engine's side: announcing queued tensors to the coordinator (rank 0),
// and running the responses it sends back. What the coordinator decides, and why, is in
// coordinator.h; the messages are in messages.h.
#include <algorithm>

#include "engine.h"
#include "wire.h"

namespace smddp {

bool Engine::announce_new_entries() {
  std::deque<std::shared_ptr<Entry>> fresh;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (batch_depth_ > 0 && !flush_batch_) return false;
    flush_batch_ = false;
    fresh.swap(incoming_);
  }
  if (fresh.empty()) return false;
  AnnouncementMessage m;
  m.responses_applied = coordinator_ ? coordinator_->messages_built() : responses_applied_;
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
    } else {
      a.name = e->name;
      a.sig = e->sig;
      counters_.cache_misses++;
    }
    m.announcements.push_back(std::move(a));
  }
  if (m.announcements.empty()) return true;
  if (coordinator_) {
    coordinator_->receive(0, m.announcements, m.responses_applied, now_us());
  } else {
    std::string msg = encode_announcements(m);
    counters_.negotiation_bytes += msg.size();
    comm_->send_message(0, kControlChannel, msg, "announcing tensors to rank 0");
  }
  return true;
}

bool Engine::poll_coordinator_messages() {
  bool busy = false;
  std::string msg;
  for (int r = 1; r < size(); ++r) {
    if (rank_gone_[r]) continue;
    while (comm_->channel(r, kControlChannel)->poll_message(&msg)) {
      busy = true;
      Reader reader(std::move(msg));
      auto type = MessageType(reader.get<uint8_t>());
      if (type == MessageType::kGoodbye) {
        rank_gone_[r] = true;
        coordinator_->rank_left(r);
        break;
      }
      if (type == MessageType::kAbort) throw PeerError(reader.get_string());
      if (type != MessageType::kAnnounce) throw Error("unexpected negotiation message from rank " + std::to_string(r));
      AnnouncementMessage m = decode_announcements(reader);
      coordinator_->receive(r, m.announcements, m.responses_applied, now_us());
    }
  }
  return busy;
}

bool Engine::send_responses() {
  ResponseMessage m = coordinator_->respond(fusion_bytes_.load(), now_us());
  if (m.responses.empty()) return false;
  std::string msg = encode_responses(m);
  for (int r = 1; r < size(); ++r) {
    if (rank_gone_[r]) continue;
    comm_->send_message(r, kControlChannel, msg, "sending negotiation responses");
  }
  counters_.negotiation_round_trips++;
  apply(m);
  return true;
}

bool Engine::poll_responses() {
  bool busy = false;
  std::string msg;
  Channel* ch = comm_->channel(0, kControlChannel);
  while (ch->poll_message(&msg)) {
    busy = true;
    Reader reader(std::move(msg));
    auto type = MessageType(reader.get<uint8_t>());
    if (type == MessageType::kGoodbye) {
      // Rank 0 closes its connections next: stop reading them, it is not a failure.
      rank_gone_[0] = true;
      fail_everything("rank 0 has shut down; no further collectives are possible", "");
      return true;
    }
    if (type == MessageType::kAbort) throw PeerError(reader.get_string());
    last_heard_from_coordinator_us_ = now_us();
    if (type == MessageType::kHeartbeat) continue;
    if (type != MessageType::kRespond) throw Error("unexpected negotiation message from rank 0");
    counters_.negotiation_round_trips++;
    apply(decode_responses(reader));
  }
  return busy;
}

void Engine::apply(const ResponseMessage& m) {
  counters_.cache_evictions += m.evicted.size();
  for (const auto& resp : m.responses) execute(resp);
  if (!coordinator_) {
    // After the responses: an entry of this message may have been given an id that a later
    // entry of the same message evicted (execute() has just learned it).
    for (uint32_t id : m.evicted) replica_.forget(id);
    ++responses_applied_;
  }
}

void Engine::check_coordinator_alive() {
  if (pending_.empty()) return;
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

}  // namespace smddp
