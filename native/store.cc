#include "store.h"

#include <poll.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "wire.h"

namespace smddp {

namespace {
constexpr uint8_t kSet = 1;
constexpr uint8_t kGet = 2;
constexpr double kHandshakeTimeout = 10.0;
const char kWelcome[] = "smddp-store-ok";
const char kRefused[] = "smddp-store-refused";
}  // namespace

StoreServer::StoreServer(int port, std::string secret, int generation)
    : listener_(Socket::listen_on(port)), port_(listener_.local_port()), secret_(std::move(secret)),
      generation_(generation) {
  thread_ = std::thread([this] { serve(); });
}

StoreServer::~StoreServer() { stop(); }

void StoreServer::stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  listener_.close();
}

// One thread multiplexes all clients with poll(); requests are tiny and rare (bootstrap only).
void StoreServer::serve() {
  struct Client {
    Socket sock;
    bool authenticated = false;
    std::string desc;
  };
  std::vector<Client> clients;
  while (!stopping_) {
    std::vector<pollfd> fds;
    fds.push_back({listener_.fd(), POLLIN, 0});
    for (auto& c : clients) fds.push_back({c.sock.fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
    if (fds[0].revents & POLLIN) {
      Client c;
      c.sock = listener_.accept_within(0, &c.desc);
      if (c.sock.valid()) clients.push_back(std::move(c));
    }
    for (size_t i = 0; i < clients.size(); ++i) {
      if (!(fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Client& c = clients[i];
      try {
        std::string msg = recv_frame(c.sock, kHandshakeTimeout, "store client " + c.desc);
        if (!c.authenticated) {
          if (!secrets_equal(msg, secret_)) {
            ++refused_;
            SMDDP_LOG(0, "store refused a connection from " + c.desc +
                             ": it presented a wrong or missing secret (SMDDP_SECRET)");
            try {  // says why, so a rank with the wrong secret fails at once instead of retrying
              send_frame(c.sock, kRefused, kHandshakeTimeout, "store client " + c.desc);
            } catch (const Error&) {
            }
            c.sock.close();
            continue;
          }
          c.authenticated = true;
          send_frame(c.sock, kWelcome + std::to_string(generation_), kHandshakeTimeout, "store client " + c.desc);
          continue;
        }
        Reader r(msg);
        uint8_t op = r.get<uint8_t>();
        std::string key = r.get_string();
        Writer w;
        if (op == kSet) {
          data_[key] = r.get_string();
          w.put<uint8_t>(1);
        } else if (op == kGet) {
          auto it = data_.find(key);
          w.put<uint8_t>(it != data_.end());
          w.put_string(it != data_.end() ? it->second : std::string());
        } else {
          throw Error("unknown store request");
        }
        send_frame(c.sock, w.str(), kHandshakeTimeout, "store client " + c.desc);
      } catch (const Error&) {
        c.sock.close();  // the client went away (normal at shutdown) or spoke garbage
      }
    }
    // Drop closed clients.
    std::vector<Client> alive;
    for (auto& c : clients)
      if (c.sock.valid()) alive.push_back(std::move(c));
    clients.swap(alive);
  }
}

StoreClient::StoreClient(const std::string& host, int port, const std::string& secret, double timeout_s,
                         int generation)
    : timeout_s_(timeout_s) {
  const std::string where = "rendezvous store " + host + ":" + std::to_string(port);
  const std::string welcome = kWelcome + std::to_string(generation);
  auto start = Clock::now();
  while (true) {
    sock_ = Socket::connect_to(host, port, std::max(1.0, timeout_s - seconds_since(start)));
    send_frame(sock_, secret, timeout_s, where);
    std::string reply;
    try {
      reply = recv_frame(sock_, timeout_s, "rendezvous store");
    } catch (const PeerError&) {
      reply.clear();  // closed without a word: a store shutting down (rank 0 re-initialising)
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
  return recv_frame(sock_, timeout_s_, "rendezvous store");
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
      throw PeerError("timed out after " + std::to_string(int(timeout_s)) +
                      " s waiting for rendezvous key '" + key + "'");
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    delay_us = std::min(delay_us * 2, 20000);
  }
}

}  // namespace smddp
