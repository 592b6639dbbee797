// Failure propagation: the rank that sees a failure first names it ("rank 3 died during
// allreduce (detected by rank 2)") and tells every other rank on its control channel (rank 0
// relays it too), so every rank raises the root cause rather than a secondary "connection
// closed", whether or not rank 0 is alive.
#include <thread>

#include "engine.h"
#include "wire.h"

namespace smddp {

namespace {
const char kAttribution[] = "(detected by rank ";

bool is_secondary(const std::string& what) {
  return what.find("connection closed by peer") != std::string::npos ||
         what.find("connection lost") != std::string::npos;
}
}  // namespace

void Engine::abort_job(const std::exception& ex) {
  std::string cause = ex.what();
  if (cause.find(kAttribution) == std::string::npos) {
    if (dynamic_cast<const PeerError*>(&ex) && is_secondary(cause)) {
      // A peer closed its connection: it probably aborted for a reason it is about to send.
      std::string root = wait_for_root_cause(1.0);
      if (!root.empty()) cause = root;
    }
    if (cause.find(kAttribution) == std::string::npos)
      cause += " " + std::string(kAttribution) + std::to_string(rank()) + ")";
  }
  std::string message = "smddp rank " + std::to_string(rank()) + ": " + cause;
  SMDDP_LOG(0, message);
  broadcast_abort(cause);
  fail_everything(message, cause);
}

void Engine::broadcast_abort(const std::string& cause) {
  if (size() == 1) return;
  Writer w;
  w.put<uint8_t>(uint8_t(MessageType::kAbort));
  w.put_string(cause);
  const std::string msg = w.take();
  const uint64_t msg_len = msg.size();
  const std::string len(reinterpret_cast<const char*>(&msg_len), sizeof(msg_len));
  // Every peer, not only rank 0: rank 0 may be the rank that died or stalled, and the
  // others must still hear the cause rather than only see connections close.
  // Best effort and bounded: a dead or stuck peer must not delay this rank's own failure.
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) continue;
    try {
      Channel* ch = comm_->channel(r, kControlChannel);
      std::string frame = len + msg;
      size_t done = 0;
      auto start = Clock::now();
      while (done < frame.size() && seconds_since(start) < 0.2) {
        size_t n = ch->try_send(frame.data() + done, frame.size() - done);
        if (!n) std::this_thread::sleep_for(std::chrono::microseconds(100));
        done += n;
      }
    } catch (const std::exception&) {
      // That peer is gone already.
    }
  }
}

std::string Engine::wait_for_root_cause(double seconds) {
  auto start = Clock::now();
  std::vector<bool> closed(size(), false);
  closed[rank()] = true;
  std::string msg;
  while (seconds_since(start) < seconds) {
    try {
      comm_->check_alive("the failure of a peer");
    } catch (const PeerError& e) {
      return e.what();  // another local rank's abort, or a local peer that died
    }
    for (int r = 0; r < size(); ++r) {
      if (closed[r]) continue;
      try {
        Channel* ch = comm_->channel(r, kControlChannel);
        while (ch->poll_message(&msg)) {
          Reader reader(std::move(msg));
          if (MessageType(reader.get<uint8_t>()) == MessageType::kAbort) return reader.get_string();
        }
      } catch (const std::exception&) {
        closed[r] = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return "";
}

}  // namespace smddp
