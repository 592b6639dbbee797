// Intra-host broadcast through the host segment's staging slots: each round the root copies
// up to one slot of its buffer into its own slot, every rank passes a barrier, the others
// copy it out. Rounds alternate between two slot sets (as in allreduce_shm.cc), so the
// root's next copy-in never overwrites a slot a peer is still reading, with one barrier per
// round.
#include <algorithm>
#include <cstring>

#include "collectives.h"

namespace smddp {

void broadcast_shm(Comm& comm, void* buf, size_t bytes, int root_local_rank) {
  const int L = comm.local_size();
  if (L == 1 || bytes == 0) return;
  HostSegment* seg = comm.host_segment();
  const bool is_root = comm.local_rank() == root_local_rank;
  char* data = static_cast<char*>(buf);
  for (size_t off = 0; off < bytes; off += seg->slot_bytes()) {
    const size_t n = std::min(seg->slot_bytes(), bytes - off);
    const int set = int(comm.next_slot_round() & 1);
    char* slot = seg->slot(set, root_local_rank);
    if (is_root) std::memcpy(slot, data + off, n);
    comm.host_barrier("intra-host broadcast");
    if (!is_root) std::memcpy(data + off, slot, n);
  }
}

}  // namespace smddp
