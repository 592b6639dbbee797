// Intra-host allreduce through the host segment's staging slots.
//
// Each round moves up to one slot of every rank's buffer:
//   copy own piece into own slot -> barrier -> reduce "my" chunk across all slots (written
//   back into my slot) -> barrier -> copy every chunk out of its owner's slot.
// Rounds alternate between two slot sets, so the next round's copy-in never overwrites a slot
// another rank is still copying out of, and no third barrier is needed. Small pieces skip
// the scatter step: every rank reduces the whole piece itself after one barrier.
// Buffers of SMDDP_CMA_THRESHOLD bytes or more go to allreduce_cma.cc when cross-memory
// attach works.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives.h"
#include "reduce_kernels.h"

namespace smddp {

namespace {
constexpr size_t kSmallBytes = 64 * 1024;
}

void allreduce_shm(Comm& comm, void* buf, size_t count, DType dtype, ReduceOp op, int divisor) {
  const int L = comm.local_size();
  if (L == 1) {
    if (op == ReduceOp::kAverage && divisor != 1) scale_average(buf, count, dtype, divisor);
    return;
  }
  if (comm.cma_enabled() && int64_t(count * dtype_size(dtype)) >= comm.config().cma_threshold)
    return allreduce_cma(comm, buf, count, dtype, op, divisor);
  HostSegment* seg = comm.host_segment();
  const int me = comm.local_rank();
  const size_t es = dtype_size(dtype);
  const size_t piece_max = seg->slot_bytes() / es;
  const size_t align = std::max<size_t>(1, 64 / es);
  char* data = static_cast<char*>(buf);
  std::vector<const void*> srcs(L);

  for (size_t off = 0; off < count || (count == 0 && off == 0); off += piece_max) {
    if (count == 0) break;
    const size_t n = std::min(piece_max, count - off);
    const int set = int(comm.next_slot_round() & 1);
    char* my_slot = seg->slot(set, me);
    std::memcpy(my_slot, data + off * es, n * es);
    comm.host_barrier("intra-host allreduce");
    if (n * es <= kSmallBytes) {
      for (int q = 0; q < L; ++q) srcs[q] = seg->slot(set, q);
      reduce_many(data + off * es, srcs.data(), L, n, dtype, op, divisor);
      continue;
    }
    const size_t chunk = (n + L - 1) / L / align * align + align;
    const size_t lo = std::min(n, size_t(me) * chunk);
    const size_t hi = std::min(n, lo + chunk);
    if (hi > lo) {
      for (int q = 0; q < L; ++q) srcs[q] = seg->slot(set, q) + lo * es;
      reduce_many(my_slot + lo * es, srcs.data(), L, hi - lo, dtype, op, divisor);
    }
    comm.host_barrier("intra-host allreduce");
    for (int q = 0; q < L; ++q) {
      const size_t qlo = std::min(n, size_t(q) * chunk);
      const size_t qhi = std::min(n, qlo + chunk);
      if (qhi > qlo) std::memcpy(data + (off + qlo) * es, seg->slot(set, q) + qlo * es, (qhi - qlo) * es);
    }
  }
}

}  // namespace smddp
