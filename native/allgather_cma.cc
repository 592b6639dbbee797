// Intra-host allgather by cross-memory attach (see collectives_internal.h): each rank reads
// every peer's block into its output, one copy per byte instead of two through staging slots.
#include <cstring>
#include <vector>

#include "cma.h"
#include "collectives_internal.h"

namespace smddp {

void allgather_cma(Comm& comm, const void* send, void* recv, const std::vector<int64_t>& recv_bytes) {
  const int L = comm.local_size();
  const int me = comm.local_rank();
  const auto& ranks = comm.host_ranks(comm.host_index());
  std::vector<size_t> offset(L + 1, 0);
  for (int q = 0; q < L; ++q) offset[q + 1] = offset[q] + size_t(recv_bytes[q]);
  char* out = static_cast<char*>(recv);
  publish(comm, send, "intra-host allgather");
  if (out + offset[me] != send) std::memmove(out + offset[me], send, size_t(recv_bytes[me]));
  for (int step = 1; step < L; ++step) {
    const int q = (me + step) % L;
    if (recv_bytes[q] > 0)
      read_peer_memory(comm.local_pid(q), ranks[q], peer_buffer(comm, q), out + offset[q], size_t(recv_bytes[q]));
  }
  comm.host_barrier("intra-host allgather");
}

}  // namespace smddp
