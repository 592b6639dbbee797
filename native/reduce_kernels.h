// Element-wise reduction kernels for every dtype x op. Written as blocked loops over
// restrict pointers so the compiler vectorises them; float16 and bfloat16 accumulate in
// float32 and round once.
#pragma once

#include <cstddef>

#include "common.h"

namespace smddp {

// Throws if `op` is not defined for `dtype` (e.g. AVERAGE of bool).
void check_reduce_supported(DType dtype, ReduceOp op);

// dst[i] = reduce(srcs[0][i], ..., srcs[k-1][i]) for i < count; AVERAGE divides by `divisor`.
// dst may alias any source (each block of every source is read before that block of dst is
// written). Sources combine left to right, so callers pass them in rank order.
void reduce_many(void* dst, const void* const* srcs, int k, size_t count, DType dtype, ReduceOp op, int divisor);

// dst[i] = reduce(dst[i], src[i]); AVERAGE accumulates as SUM (finish with scale_average).
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] /= divisor, for the AVERAGE of algorithms that sum first.
void scale_average(void* dst, size_t count, DType dtype, int divisor);

// float16/bfloat16 <-> float32, for algorithms that reduce in several steps (across hosts)
// and must still round once: they run in float32 and narrow at the end.
bool is_half_precision(DType dtype);
void widen_to_float32(const void* src, float* dst, size_t count, DType dtype);
void narrow_from_float32(const float* src, void* dst, size_t count, DType dtype);

// Multiplies floating tensors by `factor` (Horovod's prescale/postscale); no-op for 1.0.
void scale_by(void* dst, size_t count, DType dtype, double factor);

}  // namespace smddp
