#include "channel.h"

namespace smddp {

bool Channel::poll_message(std::string* out) {
  while (rx_header_got_ < sizeof(rx_len_)) {
    size_t got = try_recv(reinterpret_cast<char*>(&rx_len_) + rx_header_got_, sizeof(rx_len_) - rx_header_got_);
    if (got == 0) return false;
    rx_header_got_ += got;
    if (rx_header_got_ == sizeof(rx_len_)) {
      if (rx_len_ > (1ull << 32)) throw PeerError(description() + ": malformed control message");
      rx_body_.assign(rx_len_, '\0');
      rx_body_got_ = 0;
    }
  }
  while (rx_body_got_ < rx_len_) {
    size_t got = try_recv(rx_body_.data() + rx_body_got_, rx_len_ - rx_body_got_);
    if (got == 0) return false;
    rx_body_got_ += got;
  }
  *out = std::move(rx_body_);
  rx_body_.clear();
  rx_header_got_ = 0;
  rx_len_ = 0;
  return true;
}

}  // namespace smddp
