// Point-to-point send/recv on the dedicated p2p channel of each peer pair. Each message is
// a 16-byte header (tag, bytes) and the payload; messages from one peer are matched to
// receives in order. Progress is non-blocking, interleaved with collectives by the loop.
#include <vector>

#include "engine.h"

namespace smddp {

bool Engine::progress_p2p() {
  if (p2p_sends_.empty() && p2p_recvs_.empty()) return false;
  bool busy = false;
  for (auto it = p2p_sends_.begin(); it != p2p_sends_.end();) {
    auto& queue = it->second;
    Channel* ch = comm_->channel(it->first, kP2PChannel);
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
    it = queue.empty() ? p2p_sends_.erase(it) : std::next(it);
  }
  for (auto it = p2p_recvs_.begin(); it != p2p_recvs_.end();) {
    auto& queue = it->second;
    Channel* ch = comm_->channel(it->first, kP2PChannel);
    while (!queue.empty()) {
      Entry& e = *queue.front();
      if (e.p2p_header_done < sizeof(e.p2p_header)) {
        size_t n = ch->try_recv(reinterpret_cast<char*>(e.p2p_header) + e.p2p_header_done,
                                sizeof(e.p2p_header) - e.p2p_header_done);
        e.p2p_header_done += n;
        busy |= n > 0;
        if (e.p2p_header_done < sizeof(e.p2p_header)) break;
        e.p2p_discarding = e.p2p_header[0] != e.tag || size_t(e.p2p_header[1]) != e.count;
      }
      // A mismatched message is drained (keeping the stream aligned) and the recv fails.
      const size_t incoming = size_t(e.p2p_header[1]);
      std::vector<char> sink;
      char* dst = e.out + e.p2p_done;
      if (e.p2p_discarding) {
        sink.resize(std::min<size_t>(incoming - e.p2p_done, 1 << 20));
        dst = sink.data();
      }
      size_t want = e.p2p_discarding ? sink.size() : incoming - e.p2p_done;
      size_t n = ch->try_recv(dst, want);
      e.p2p_done += n;
      busy |= n > 0;
      if (e.p2p_done < incoming) break;
      std::string error;
      if (e.p2p_discarding)
        error = "recv from rank " + std::to_string(e.peer) + " expected tag " + std::to_string(e.tag) + " and " +
                std::to_string(e.count) + " bytes, but rank " + std::to_string(e.peer) + " sent tag " +
                std::to_string(e.p2p_header[0]) + " with " + std::to_string(incoming) + " bytes";
      counters_.p2p_messages++;
      complete(queue.front(), error);
      queue.pop_front();
      busy = true;
    }
    it = queue.empty() ? p2p_recvs_.erase(it) : std::next(it);
  }
  int64_t now = now_us();
  if (busy) {
    last_p2p_progress_us_ = now;
  } else if (now - last_p2p_progress_us_ > int64_t(config_.timeout_s * 1e6)) {
    std::string peers;
    for (auto& kv : p2p_sends_) peers += " send to rank " + std::to_string(kv.first) + ";";
    for (auto& kv : p2p_recvs_) peers += " recv from rank " + std::to_string(kv.first) + ";";
    throw PeerError("point-to-point operations made no progress for " + std::to_string(int(config_.timeout_s)) +
                    " s (SMDDP_TIMEOUT):" + peers + " is the peer posting the matching call?");
  }
  return busy;
}

}  // namespace smddp
