// Thin RAII wrapper over TCP sockets: listen, connect with retry, exact reads and writes
// with a deadline, and non-blocking partial transfers for the progress loops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common.h"

namespace smddp {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;

  // Binds port (0 = any free port) on every interface, or on 127.0.0.1 only, and listens.
  static Socket listen_on(int port, bool loopback = false);
  // Connects, retrying refused connections until the deadline (the server may start later).
  static Socket connect_to(const std::string& host, int port, double timeout_s);

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int local_port() const;
  // The local IP address this connected socket uses (how peers on other hosts reach us).
  std::string local_ip() const;
  void close();
  void set_nonblocking(bool on);
  void set_nodelay();

  // Accepts one connection within timeout_s; returns an invalid socket on timeout.
  Socket accept_within(double timeout_s, std::string* peer_desc = nullptr);

  // Blocking exact transfers with a deadline. Throw PeerError on EOF/reset/timeout.
  void send_all(const void* data, size_t n, double timeout_s, const std::string& what);
  void recv_all(void* data, size_t n, double timeout_s, const std::string& what);

  // Non-blocking partial transfers: bytes moved (0 if it would block); throw PeerError on
  // EOF or a reset connection.
  size_t try_send(const void* data, size_t n, const std::string& what);
  size_t try_recv(void* data, size_t n, const std::string& what);

 private:
  int fd_ = -1;
};

// Length-prefixed messages over a socket (blocking, with deadline).
void send_frame(Socket& s, const std::string& payload, double timeout_s, const std::string& what);
// Refuses (PeerError) a length prefix above max_bytes before allocating anything.
std::string recv_frame(Socket& s, double timeout_s, const std::string& what, size_t max_bytes = 1 << 20);

// Constant-time comparison for secrets.
bool secrets_equal(const std::string& a, const std::string& b);

}  // namespace smddp
