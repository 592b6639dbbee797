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
// dst may alias any source (each block is read fully before it is written).
void reduce_many(void* dst, const void* const* srcs, int k, size_t count, DType dtype, ReduceOp op,
                 int divisor);

// dst[i] = reduce(dst[i], src[i]); AVERAGE accumulates as SUM (finish with scale_average).
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] /= divisor, for the AVERAGE of algorithms that sum first.
void scale_average(void* dst, size_t count, DType dtype, int divisor);

// Multiplies floating tensors by `factor` (Horovod's prescale/postscale); no-op for 1.0.
void scale_by(void* dst, size_t count, DType dtype, double factor);

}  // namespace smddp
