// Chrome-trace timeline (the JSON array format Perfetto and chrome://tracing read): one row
// per tensor name, with spans for negotiation, fusion copies and transfers.
#pragma once

#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace smddp {

class Timeline {
 public:
  Timeline() = default;
  ~Timeline() { close(); }
  void open(const std::string& path_prefix, int rank);
  bool enabled() const { return file_ != nullptr; }
  // A complete span [start_us, end_us) named `phase` on the row of `tensor`.
  void span(const std::string& tensor, const char* phase, int64_t start_us, int64_t end_us,
            const std::string& args_json = "");
  void close();

 private:
  int row_of(const std::string& tensor);
  std::FILE* file_ = nullptr;
  std::mutex mutex_;
  int64_t origin_us_ = 0;
  bool first_ = true;
  std::string path_;
  struct Row {
    std::string name;
    int id;
  };
  std::vector<Row> rows_;
};

}  // namespace smddp
