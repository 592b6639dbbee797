#include "socket.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace smddp {

namespace {

std::string errno_text() { return std::strerror(errno); }

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : int(left);
}

Clock::time_point deadline_after(double s) { return Clock::now() + std::chrono::microseconds(int64_t(s * 1e6)); }

// A connect() to a local port nobody listens on yet can be given that same port as its
// source, and TCP's simultaneous open then connects the socket to itself. It would hold the
// port rank 0 is about to listen on, and read back its own words as the peer's.
bool connected_to_itself(int fd) {
  sockaddr_in mine{}, theirs{};
  socklen_t a = sizeof(mine), b = sizeof(theirs);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &a) != 0) return false;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &b) != 0) return false;
  return mine.sin_port == theirs.sin_port && mine.sin_addr.s_addr == theirs.sin_addr.s_addr;
}

}  // namespace

Socket::~Socket() { close(); }

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

Socket Socket::listen_on(int port, bool loopback) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error("socket(): " + errno_text());
  Socket s(fd);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(loopback ? INADDR_LOOPBACK : INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    throw Error("cannot bind TCP port " + std::to_string(port) + ": " + std::strerror(err) +
                (port != 0 && err == EADDRINUSE
                     ? " (another process holds it: set SMDDP_STORE_PORT, or MASTER_PORT, to a free port)"
                     : ""));
  }
  if (::listen(fd, 1024) != 0) throw Error("listen(): " + errno_text());
  return s;
}

Socket Socket::connect_to(const std::string& host, int port, double timeout_s) {
  auto deadline = deadline_after(timeout_s);
  std::string last_error;
  int delay_ms = 5;
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc != 0) {
      last_error = std::string("cannot resolve ") + host + ": " + gai_strerror(rc);
    } else {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
        if (!connected_to_itself(fd)) {
          ::freeaddrinfo(res);
          Socket s(fd);
          s.set_nodelay();
          return s;
        }
        // Closed with a reset, not the usual close: that would leave the port in TIME_WAIT,
        // which a client socket (no SO_REUSEADDR) holds against rank 0's bind for a minute.
        linger reset{1, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
        errno = ECONNREFUSED;  // nobody listens there yet: as if refused, try again
      }
      last_error = errno_text();
      if (fd >= 0) ::close(fd);
      ::freeaddrinfo(res);
    }
    if (Clock::now() >= deadline) {
      throw PeerError("could not connect to " + host + ":" + std::to_string(port) + " within " +
                      std::to_string(int(timeout_s)) + " s (" + last_error + ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    delay_ms = std::min(delay_ms * 2, 200);
  }
}

int Socket::local_port() const {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);
}

std::string Socket::local_ip() const {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  char buf[64];
  ::inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf));
  return buf;
}

void Socket::set_nonblocking(bool on) {
  int flags = ::fcntl(fd_, F_GETFL, 0);
  ::fcntl(fd_, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void Socket::set_nodelay() {
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

Socket Socket::accept_within(double timeout_s, std::string* peer_desc) {
  pollfd p{fd_, POLLIN, 0};
  int rc = ::poll(&p, 1, int(timeout_s * 1000));
  if (rc <= 0) return Socket();
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
  if (fd < 0) return Socket();
  if (peer_desc) {
    char buf[64];
    ::inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf));
    *peer_desc = std::string(buf) + ":" + std::to_string(ntohs(addr.sin_port));
  }
  Socket s(fd);
  s.set_nodelay();
  return s;
}

size_t Socket::try_send(const void* data, size_t n, const std::string& what) {
  ssize_t rc = ::send(fd_, data, n, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (rc >= 0) return size_t(rc);
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  throw PeerError(what + ": connection lost (" + errno_text() + ")");
}

size_t Socket::try_recv(void* data, size_t n, const std::string& what) {
  if (n == 0) return 0;
  ssize_t rc = ::recv(fd_, data, n, MSG_DONTWAIT);
  if (rc > 0) return size_t(rc);
  if (rc == 0) throw PeerError(what + ": connection closed by peer");
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  throw PeerError(what + ": connection lost (" + errno_text() + ")");
}

void Socket::send_all(const void* data, size_t n, double timeout_s, const std::string& what) {
  auto deadline = deadline_after(timeout_s);
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    size_t sent = try_send(p, n, what);
    p += sent;
    n -= sent;
    if (n == 0) break;
    if (sent == 0) {
      if (Clock::now() >= deadline) throw PeerError(what + ": timed out sending");
      pollfd pf{fd_, POLLOUT, 0};
      ::poll(&pf, 1, std::min(remaining_ms(deadline), 100));
    }
  }
}

void Socket::recv_all(void* data, size_t n, double timeout_s, const std::string& what) {
  auto deadline = deadline_after(timeout_s);
  char* p = static_cast<char*>(data);
  while (n > 0) {
    size_t got = try_recv(p, n, what);
    p += got;
    n -= got;
    if (n == 0) break;
    if (got == 0) {
      if (Clock::now() >= deadline) throw PeerError(what + ": timed out waiting for data");
      pollfd pf{fd_, POLLIN, 0};
      ::poll(&pf, 1, std::min(remaining_ms(deadline), 100));
    }
  }
}

void send_frame(Socket& s, const std::string& payload, double timeout_s, const std::string& what) {
  uint64_t len = payload.size();
  s.send_all(&len, sizeof(len), timeout_s, what);
  s.send_all(payload.data(), payload.size(), timeout_s, what);
}

std::string recv_frame(Socket& s, double timeout_s, const std::string& what, size_t max_bytes) {
  uint64_t len = 0;
  s.recv_all(&len, sizeof(len), timeout_s, what);
  if (len > max_bytes)
    throw PeerError(what + ": a frame of " + std::to_string(len) + " bytes, more than the " +
                    std::to_string(max_bytes) + " allowed here");
  std::string payload(len, '\0');
  s.recv_all(payload.data(), len, timeout_s, what);
  return payload;
}

bool secrets_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? a[i] : 0;
    unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace smddp
