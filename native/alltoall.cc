// All-to-all with uneven splits: this rank's own block is copied locally, and every send
// and receive with the other ranks is handed to the transfer loop at once, so they progress
// together and no ordering between peers can deadlock.
#include <cstring>
#include <vector>

#include "collectives.h"

namespace smddp {

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
