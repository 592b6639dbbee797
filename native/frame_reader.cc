#include "frame_reader.h"

#include <cstring>

namespace smddp {

bool FrameReader::read_some(Socket& s, const std::string& what) {
  while (prefix_have_ < sizeof(prefix_)) {
    size_t got = s.try_recv(prefix_ + prefix_have_, sizeof(prefix_) - prefix_have_, what);
    if (got == 0) return false;
    prefix_have_ += got;
    if (prefix_have_ == sizeof(prefix_)) {
      std::memcpy(&length_, prefix_, sizeof(length_));
      if (length_ > max_bytes_)
        throw PeerError(what + ": a frame of " + std::to_string(length_) + " bytes, more than the " +
                        std::to_string(max_bytes_) + " allowed here");
      payload_.assign(size_t(length_), '\0');
      payload_have_ = 0;
    }
  }
  while (payload_have_ < length_) {
    size_t got = s.try_recv(&payload_[payload_have_], size_t(length_) - payload_have_, what);
    if (got == 0) return false;
    payload_have_ += got;
  }
  return true;
}

std::string FrameReader::take() {
  std::string out = std::move(payload_);
  payload_.clear();
  prefix_have_ = 0;
  length_ = 0;
  payload_have_ = 0;
  return out;
}

}  // namespace smddp
