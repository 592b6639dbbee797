// Point-to-point send/recv on the dedicated p2p channel of each peer pair. A message is a
// 16-byte header (tag, bytes) and its payload. Sends to a peer go out in order; a message
// goes to the earliest posted receive from that peer with the same tag, and one that
// arrives before any such receive is buffered until it is posted (as Gloo and MPI match by
// tag). Progress is non-blocking, interleaved with collectives by the engine loop.
#include <algorithm>
#include <cstring>
#include <vector>

#include "engine.h"

namespace smddp {

namespace {
std::string size_mismatch(const Entry& e, int64_t bytes) {
  return "recv from rank " + std::to_string(e.peer) + " with tag " + std::to_string(e.tag) + " expected " +
         std::to_string(e.count) + " bytes, but rank " + std::to_string(e.peer) + " sent " + std::to_string(bytes);
}
}  // namespace

bool Engine::progress_sends(int peer, std::deque<std::shared_ptr<Entry>>& queue) {
  bool busy = false;
  Channel* ch = comm_->channel(peer, kP2PChannel);
  while (!queue.empty()) {
    Entry& e = *queue.front();
    if (e.p2p_header_done < sizeof(e.p2p_header)) {
      e.p2p_header[0] = e.tag;
      e.p2p_header[1] = int64_t(e.count);
      size_t n = ch->try_send(reinterpret_cast<char*>(e.p2p_header) + e.p2p_header_done,
                              sizeof(e.p2p_header) - e.p2p_header_done);
      e.p2p_header_done += n;
      busy |= n > 0;
      if (e.p2p_header_done < sizeof(e.p2p_header)) break;
    }
    size_t n = ch->try_send(e.in + e.p2p_done, e.count - e.p2p_done);
    e.p2p_done += n;
    busy |= n > 0;
    if (e.p2p_done < e.count) break;
    counters_.p2p_messages++;
    complete(queue.front(), "");
    queue.pop_front();
    busy = true;
  }
  return busy;
}

bool Engine::match_unexpected(int peer, const std::shared_ptr<Entry>& recv) {
  auto it = p2p_unexpected_.find(peer);
  if (it == p2p_unexpected_.end()) return false;
  auto& list = it->second;
  auto msg = std::find_if(list.begin(), list.end(), [&](const auto& m) { return m.first == recv->tag; });
  if (msg == list.end()) return false;
  std::string error;
  if (msg->second.size() != recv->count) {
    error = size_mismatch(*recv, int64_t(msg->second.size()));
  } else if (!msg->second.empty()) {
    std::memcpy(recv->out, msg->second.data(), msg->second.size());
  }
  list.erase(msg);
  counters_.p2p_messages++;
  complete(recv, error);
  return true;
}

bool Engine::progress_receives(int peer, std::deque<std::shared_ptr<Entry>>& posted) {
  bool busy = false;
  // Receives posted after their message arrived complete from the buffer.
  for (auto it = posted.begin(); it != posted.end();) {
    if (match_unexpected(peer, *it)) {
      it = posted.erase(it);
      busy = true;
    } else {
      ++it;
    }
  }
  // Read on only while a receive waits: a message without one stays in the channel unless
  // it stands in front of the one that is wanted.
  Channel* ch = comm_->channel(peer, kP2PChannel);
  IncomingMessage& in = p2p_incoming_[peer];
  while (!posted.empty() || in.header_done > 0) {
    if (in.header_done < sizeof(in.header)) {
      size_t n = ch->try_recv(reinterpret_cast<char*>(in.header) + in.header_done, sizeof(in.header) - in.header_done);
      in.header_done += n;
      busy |= n > 0;
      if (in.header_done < sizeof(in.header)) break;
      auto match = std::find_if(posted.begin(), posted.end(), [&](const auto& e) { return e->tag == in.header[0]; });
      if (match != posted.end() && (*match)->count == size_t(in.header[1])) {
        in.target = *match;
        posted.erase(match);
      } else {
        // Unexpected (or the wrong size for the receive with its tag: buffered, and that
        // receive fails with the sizes when it matches below).
        in.buffer.assign(size_t(in.header[1]), 0);
      }
    }
    const size_t total = size_t(in.header[1]);
    char* dst = in.target ? in.target->out : in.buffer.data();
    size_t n = ch->try_recv(dst + in.payload_done, total - in.payload_done);
    in.payload_done += n;
    busy |= n > 0;
    if (busy) heard_from(peer, now_us());
    if (in.payload_done < total) break;
    if (in.target) {
      counters_.p2p_messages++;
      complete(in.target, "");
    } else {
      p2p_unexpected_[peer].emplace_back(in.header[0], std::move(in.buffer));
      for (auto it = posted.begin(); it != posted.end(); ++it) {
        if (match_unexpected(peer, *it)) {
          posted.erase(it);
          break;
        }
      }
    }
    in = IncomingMessage();
    busy = true;
  }
  return busy;
}

bool Engine::progress_p2p() {
  if (p2p_sends_.empty() && p2p_recvs_.empty()) return false;
  bool busy = false;
  for (auto it = p2p_sends_.begin(); it != p2p_sends_.end();) {
    busy |= progress_sends(it->first, it->second);
    it = it->second.empty() ? p2p_sends_.erase(it) : std::next(it);
  }
  for (auto it = p2p_recvs_.begin(); it != p2p_recvs_.end();) {
    busy |= progress_receives(it->first, it->second);
    // A message still arriving keeps its peer here even when no receive is posted.
    const bool reading = p2p_incoming_[it->first].header_done > 0;
    it = it->second.empty() && !reading ? p2p_recvs_.erase(it) : std::next(it);
  }
  int64_t now = now_us();
  check_p2p_peers_alive(now);
  if (busy) {
    last_p2p_progress_us_ = now;
  } else if (now - last_p2p_progress_us_ > int64_t(config_.timeout_s * 1e6)) {
    expire_p2p();
    last_p2p_progress_us_ = now;
  }
  return busy;
}

// Nothing moved for the timeout. Operations no byte of which has moved fail alone (a receive
// whose sender never posted, a send nobody reads): the peer may be alive and the engine stays
// usable. A message stopped halfway means a stuck or dead peer, and the byte stream with it
// cannot be resumed: that aborts the job.
void Engine::expire_p2p() {
  // A peer that does not answer pings is not merely quiet: name it, as check_p2p_peers_alive
  // will once its silence reaches the timeout (a second of silence is a few unanswered pings).
  const int64_t now = now_us();
  for (const auto* ops : {&p2p_recvs_, &p2p_sends_})
    for (const auto& kv : *ops) {
      std::string stalled = unresponsive(kv.first, now, 1.0);
      if (!stalled.empty()) throw PeerError(stalled);
    }
  const std::string why = "made no progress for " + std::to_string(int(config_.timeout_s)) +
                          " s (SMDDP_TIMEOUT): is the peer posting the matching call?";
  std::string halfway;
  for (auto& kv : p2p_recvs_) {
    if (p2p_incoming_[kv.first].header_done > 0) {
      halfway += " a message from rank " + std::to_string(kv.first) + ";";
      continue;
    }
    for (auto& e : kv.second)
      complete(e, "recv from rank " + std::to_string(kv.first) + " with tag " + std::to_string(e->tag) + " " + why);
    kv.second.clear();
  }
  for (auto& kv : p2p_sends_) {
    auto& queue = kv.second;
    if (!queue.empty() && (queue.front()->p2p_header_done > 0 || queue.front()->p2p_done > 0)) {
      halfway += " a send to rank " + std::to_string(kv.first) + ";";
      continue;
    }
    for (auto& e : queue)
      complete(e, "send to rank " + std::to_string(kv.first) + " with tag " + std::to_string(e->tag) + " " + why);
    queue.clear();
  }
  if (!halfway.empty())
    throw PeerError("point-to-point transfers stopped halfway for " + std::to_string(int(config_.timeout_s)) +
                    " s (SMDDP_TIMEOUT):" + halfway + " the peer is stuck or dead");
}

void Engine::heard_from(int peer, int64_t now) {
  if (liveness_.empty()) liveness_.resize(size_t(size()));
  liveness_[size_t(peer)].last_heard_us = now;
  liveness_[size_t(peer)].unanswered_since_us = 0;
}

// A peer's silence counts only from a ping it left unanswered: a peer that is merely quiet
// (a pipeline stage computing before its next send) answers from its engine thread within
// milliseconds. The first unanswered ping is kept when this rank stops waiting (a transfer
// that expired and is posted again), so a stopped peer is named within the timeout however
// often its transfers are retried.
void Engine::check_p2p_peers_alive(int64_t now) {
  if (liveness_.empty()) liveness_.resize(size_t(size()));
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank_ || rank_gone_[size_t(peer)] || (quiet_peers_.size() > size_t(peer) && quiet_peers_[peer]))
      continue;
    auto sends = p2p_sends_.find(peer), recvs = p2p_recvs_.find(peer);
    const bool waiting = (sends != p2p_sends_.end() && !sends->second.empty()) ||
                         (recvs != p2p_recvs_.end() && !recvs->second.empty()) || p2p_incoming_[peer].header_done > 0;
    PeerLiveness& l = liveness_[size_t(peer)];
    if (!waiting || now - l.last_heard_us < kHeartbeatUs) continue;
    if (now - l.last_ping_us >= kHeartbeatUs) {
      try {
        comm_->send_message(peer, kControlChannel, std::string(1, char(MessageType::kPing)), "pinging a peer");
      } catch (const PeerError&) {
        continue;  // its connection is closed: the transfer itself reports that
      }
      l.last_ping_us = now;
      if (l.unanswered_since_us == 0) l.unanswered_since_us = now;
    }
    std::string stalled = unresponsive(peer, now, stall_timeout_s_);
    if (!stalled.empty()) throw PeerError(stalled);
  }
}

std::string Engine::unresponsive(int peer, int64_t now, double seconds) {
  if (liveness_.size() <= size_t(peer)) return "";
  const PeerLiveness& l = liveness_[size_t(peer)];
  if (l.unanswered_since_us == 0) return "";
  const double silent_s = double(now - l.unanswered_since_us) / 1e6;
  if (silent_s <= seconds) return "";
  return "rank " + std::to_string(peer) + " has not answered for " + std::to_string(int(silent_s + 0.5)) +
         " s while this rank waits on a point-to-point transfer with it: it is stalled (stopped, hung) or its host "
         "is unreachable (SMDDP_TIMEOUT, or the framework's timeout)";
}

}  // namespace smddp
