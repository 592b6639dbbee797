// Minimal binary serialization for control messages (store protocol, negotiation).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"

namespace smddp {

class Writer {
 public:
  template <typename T>
  void put(T v) {
    buf_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_string(const std::string& s) {
    put<uint32_t>(uint32_t(s.size()));
    buf_.append(s);
  }
  void put_i64s(const std::vector<int64_t>& v) {
    put<uint32_t>(uint32_t(v.size()));
    buf_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
  }
  const std::string& str() const { return buf_; }
  std::string take() { return std::move(buf_); }

 private:
  std::string buf_;
};

class Reader {
 public:
  // Owns its bytes, so a Reader built from a temporary message stays valid.
  explicit Reader(std::string s) : data_(std::move(s)), p_(data_.data()), end_(data_.data() + data_.size()) {}
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string get_string() {
    uint32_t n = get<uint32_t>();
    need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::vector<int64_t> get_i64s() {
    uint32_t n = get<uint32_t>();
    need(size_t(n) * sizeof(int64_t));
    std::vector<int64_t> v(n);
    std::memcpy(v.data(), p_, n * sizeof(int64_t));
    p_ += n * sizeof(int64_t);
    return v;
  }
  // A count of items that follow, each at least `min_item_bytes` long: refused if the
  // message is too short to hold them, before anything is allocated for them.
  uint32_t get_count(size_t min_item_bytes) {
    uint32_t n = get<uint32_t>();
    need(size_t(n) * min_item_bytes);
    return n;
  }
  bool done() const { return p_ == end_; }

 private:
  void need(size_t n) {
    if (size_t(end_ - p_) < n) throw Error("malformed control message (truncated)");
  }
  std::string data_;
  const char* p_;
  const char* end_;
};

}  // namespace smddp
