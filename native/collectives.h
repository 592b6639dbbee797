// The collective algorithms, each over a Comm's channels and shared memory. Buffers are
// contiguous host memory; counts are in elements unless named *_bytes. All ranks call the
// same function with agreeing arguments (the engine's negotiation guarantees that).
#pragma once

#include <cstddef>
#include <vector>

#include "comm.h"

namespace smddp {

// Allreduce in place among all ranks; chooses the intra-host, flat-ring or hierarchical
// algorithm by world shape and size. `algorithm_used` (optional) receives its name.
void allreduce(Comm& comm, void* buf, size_t count, DType dtype, ReduceOp op, const char** algorithm_used = nullptr);

// Intra-host allreduce of all local ranks through shared-memory staging slots.
// AVERAGE divides by `divisor`.
void allreduce_shm(Comm& comm, void* buf, size_t count, DType dtype, ReduceOp op, int divisor);

// Intra-host collectives reading peers' buffers directly (cross-memory attach must be
// enabled, and every rank on this one host).
void allreduce_cma(Comm& comm, void* buf, size_t count, DType dtype, ReduceOp op, int divisor);
void reduce_scatter_cma(Comm& comm, const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                        ReduceOp op);
void allgather_cma(Comm& comm, const void* send, void* recv, const std::vector<int64_t>& recv_bytes);

// Ring allreduce among `ranks` (which must contain this rank) over data channels.
// AVERAGE sums along the ring and divides by `divisor` at the end.
void allreduce_ring(Comm& comm, const std::vector<int>& ranks, void* buf, size_t count, DType dtype, ReduceOp op,
                    int divisor);

// Shared memory inside each host, a ring between host leaders, then a host broadcast.
void allreduce_hierarchical(Comm& comm, void* buf, size_t count, DType dtype, ReduceOp op);

// Root's bytes to every rank.
void broadcast(Comm& comm, void* buf, size_t bytes, int root);
void broadcast_shm(Comm& comm, void* buf, size_t bytes, int root_local_rank);

// Reduction to `root`: root's `out` receives the result; `in` is left unchanged everywhere.
void reduce(Comm& comm, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root);

// Every rank contributes recv_bytes[rank] bytes from `send`; `recv` receives all ranks'
// contributions concatenated in rank order.
void allgatherv(Comm& comm, const void* send, void* recv, const std::vector<int64_t>& recv_bytes);

// Reduces `in` (sum of counts elements) and leaves block `rank` (counts[rank] elements) in `out`.
void reduce_scatter(Comm& comm, const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                    ReduceOp op);

// send_bytes[j] bytes go to rank j (blocks of `send` in rank order); recv_bytes[j] arrive from rank j.
void alltoallv(Comm& comm, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
               const std::vector<int64_t>& recv_bytes);

}  // namespace smddp
