// Broadcast, reduce, allgather with per-rank sizes, reduce-scatter and all-to-all.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "collectives.h"
#include "reduce_kernels.h"

namespace smddp {

namespace {
// One host, peers' memory readable, and big enough that syscalls do not dominate.
bool use_cma(Comm& comm, size_t bytes) {
  return comm.size() > 1 && comm.num_hosts() == 1 && comm.cma_enabled() &&
         int64_t(bytes) >= comm.config().cma_threshold;
}

// Position of global `rank` among the ranks of its host.
int local_index(Comm& comm, int rank) {
  const auto& rs = comm.host_ranks(comm.host_of(rank));
  return int(std::find(rs.begin(), rs.end(), rank) - rs.begin());
}
}  // namespace

void broadcast(Comm& comm, void* buf, size_t bytes, int root) {
  if (comm.size() == 1 || bytes == 0) return;
  const int root_host = comm.host_of(root);
  if (comm.num_hosts() > 1) {
    // Across hosts: root sends to each other host's leader, then every host broadcasts
    // from its leader (root's host from root) through shared memory.
    char* data = static_cast<char*>(buf);
    std::vector<Transfer> t;
    if (comm.rank() == root) {
      for (int h = 0; h < comm.num_hosts(); ++h)
        if (h != root_host) t.push_back({comm.channel(comm.host_ranks(h)[0], kDataChannel), true, data, bytes});
    } else if (comm.host_index() != root_host && comm.local_rank() == 0) {
      t.push_back({comm.channel(root, kDataChannel), false, data, bytes});
    }
    comm.run(t, "broadcast");
  }
  broadcast_shm(comm, buf, bytes, comm.host_index() == root_host ? local_index(comm, root) : 0);
}

void reduce(Comm& comm, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) {
  // Reduction rides on allreduce (bandwidth-optimal inside a host); only root keeps it.
  const size_t bytes = count * dtype_size(dtype);
  if (comm.rank() == root) {
    if (out != in) std::memmove(out, in, bytes);
    allreduce(comm, out, count, dtype, op);
  } else {
    std::vector<char> scratch(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
    allreduce(comm, scratch.data(), count, dtype, op);
  }
}

void allgatherv(Comm& comm, const void* send, void* recv, const std::vector<int64_t>& recv_bytes) {
  const int P = comm.size();
  const int me = comm.rank();
  std::vector<size_t> offset(P + 1, 0);
  for (int r = 0; r < P; ++r) offset[r + 1] = offset[r] + size_t(recv_bytes[r]);
  char* out = static_cast<char*>(recv);
  if (use_cma(comm, offset[P])) return allgather_cma(comm, send, recv, recv_bytes);
  if (out + offset[me] != send) std::memmove(out + offset[me], send, size_t(recv_bytes[me]));
  if (P == 1) return;
  // Ring: at step s pass along the block that originated s ranks to the left.
  Channel* right = comm.channel((me + 1) % P, kDataChannel);
  Channel* left = comm.channel((me - 1 + P) % P, kDataChannel);
  for (int s = 0; s < P - 1; ++s) {
    int send_b = ((me - s) % P + P) % P;
    int recv_b = ((me - s - 1) % P + P) % P;
    std::vector<Transfer> t = {{right, true, out + offset[send_b], size_t(recv_bytes[send_b])},
                               {left, false, out + offset[recv_b], size_t(recv_bytes[recv_b])}};
    comm.run(t, "allgather");
  }
}

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

void alltoallv(Comm& comm, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
               const std::vector<int64_t>& recv_bytes) {
  const int P = comm.size();
  const int me = comm.rank();
  std::vector<size_t> soff(P + 1, 0), roff(P + 1, 0);
  for (int r = 0; r < P; ++r) {
    soff[r + 1] = soff[r] + size_t(send_bytes[r]);
    roff[r + 1] = roff[r] + size_t(recv_bytes[r]);
  }
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  std::memmove(out + roff[me], in + soff[me], size_t(send_bytes[me]));
  // All sends and receives progress together, so no ordering between peers can deadlock.
  std::vector<Transfer> t;
  for (int k = 1; k < P; ++k) {
    int to = (me + k) % P, from = (me - k + P) % P;
    t.push_back({comm.channel(to, kDataChannel), true, const_cast<char*>(in) + soff[to], size_t(send_bytes[to])});
    t.push_back({comm.channel(from, kDataChannel), false, out + roff[from], size_t(recv_bytes[from])});
  }
  comm.run(t, "alltoall");
}

}  // namespace smddp
