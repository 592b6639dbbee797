// The negotiation protocol between each rank and the coordinator (rank 0).
//
// A rank announces tensors it has queued (a full description, or a 4-byte response-cache id
// once the description was agreed before). The coordinator answers, in one order for all
// ranks, with what to run: fused groups of allreduces, single collectives, or errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace smddp {

// Everything all ranks must agree on for one named collective.
struct Signature {
  OpType op = OpType::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  int32_t root = 0;
  // Compared in full, except for allgather and alltoall, whose first dimension may differ.
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // reduce_scatter: elements per rank (must agree)
  double prescale = 1.0, postscale = 1.0;
  // Negotiated but not run: the CUDA path checks that every rank calls the same collective
  // with the same arguments this way, while NCCL moves the data (never fused, never cached).
  bool check_only = false;

  bool operator==(const Signature& o) const;
  bool operator!=(const Signature& o) const { return !(*this == o); }
  // The first field that differs, or "" if the two agree (allgather/alltoall ignore dim 0).
  std::string first_difference(const Signature& o) const;
  std::string field_text(const std::string& field) const;
  void write(class Writer& w) const;
  static Signature read(class Reader& r);
};

// One rank's announcement of one tensor.
struct Announcement {
  std::string name;                  // empty when cache_id is used
  uint32_t cache_id = kNoCacheId;
  Signature sig;                     // valid when not cached
  std::vector<int64_t> per_rank;     // allgather: [first dim]; alltoall: rows sent to each rank
  static constexpr uint32_t kNoCacheId = 0xffffffffu;
};

// The version of everything ranks send each other (negotiation messages, their layouts, the
// rendezvous records). Checked at bootstrap; raise it whenever a message changes.
constexpr int kProtocolVersion = 2;

// kHeartbeat: rank 0 says it is alive (every kHeartbeatUs), so a rank that waits on it can
// tell a coordinator that is merely busy from one that is stopped or cut off.
enum class MessageType : uint8_t { kAnnounce = 1, kRespond = 2, kGoodbye = 3, kAbort = 4, kHeartbeat = 5 };
constexpr int64_t kHeartbeatUs = 250000;

struct ResponseEntry {
  std::string name;
  uint32_t cache_id = Announcement::kNoCacheId;  // id assigned for future announcements
};

struct Response {
  bool is_error = false;
  std::string error;
  Signature sig;
  std::vector<ResponseEntry> entries;            // fused group in buffer order
  std::vector<std::vector<int64_t>> per_rank;    // for single-tensor allgather/alltoall
};

std::string encode_announcements(const std::vector<Announcement>& a);
std::vector<Announcement> decode_announcements(class Reader& r);
std::string encode_responses(const std::vector<Response>& rs);
std::vector<Response> decode_responses(class Reader& r);

}  // namespace smddp
