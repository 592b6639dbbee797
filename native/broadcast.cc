// Broadcast of root's bytes to every rank. Across hosts root sends to each other host's
// leader over TCP, then every host broadcasts from its leader (root's host from root) through
// shared memory (broadcast_shm.cc).
#include <algorithm>
#include <vector>

#include "collectives.h"

namespace smddp {

namespace {
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

}  // namespace smddp
