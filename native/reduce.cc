// The reduce collective (reduction to one root). It rides on allreduce, which is
// bandwidth-optimal inside a host, and only root keeps the result; the other ranks reduce
// a scratch copy so `in` is left unchanged everywhere. (The element-wise reduction kernels
// are in reduce_kernels.cc.)
#include <cstring>
#include <vector>

#include "collectives.h"

namespace smddp {

void reduce(Comm& comm, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) {
  // Reduction rides on allreduce (bandwidth-optimal inside a host); only root keeps it.
  const size_t bytes = count * dtype_size(dtype);
  if (comm.rank() == root) {
    if (out != in) std::memmove(out, in, bytes);
    allreduce(comm, out, count, dtype, op);
  } else {
    std::vector<char> scratch(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
    allreduce(comm, scratch.data(), count, dtype, op);
  }
}

}  // namespace smddp
