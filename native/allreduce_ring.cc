// Ring allreduce (reduce-scatter then allgather) over point-to-point channels, among any
// subset of ranks: all of them (the flat ring across hosts) or the host leaders (inside the
// hierarchical algorithm). Each rank sends and receives 2(m-1)/m of the buffer.
#include <algorithm>
#include <vector>

#include "collectives.h"
#include "reduce_kernels.h"

namespace smddp {

void allreduce_ring(Comm& comm, const std::vector<int>& ranks, void* buf, size_t count, DType dtype, ReduceOp op,
                    int divisor) {
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

}  // namespace smddp
