// Reading length-prefixed frames from sockets that nobody has authenticated yet.
//
// Servers that accept connections (the rendezvous store, a rank's bootstrap listener) read
// each connection's frame a little at a time, with every connection multiplexed on one
// poll(), a cap on the frame's size and a deadline: an idle, slow or hostile client costs a
// few bytes of memory and never blocks the others.
#pragma once

#include <cstdint>
#include <string>

#include "socket.h"

namespace smddp {

class FrameReader {
 public:
  explicit FrameReader(size_t max_bytes) : max_bytes_(max_bytes) {}
  void set_max_bytes(size_t max_bytes) { max_bytes_ = max_bytes; }
  // Reads what the (non-blocking) socket has. True once a whole frame is in: take() it.
  // Throws PeerError on EOF, a reset connection, or a length prefix above the cap (before
  // allocating anything for it).
  bool read_some(Socket& s, const std::string& what);
  std::string take();

 private:
  size_t max_bytes_;
  char prefix_[8] = {};
  size_t prefix_have_ = 0;
  uint64_t length_ = 0;
  std::string payload_;
  size_t payload_have_ = 0;
};

}  // namespace smddp
