// The allreduce entry point: picks the algorithm by world shape and size. One host takes
// the intra-host algorithm (allreduce_shm.cc, which hands large buffers to allreduce_cma.cc);
// several hosts take the flat ring (allreduce_ring.cc) or the hierarchical composition
// (allreduce_hierarchical.cc) by SMDDP_ALGORITHM and SMDDP_RING_THRESHOLD, and float16 or
// bfloat16 across hosts runs in float32 so that the result is rounded once.
#include <string>
#include <vector>

#include "collectives.h"
#include "reduce_kernels.h"

namespace smddp {

void allreduce(Comm& comm, void* buf, size_t count, DType dtype, ReduceOp op, const char** algorithm_used) {
  check_reduce_supported(dtype, op);
  const char* algo;
  if (comm.size() == 1) {
    algo = "local";
  } else if (comm.num_hosts() == 1) {
    algo = "shm";
    allreduce_shm(comm, buf, count, dtype, op, comm.size());
  } else if (is_half_precision(dtype)) {
    // Across hosts a sum is reduced in several steps (inside each host, then at every ring
    // hop); each would round to 16 bits. Reduce in float32 and round once at the end, as
    // on one host (twice the bytes on the wire, the price of the documented precision).
    std::vector<float> wide(count);
    widen_to_float32(buf, wide.data(), count, dtype);
    allreduce(comm, wide.data(), count, DType::kFloat32, op, &algo);
    narrow_from_float32(wide.data(), buf, count, dtype);
  } else {
    const std::string& choice = comm.config().algorithm;
    // Measured (bench/allreduce_algorithms.py): the hierarchical algorithm's fewer TCP hops
    // win while latency dominates; the flat ring's parallel links win once bandwidth does.
    bool hier = choice == "hierarchical" ||
                (choice == "auto" && int64_t(count * dtype_size(dtype)) < comm.config().ring_threshold);
    if (hier) {
      algo = "hierarchical";
      allreduce_hierarchical(comm, buf, count, dtype, op);
    } else {
      algo = "ring";
      std::vector<int> all(comm.size());
      for (int r = 0; r < comm.size(); ++r) all[r] = r;
      allreduce_ring(comm, all, buf, count, dtype, op, comm.size());
    }
  }
  if (algorithm_used) *algorithm_used = algo;
}

}  // namespace smddp
