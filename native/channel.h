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
// Every kind needs its own rings in the host segment, or two channels would share one.
static_assert(kNumChannelKinds == HostSegment::kChannelKinds, "host segment lays out one ring per channel kind");

class Channel {
 public:
  Channel(int peer, std::string description) : peer_(peer), description_(std::move(description)) {}
  virtual ~Channel() = default;
  // Non-blocking: bytes moved now (possibly 0). Throw PeerError if the peer is gone.
  virtual size_t try_send(const void* data, size_t n) = 0;
  virtual size_t try_recv(void* data, size_t n) = 0;
  virtual void close() {}
  virtual bool is_shared_memory() const { return false; }
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
  // `peer_bell`: the peer's doorbell, rung whenever this side moves bytes (new data for it,
  // or space freed in the ring it fills).
  ShmChannel(int peer, ShmRing tx, ShmRing rx, Doorbell* peer_bell)
      : Channel(peer, "shared memory channel to rank " + std::to_string(peer)),
        tx_(tx),
        rx_(rx),
        peer_bell_(peer_bell) {}
  size_t try_send(const void* data, size_t n) override {
    size_t moved = tx_.try_write(data, n);
    if (moved) ring_doorbell(*peer_bell_);
    return moved;
  }
  size_t try_recv(void* data, size_t n) override {
    size_t moved = rx_.try_read(data, n);
    if (moved) ring_doorbell(*peer_bell_);
    return moved;
  }
  bool is_shared_memory() const override { return true; }

 private:
  ShmRing tx_, rx_;
  Doorbell* peer_bell_;
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
