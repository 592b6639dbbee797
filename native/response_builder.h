// Turning collectives that are ready into the responses every rank runs, in order, with
// allreduces that agree on dtype, reduction and scaling fused into buckets of at most the
// fusion threshold. The coordinator builds its messages with it, and hit cycles
// (hit_agreement.h) build theirs the same way on every rank, so both paths fuse alike.
#pragma once

#include <cstdint>
#include <vector>

#include "messages.h"

namespace smddp {

class ResponseBuilder {
 public:
  // Appends to `out`; `fusion_bytes` caps one fused allreduce.
  ResponseBuilder(std::vector<Response>* out, int64_t fusion_bytes) : out_(out), fusion_bytes_(fusion_bytes) {}
  // One agreed collective. per_rank: each rank's ragged part (allgather/alltoall only).
  void add(ResponseEntry entry, const Signature& sig, std::vector<std::vector<int64_t>> per_rank = {});

 private:
  std::vector<Response>* out_;
  int64_t fusion_bytes_;
  // Buckets still open for fusion: one per (dtype, op, scales), the latest of its kind.
  struct OpenBucket {
    size_t index;
    int64_t bytes;
  };
  std::vector<OpenBucket> open_;
};

}  // namespace smddp
