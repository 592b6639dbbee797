#include "timeline.h"

#include <vector>

#include "common.h"

namespace smddp {

namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}
}  // namespace

void Timeline::open(const std::string& path_prefix, int rank) {
  if (path_prefix.empty()) return;
  path_ = path_prefix + ".rank" + std::to_string(rank) + ".json";
  file_ = std::fopen(path_.c_str(), "w");
  if (!file_) throw Error("cannot write timeline file " + path_ + " (SMDDP_TIMELINE)");
  origin_us_ = now_us();
  std::fputs("[\n", file_);
  std::fprintf(file_, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", rank,
               rank);
  first_ = false;
}

int Timeline::row_of(const std::string& tensor) {
  for (const auto& r : rows_)
    if (r.name == tensor) return r.id;
  int id = int(rows_.size()) + 1;
  rows_.push_back({tensor, id});
  std::fprintf(file_, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":%d,\"args\":{\"name\":\"%s\"}}", id,
               json_escape(tensor).c_str());
  return id;
}

void Timeline::span(const std::string& tensor, const char* phase, int64_t start_us, int64_t end_us,
                    const std::string& args_json) {
  if (!file_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  int tid = row_of(tensor);
  std::fprintf(file_, ",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":0,\"tid\":%d,\"ts\":%lld,\"dur\":%lld%s%s%s}", phase,
               tid, static_cast<long long>(start_us - origin_us_),
               static_cast<long long>(end_us > start_us ? end_us - start_us : 0),
               args_json.empty() ? "" : ",\"args\":", args_json.c_str(), "");
}

void Timeline::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (file_) {
    std::fputs("\n]\n", file_);
    std::fclose(file_);
    file_ = nullptr;
  }
}

}  // namespace smddp
