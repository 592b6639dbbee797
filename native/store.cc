#include "store.h"

#include <poll.h>

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "frame_reader.h"
#include "wire.h"

namespace smddp {

namespace {
constexpr uint8_t kSet = 1;
constexpr uint8_t kGet = 2;
const char kWelcome[] = "smddp-store-ok";
const char kRefused[] = "smddp-store-refused";
}  // namespace

StoreServer::StoreServer(int port, std::string secret, int generation, bool loopback, StoreLimits limits)
    : listener_(Socket::listen_on(port, loopback)),
      port_(listener_.local_port()),
      secret_(std::move(secret)),
      generation_(generation),
      limits_(limits) {
  listener_.set_nonblocking(true);
  thread_ = std::thread([this] { serve(); });
}

StoreServer::~StoreServer() { stop(); }

void StoreServer::stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  listener_.close();
}

namespace {
struct StoreConnection {
  Socket sock;
  std::string desc;
  FrameReader reader;
  bool authenticated = false;
  Clock::time_point deadline;  // to authenticate by
  std::string out;             // reply bytes not yet sent
  size_t out_sent = 0;
  explicit StoreConnection(size_t max_frame) : reader(max_frame) {}
};

std::string framed(const std::string& payload) {
  uint64_t len = payload.size();
  return std::string(reinterpret_cast<const char*>(&len), sizeof(len)) + payload;
}
}  // namespace

// One thread multiplexes every connection with poll(): each reads its frames a little at a
// time (frame_reader.h), so no client, however slow, idle or hostile, holds up another.
void StoreServer::serve() {
  std::vector<std::unique_ptr<StoreConnection>> conns;
  auto refuse = [&](StoreConnection& c, const std::string& why) {
    ++refused_;
    SMDDP_LOG(0, "store refused a connection from " + c.desc + ": " + why);
    c.sock.close();
  };
  while (!stopping_) {
    std::vector<pollfd> fds;
    fds.push_back({listener_.fd(), POLLIN, 0});
    for (auto& c : conns) fds.push_back({c->sock.fd(), short(POLLIN | (c->out.size() > c->out_sent ? POLLOUT : 0)), 0});
    ::poll(fds.data(), fds.size(), 50);
    if (fds[0].revents & POLLIN) {
      for (int i = 0; i < 64; ++i) {  // drain the backlog
        auto c = std::make_unique<StoreConnection>(limits_.handshake_bytes);
        c->sock = listener_.accept_within(0, &c->desc);
        if (!c->sock.valid()) break;
        if (conns.size() >= limits_.max_connections) {
          refuse(*c, "too many open connections (" + std::to_string(conns.size()) + ")");
          continue;
        }
        c->sock.set_nonblocking(true);
        c->deadline = Clock::now() + std::chrono::milliseconds(int64_t(limits_.handshake_deadline_s * 1000));
        conns.push_back(std::move(c));
      }
    }
    const auto now = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      StoreConnection& c = *conns[i];
      const short ev = i + 1 < fds.size() ? fds[i + 1].revents : 0;
      try {
        if (ev & (POLLIN | POLLHUP | POLLERR)) {
          while (c.sock.valid() && c.reader.read_some(c.sock, "store client " + c.desc)) {
            std::string msg = c.reader.take();
            if (!c.authenticated) {
              if (!secrets_equal(msg, secret_)) {
                // Says why (best effort), so a rank with the wrong secret fails at once.
                c.out = framed(kRefused);
                c.sock.try_send(c.out.data(), c.out.size(), "store client " + c.desc);
                refuse(c, "it presented a wrong or missing secret (SMDDP_SECRET)");
                break;
              }
              c.authenticated = true;
              c.reader.set_max_bytes(limits_.request_bytes);
              c.out += framed(kWelcome + std::to_string(generation_));
              continue;
            }
            Reader r(std::move(msg));
            const uint8_t op = r.get<uint8_t>();
            const std::string key = r.get_string();
            Writer w;
            if (op == kSet) {
              data_[key] = r.get_string();
              w.put<uint8_t>(1);
            } else if (op == kGet) {
              auto it = data_.find(key);
              w.put<uint8_t>(it != data_.end());
              w.put_string(it != data_.end() ? it->second : std::string());
            } else {
              throw Error("unknown store request " + std::to_string(op));
            }
            c.out += framed(w.str());
          }
        }
        if (c.sock.valid() && c.out.size() > c.out_sent) {
          c.out_sent += c.sock.try_send(c.out.data() + c.out_sent, c.out.size() - c.out_sent, "store client " + c.desc);
          if (c.out_sent == c.out.size()) {
            c.out.clear();
            c.out_sent = 0;
          }
        }
        if (c.sock.valid() && !c.authenticated && now > c.deadline)
          refuse(c, "it did not present the secret within " + std::to_string(limits_.handshake_deadline_s) + " s");
      } catch (const PeerError& e) {
        // Closed or reset (normal when a client is done), or a frame above the cap.
        if (!c.authenticated && c.sock.valid()) refuse(c, e.what());
        c.sock.close();
      } catch (const Error& e) {
        refuse(c, std::string("a malformed request: ") + e.what());
      }
    }
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const auto& c) { return !c->sock.valid(); }),
                conns.end());
  }
}

StoreClient::StoreClient(const std::string& host, int port, const std::string& secret, double timeout_s, int generation)
    : timeout_s_(timeout_s) {
  const std::string where = "rendezvous store " + host + ":" + std::to_string(port);
  const std::string welcome = kWelcome + std::to_string(generation);
  auto start = Clock::now();
  while (true) {
    sock_ = Socket::connect_to(host, port, std::max(1.0, timeout_s - seconds_since(start)));
    std::string reply;
    try {
      send_frame(sock_, secret, timeout_s, where);
      reply = recv_frame(sock_, timeout_s, "rendezvous store", 4096);
    } catch (const PeerError&) {
      // Closed without a word (or reset while we spoke): a store shutting down, rank 0
      // re-initialising. Try again until the timeout.
      reply.clear();
    }
    if (reply == welcome) return;
    if (reply == kRefused)
      throw PeerError("the " + where + " refused this process: its SMDDP_SECRET differs from rank 0's");
    if (!reply.empty() && reply.rfind(kWelcome, 0) != 0) throw PeerError("unexpected reply from the " + where);
    // The store of rank 0's previous engine (or one closing): wait for the new one.
    sock_.close();
    if (seconds_since(start) > timeout_s) {
      if (reply.empty())
        throw PeerError("the " + where + " closed the connection for " + std::to_string(int(timeout_s)) +
                        " s: rank 0 exited or is restarting its engine");
      throw PeerError("the " + where + " still serves start " + reply.substr(sizeof(kWelcome) - 1) +
                      " of the engine after " + std::to_string(int(timeout_s)) + " s; this rank is at start " +
                      std::to_string(generation) + " (ranks must initialise and shut down the same number of times)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string StoreClient::request(const std::string& payload) {
  std::lock_guard<std::mutex> lock(mutex_);
  send_frame(sock_, payload, timeout_s_, "rendezvous store");
  return recv_frame(sock_, timeout_s_, "rendezvous store", StoreLimits().request_bytes + 64);
}

void StoreClient::set(const std::string& key, const std::string& value) {
  Writer w;
  w.put<uint8_t>(kSet);
  w.put_string(key);
  w.put_string(value);
  request(w.str());
}

std::string StoreClient::get(const std::string& key, double timeout_s) {
  auto start = Clock::now();
  int delay_us = 200;
  while (true) {
    Writer w;
    w.put<uint8_t>(kGet);
    w.put_string(key);
    Reader r(request(w.str()));
    if (r.get<uint8_t>()) return r.get_string();
    if (seconds_since(start) > timeout_s)
      throw PeerError("timed out after " + std::to_string(int(timeout_s)) + " s waiting for rendezvous key '" + key +
                      "'");
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    delay_us = std::min(delay_us * 2, 20000);
  }
}

}  // namespace smddp
