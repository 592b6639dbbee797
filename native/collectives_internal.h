// Helpers shared by the collectives' files; not part of the core's interface.
//
// Intra-host collectives by cross-memory attach (allreduce_cma.cc, reduce_scatter_cma.cc,
// allgather_cma.cc): ranks read each other's buffers directly, so every byte is copied once
// instead of twice through staging slots. Each collective publishes this rank's buffer
// address in the host segment, waits for the others (barrier), reads what it needs from its
// peers, and ends with a barrier so no rank returns (and lets its caller touch the buffer)
// while a peer still reads it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cma.h"
#include "collectives.h"
#include "reduce_kernels.h"

namespace smddp {

// One host, peers' memory readable, and big enough that syscalls do not dominate.
inline bool use_cma(Comm& comm, size_t bytes) {
  return comm.size() > 1 && comm.num_hosts() == 1 && comm.cma_enabled() &&
         int64_t(bytes) >= comm.config().cma_threshold;
}

constexpr size_t kBlockBytes = 128 * 1024;  // per peer; stays in L2 between copy and reduce

inline void publish(Comm& comm, const void* buf, const char* what) {
  comm.host_segment()->control()->buffer_address[comm.local_rank()] = reinterpret_cast<uint64_t>(buf);
  comm.host_barrier(what);
}

inline const char* peer_buffer(Comm& comm, int local_rank) {
  return reinterpret_cast<const char*>(comm.host_segment()->control()->buffer_address[local_rank]);
}

// dst[i] = reduce over ranks of their buffer[lo + i], i < hi - lo; `mine` is this rank's
// buffer. Reads peers block by block into a cache-sized scratch.
inline void reduce_range_from_peers(Comm& comm, const char* mine, char* dst, size_t lo, size_t hi, DType dtype,
                                    ReduceOp op, int divisor) {
  const int L = comm.local_size();
  const int me = comm.local_rank();
  const auto& ranks = comm.host_ranks(comm.host_index());
  const size_t es = dtype_size(dtype);
  const size_t block = std::max<size_t>(1, kBlockBytes / es);
  char* scratch = comm.scratch(size_t(L) * block * es);
  std::vector<const void*> srcs(L);
  for (size_t off = lo; off < hi; off += block) {
    const size_t n = std::min(block, hi - off);
    // This rank's own values first (dst aliases them, which lets reduce_many stream through
    // whole ranges), then the peers' in local-rank order.
    int k = 0;
    srcs[k++] = mine + off * es;
    for (int q = 0; q < L; ++q) {
      if (q == me) continue;
      char* tmp = scratch + size_t(k) * block * es;
      read_peer_memory(comm.local_pid(q), ranks[q], peer_buffer(comm, q) + off * es, tmp, n * es);
      srcs[k++] = tmp;
    }
    reduce_many(dst + (off - lo) * es, srcs.data(), L, n, dtype, op, divisor);
  }
}

}  // namespace smddp
