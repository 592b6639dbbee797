// Intra-host reduce-scatter by cross-memory attach (see collectives_internal.h): each rank
// reduces its block from every peer's input into its output, reading peers' memory directly.
#include <numeric>
#include <vector>

#include "collectives_internal.h"

namespace smddp {

void reduce_scatter_cma(Comm& comm, const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                        ReduceOp op) {
  const int me = comm.local_rank();
  const size_t lo = size_t(std::accumulate(counts.begin(), counts.begin() + me, int64_t(0)));
  publish(comm, in, "intra-host reduce-scatter");
  reduce_range_from_peers(comm, static_cast<const char*>(in), static_cast<char*>(out), lo, lo + size_t(counts[me]),
                          dtype, op, comm.local_size());
  comm.host_barrier("intra-host reduce-scatter");
}

}  // namespace smddp
