// A point-to-point byte channel to one peer rank: a pair of shared-memory rings for a peer
// on the same host, a TCP connection for a peer on another host. Collectives and the
// negotiation protocol are written against this interface only.
#pragma once

#include <memory>
#include <string>

#include "shm_segment.h"
#include "socket.h"

namespace smddp {

enum ChannelKind : int { kDataChannel = 0, kControlChannel = 1, kP2PChannel = 2, kNumChannelKinds = 3 };

class Channel {
 public:
  Channel(int peer, std::string description) : peer_(peer), description_(std::move(description)) {}
  virtual ~Channel() = default;
  // Non-blocking: bytes moved now (possibly 0). Throw PeerError if the peer is gone.
  virtual size_t try_send(const void* data, size_t n) = 0;
  virtual size_t try_recv(void* data, size_t n) = 0;
  virtual void close() {}
  int peer() const { return peer_; }
  const std::string& description() const { return description_; }

  // Incremental receipt of one length-prefixed message; true when `out` holds a whole one.
  bool poll_message(std::string* out);

 private:
  int peer_;
  std::string description_;
  // Partial message state for poll_message.
  uint64_t rx_len_ = 0;
  size_t rx_header_got_ = 0;
  std::string rx_body_;
  size_t rx_body_got_ = 0;
};

class ShmChannel : public Channel {
 public:
  ShmChannel(int peer, ShmRing tx, ShmRing rx)
      : Channel(peer, "shared memory channel to rank " + std::to_string(peer)), tx_(tx), rx_(rx) {}
  size_t try_send(const void* data, size_t n) override { return tx_.try_write(data, n); }
  size_t try_recv(void* data, size_t n) override { return rx_.try_read(data, n); }

 private:
  ShmRing tx_, rx_;
};

class TcpChannel : public Channel {
 public:
  TcpChannel(int peer, Socket sock)
      : Channel(peer, "TCP channel to rank " + std::to_string(peer)), sock_(std::move(sock)) {}
  size_t try_send(const void* data, size_t n) override { return sock_.try_send(data, n, description()); }
  size_t try_recv(void* data, size_t n) override { return sock_.try_recv(data, n, description()); }
  void close() override { sock_.close(); }

 private:
  Socket sock_;
};

}  // namespace smddp
