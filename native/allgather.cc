// Allgather with per-rank sizes. On one host with cross-memory attach and a large enough
// result it reads the peers' blocks directly (allgather_cma.cc); otherwise a ring over the
// data channels, where at step s each rank passes along the block that originated s ranks to
// its left.
#include <cstring>
#include <vector>

#include "collectives_internal.h"

namespace smddp {

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

}  // namespace smddp
