/* The engine's C interface, for native frontends built apart from the core (the torch c10d
   Backend, compiled against whichever torch the user runs). The core keeps every symbol
   private (exports.map); what it offers other libraries is this table of function pointers,
   handed out as the PyCapsule `smdistributed._core._c_api`.

   Plain C types only: the two libraries may come from different compilers and standard
   libraries, so no C++ object or exception crosses. A call that can fail returns 0 (handles,
   events) or non-zero (status), and writes the reason, NUL-terminated, into `err`.

   Versioning: a consumer checks `version` equals the version it was written for and that
   `struct_size` covers the members it uses; raise SMDDP_C_API_VERSION whenever a member
   changes meaning, append new members at the end. */
#ifndef SMDDP_C_API_H
#define SMDDP_C_API_H

#include <stddef.h>
#include <stdint.h>

#define SMDDP_C_API_VERSION 1
#define SMDDP_C_API_CAPSULE "smdistributed._core._c_api"

#ifdef __cplusplus
extern "C" {
#endif

/* What every rank must agree on for one collective (see Signature in messages.h). The enum
   values are the core's DType, ReduceOp and OpType. */
typedef struct smddp_signature {
  int32_t op;
  int32_t dtype;
  int32_t reduce_op;
  int32_t root;
  const int64_t* shape;
  size_t ndim;
  const int64_t* splits;
  size_t nsplits;
} smddp_signature;

typedef void (*smddp_completion_fn)(void* context, uint64_t handle);

typedef struct smddp_c_api {
  uint32_t version;
  uint32_t struct_size;

  /* Engines (an `Engine*`, from `_core.Engine._address()`). */
  uint64_t (*engine_submit)(void* engine, const char* name, const smddp_signature* sig, const void* in, void* out,
                            size_t count, size_t out_capacity, const int64_t* per_rank, size_t n_per_rank, char* err,
                            size_t err_len);
  /* Waits for the operation, then releases it. 0: it succeeded. */
  int (*engine_wait)(void* engine, uint64_t handle, double timeout_s, char* err, size_t err_len);
  /* After watch(h), h is reported once by next_completions when it is done. */
  void (*engine_watch)(void* engine, uint64_t handle);
  /* Calls fn for each watched operation done within timeout_s; non-zero once the engine is
     shut down (nothing more will complete). */
  int (*engine_next_completions)(void* engine, double timeout_s, smddp_completion_fn fn, void* context);
  void (*engine_counters)(void* engine, uint64_t* submitted, uint64_t* cache_hits, uint64_t* cache_misses);

  /* NCCL groups (a `NcclGroup*`, from `_core.NcclGroup._address()`). Streams are cudaStream_t
     values as integers. Events returned are owned by the caller: event_release each one. */
  void* (*nccl_allreduce_after)(void* group, uintptr_t caller_stream, uintptr_t in, uintptr_t out, size_t count,
                                int32_t dtype, int32_t reduce_op, const int64_t* shape, size_t ndim, char* err,
                                size_t err_len);
  /* The argument check of one collective, through the group's CPU engine (no-op without one). */
  int (*nccl_check)(void* group, const char* kind, const smddp_signature* sig, char* err, size_t err_len);
  int (*nccl_wait_for)(void* group, uintptr_t caller_stream, char* err, size_t err_len);
  int (*nccl_allgather)(void* group, uintptr_t in, uintptr_t out, size_t count_per_rank, int32_t dtype, char* err,
                        size_t err_len);
  int (*nccl_reduce_scatter)(void* group, uintptr_t in, uintptr_t out, size_t count_per_rank, int32_t dtype,
                             int32_t reduce_op, char* err, size_t err_len);
  int (*nccl_broadcast)(void* group, uintptr_t in, uintptr_t out, size_t count, int32_t dtype, int32_t root, char* err,
                        size_t err_len);
  void* (*nccl_record)(void* group, char* err, size_t err_len);
  /* The group's failure, if any: the message's length (0: none), copied into buf. */
  size_t (*nccl_error)(void* group, char* buf, size_t buf_len);
  uintptr_t (*nccl_stream)(void* group);

  int (*event_block)(void* event, uintptr_t stream, char* err, size_t err_len);
  int (*event_query)(void* event);
  void (*event_synchronize)(void* event);
  void (*event_release)(void* event);

  /* Point-to-point: a send (is_send 1) or receive of `bytes` at `buf` to or from group rank
     `peer`, matched with the peer's call of the same tag in order; released by engine_wait. */
  uint64_t (*engine_p2p)(void* engine, int32_t is_send, int32_t peer, int64_t tag, void* buf, size_t bytes, char* err,
                         size_t err_len);
  /* Waits until the operation is done, without releasing it (engine_wait does that): 1 once
     done (or already released), 0 if timeout_s (>= 0) passed first. */
  int (*engine_wait_done)(void* engine, uint64_t handle, double timeout_s);
} smddp_c_api;

#ifdef __cplusplus
}
#endif

#endif /* SMDDP_C_API_H */
