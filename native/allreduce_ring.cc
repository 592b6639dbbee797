// Ring allreduce (reduce-scatter then allgather) over point-to-point channels, the
// hierarchical composition used across hosts, and the choice between them.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives.h"
#include "reduce_kernels.h"

namespace smddp {

void allreduce_ring(Comm& comm, const std::vector<int>& ranks, void* buf, size_t count, DType dtype,
                    ReduceOp op, int divisor) {
  const int m = int(ranks.size());
  const int pos = int(std::find(ranks.begin(), ranks.end(), comm.rank()) - ranks.begin());
  if (m > 1 && count > 0) {
    const size_t es = dtype_size(dtype);
    const size_t chunk = (count + m - 1) / m;
    auto lo = [&](int c) { return std::min(count, size_t(c) * chunk); };
    auto len = [&](int c) { return std::min(count, lo(c) + chunk) - lo(c); };
    char* data = static_cast<char*>(buf);
    Channel* right = comm.channel(ranks[(pos + 1) % m], kDataChannel);
    Channel* left = comm.channel(ranks[(pos - 1 + m) % m], kDataChannel);
    std::vector<char> incoming(chunk * es);
    const ReduceOp step_op = op == ReduceOp::kAverage ? ReduceOp::kSum : op;
    // Reduce-scatter: after m-1 steps, chunk (pos+1) % m holds the full reduction.
    for (int s = 0; s < m - 1; ++s) {
      int send_c = ((pos - s) % m + m) % m;
      int recv_c = ((pos - s - 1) % m + m) % m;
      std::vector<Transfer> t = {{right, true, data + lo(send_c) * es, len(send_c) * es},
                                 {left, false, incoming.data(), len(recv_c) * es}};
      comm.run(t, "ring allreduce (reduce-scatter)");
      reduce_into(data + lo(recv_c) * es, incoming.data(), len(recv_c), dtype, step_op);
    }
    // Allgather the reduced chunks around the ring.
    for (int s = 0; s < m - 1; ++s) {
      int send_c = ((pos + 1 - s) % m + m) % m;
      int recv_c = ((pos - s) % m + m) % m;
      std::vector<Transfer> t = {{right, true, data + lo(send_c) * es, len(send_c) * es},
                                 {left, false, data + lo(recv_c) * es, len(recv_c) * es}};
      comm.run(t, "ring allreduce (allgather)");
    }
  }
  if (op == ReduceOp::kAverage && divisor != 1) scale_average(buf, count, dtype, divisor);
}

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
