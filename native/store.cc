#include "store.h"

#include <poll.h>

#include <vector>

#include "wire.h"

namespace smddp {

namespace {
constexpr uint8_t kSet = 1;
constexpr uint8_t kGet = 2;
constexpr double kHandshakeTimeout = 10.0;
const char kWelcome[] = "smddp-store-ok";
}  // namespace

StoreServer::StoreServer(int port, std::string secret)
    : listener_(Socket::listen_on(port)), port_(listener_.local_port()), secret_(std::move(secret)) {
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
            c.sock.close();
            continue;
          }
          c.authenticated = true;
          send_frame(c.sock, kWelcome, kHandshakeTimeout, "store client " + c.desc);
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

StoreClient::StoreClient(const std::string& host, int port, const std::string& secret, double timeout_s)
    : timeout_s_(timeout_s) {
  sock_ = Socket::connect_to(host, port, timeout_s);
  send_frame(sock_, secret, timeout_s, "rendezvous store " + host + ":" + std::to_string(port));
  std::string reply;
  try {
    reply = recv_frame(sock_, timeout_s, "rendezvous store");
  } catch (const PeerError&) {
    throw PeerError("the rendezvous store at " + host + ":" + std::to_string(port) +
                    " closed the connection: this process's SMDDP_SECRET differs from rank 0's, or rank 0 exited");
  }
  if (reply != kWelcome) throw PeerError("unexpected reply from the rendezvous store");
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
