#include "cma.h"

#include <cerrno>
#include <cstring>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include "comm.h"

#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif

namespace smddp {

void allow_peer_memory_reads() { ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0); }

void read_peer_memory(int pid, int peer_rank, const void* remote, void* local, size_t bytes) {
  char* dst = static_cast<char*>(local);
  const char* src = static_cast<const char*>(remote);
  while (bytes > 0) {
    iovec l{dst, bytes};
    iovec r{const_cast<char*>(src), bytes};
    ssize_t n = ::process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ESRCH)
        throw PeerError("rank " + std::to_string(peer_rank) + " (pid " + std::to_string(pid) + ") died");
      throw PeerError("reading the memory of rank " + std::to_string(peer_rank) + " failed: " + std::strerror(errno));
    }
    if (n == 0) throw PeerError("reading the memory of rank " + std::to_string(peer_rank) + " made no progress");
    dst += n;
    src += n;
    bytes -= size_t(n);
  }
}

bool probe_cma(Comm& comm) {
  HostSegment* seg = comm.host_segment();
  if (!seg) return false;
  HostControl* ctrl = seg->control();
  const int me = comm.local_rank();
  allow_peer_memory_reads();
  static thread_local uint64_t probe_word;
  probe_word = 0x5eed0000ull + uint64_t(::getpid());
  ctrl->probe_address[me] = reinterpret_cast<uint64_t>(&probe_word);
  comm.host_barrier("shared-memory start-up");
  int ok = 1;
  for (int q = 0; q < comm.local_size(); ++q) {
    if (q == me) continue;
    uint64_t value = 0;
    iovec l{&value, sizeof(value)};
    iovec r{reinterpret_cast<void*>(ctrl->probe_address[q]), sizeof(value)};
    if (::process_vm_readv(ctrl->pids[q], &l, 1, &r, 1, 0) != ssize_t(sizeof(value)) ||
        value != 0x5eed0000ull + uint64_t(ctrl->pids[q]))
      ok = 0;
  }
  ctrl->cma_ok[me] = ok;
  comm.host_barrier("shared-memory start-up");
  bool all = true;
  for (int q = 0; q < comm.local_size(); ++q) all = all && ctrl->cma_ok[q];
  // Nobody may touch cma_ok again before everyone has read it.
  comm.host_barrier("shared-memory start-up");
  return all;
}

}  // namespace smddp
