// The hierarchical allreduce used across hosts: shared memory inside each host, a ring
// between host leaders, then a host broadcast. Its fewer TCP hops beat the flat ring while
// latency dominates (allreduce.cc chooses); AVERAGE sums all the way and divides once at the end.
#include <vector>

#include "collectives.h"
#include "reduce_kernels.h"

namespace smddp {

void allreduce_hierarchical(Comm& comm, void* buf, size_t count, DType dtype, ReduceOp op) {
  const ReduceOp sum_like = op == ReduceOp::kAverage ? ReduceOp::kSum : op;
  allreduce_shm(comm, buf, count, dtype, sum_like, 1);
  if (comm.local_rank() == 0) {
    std::vector<int> leaders;
    for (int h = 0; h < comm.num_hosts(); ++h) leaders.push_back(comm.host_ranks(h)[0]);
    allreduce_ring(comm, leaders, buf, count, dtype, sum_like, 1);
  }
  broadcast_shm(comm, buf, count * dtype_size(dtype), 0);
  if (op == ReduceOp::kAverage) scale_average(buf, count, dtype, comm.size());
}

}  // namespace smddp
