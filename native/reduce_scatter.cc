// Reduce-scatter with per-rank counts. On one host with cross-memory attach and a large
// enough input each rank reduces its own block from its peers' inputs (reduce_scatter_cma.cc);
// otherwise a full allreduce on a scratch copy, keeping this rank's block.
#include <cstring>
#include <vector>

#include "collectives_internal.h"

namespace smddp {

void reduce_scatter(Comm& comm, const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                    ReduceOp op) {
  const size_t es = dtype_size(dtype);
  size_t total = 0, mine = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (r == comm.rank()) mine = total;
    total += size_t(counts[r]);
  }
  if (use_cma(comm, total * es)) return reduce_scatter_cma(comm, in, out, counts, dtype, op);
  // Otherwise a full allreduce on a scratch copy, keeping this rank's block: correct, but it
  // moves 2(P-1)/P of the bytes where a dedicated reduce-scatter would move (P-1)/P.
  std::vector<char> scratch(static_cast<const char*>(in), static_cast<const char*>(in) + total * es);
  allreduce(comm, scratch.data(), total, dtype, op);
  std::memcpy(out, scratch.data() + mine * es, size_t(counts[comm.rank()]) * es);
}

}  // namespace smddp
