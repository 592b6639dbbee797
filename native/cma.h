// Cross-memory attach (process_vm_readv): a rank reads a local peer's buffer directly, one
// copy instead of the two that staging through shared memory costs. Needs the kernel to let
// processes of one user read each other (Yama ptrace_scope <= 1 with PR_SET_PTRACER, and no
// seccomp filter blocking the call); probed at start-up, with the staging path as fallback.
#pragma once

#include <cstddef>
#include <cstdint>

namespace smddp {

class Comm;

// Allows any process of this user to read this one's memory (a no-op without Yama).
void allow_peer_memory_reads();

// Copies `bytes` from address `remote` in process `pid` to `local`. Throws PeerError naming
// `peer_rank` if the process is gone.
void read_peer_memory(int pid, int peer_rank, const void* remote, void* local, size_t bytes);

// Start-up probe through the host segment (all local ranks call it together): true when
// every local rank can read every other one's memory.
bool probe_cma(Comm& comm);

}  // namespace smddp
