#include "validate.h"

#include <climits>

namespace smddp {

namespace {

[[noreturn]] void fail(const Signature& sig, const std::string& name, const std::string& what) {
  throw Error(std::string(op_type_name(sig.op)) + " '" + name + "': " + what);
}

// Product of dims [from, end), or -1 if a dim is negative or the product overflows.
int64_t checked_product(const std::vector<int64_t>& shape, size_t from) {
  int64_t n = 1;
  for (size_t i = from; i < shape.size(); ++i) {
    if (shape[i] < 0) return -1;
    if (shape[i] != 0 && n > INT64_MAX / shape[i]) return -1;
    n *= shape[i];
  }
  return n;
}

void check_splits(const Signature& sig, const std::string& name, const std::vector<int64_t>& splits, size_t first,
                  int size, const char* what) {
  for (int q = 0; q < size; ++q)
    if (splits[first + q] < 0)
      fail(sig, name,
           std::string(what) + " " + list_text(splits) + " has a negative entry for rank " + std::to_string(q));
}

}  // namespace

void validate_submission(const std::string& name, const Signature& sig, const void* in, const void* out, size_t count,
                         size_t out_capacity, const std::vector<int64_t>& per_rank, int rank, int size) {
  if (sig.check_only || sig.op == OpType::kBarrier) return;
  const size_t es = dtype_size(sig.dtype);
  if (count > 0 && !in) fail(sig, name, "no input buffer for " + std::to_string(count) + " elements");
  if (count > (SIZE_MAX / 4) / es) fail(sig, name, "element count " + std::to_string(count) + " is too large");
  const int64_t elements = checked_product(sig.shape, 0);
  if (!sig.shape.empty() && (elements < 0 || uint64_t(elements) != count))
    fail(sig, name,
         "shape " + list_text(sig.shape) + " does not hold the " + std::to_string(count) + " elements of the input");
  const size_t bytes = count * es;
  switch (sig.op) {
    case OpType::kAllreduce:
    case OpType::kBroadcast:
      if (out && out_capacity < bytes)
        fail(sig, name,
             "the output buffer holds " + std::to_string(out_capacity) + " bytes but the input has " +
                 std::to_string(bytes));
      break;
    case OpType::kReduce:
      if (rank == sig.root && out && out_capacity < bytes)
        fail(sig, name,
             "the root's output buffer holds " + std::to_string(out_capacity) + " bytes but the input has " +
                 std::to_string(bytes));
      break;
    case OpType::kReduceScatter: {
      if (sig.splits.empty()) {
        if (count % size_t(size))
          fail(sig, name,
               std::to_string(count) + " elements do not split evenly over " + std::to_string(size) + " ranks");
        if (out && out_capacity < bytes / size_t(size))
          fail(sig, name,
               "the output buffer holds " + std::to_string(out_capacity) + " bytes but this rank's block has " +
                   std::to_string(bytes / size_t(size)));
        break;
      }
      if (sig.splits.size() != size_t(size))
        fail(sig, name,
             "counts " + list_text(sig.splits) + " name " + std::to_string(sig.splits.size()) + " blocks for " +
                 std::to_string(size) + " ranks");
      check_splits(sig, name, sig.splits, 0, size, "counts");
      int64_t total = 0;
      for (int64_t c : sig.splits) total += c;
      if (uint64_t(total) != count)
        fail(sig, name,
             "counts " + list_text(sig.splits) + " add up to " + std::to_string(total) + " elements, the input has " +
                 std::to_string(count));
      if (out && out_capacity < size_t(sig.splits[rank]) * es)
        fail(sig, name,
             "the output buffer holds " + std::to_string(out_capacity) + " bytes but this rank's block has " +
                 std::to_string(size_t(sig.splits[rank]) * es));
      break;
    }
    case OpType::kAllgather: {
      if (per_rank.size() != 1 && per_rank.size() != size_t(1 + size))
        fail(sig, name,
             "expects [rows sent] or [rows sent, rows expected from each of " + std::to_string(size) + " ranks], got " +
                 list_text(per_rank));
      if (per_rank[0] < 0) fail(sig, name, "negative row count " + std::to_string(per_rank[0]));
      if (per_rank.size() > 1) check_splits(sig, name, per_rank, 1, size, "expected rows");
      if (!sig.shape.empty() && sig.shape[0] != per_rank[0])
        fail(sig, name, "sends " + std::to_string(per_rank[0]) + " rows but its shape is " + list_text(sig.shape));
      break;
    }
    case OpType::kAlltoall: {
      if (per_rank.size() != size_t(size) && per_rank.size() != size_t(2 * size))
        fail(sig, name,
             "split sizes " + list_text(per_rank) + " name " + std::to_string(per_rank.size()) + " entries for " +
                 std::to_string(size) + " ranks");
      check_splits(sig, name, per_rank, 0, size, "input split sizes");
      if (per_rank.size() == size_t(2 * size)) check_splits(sig, name, per_rank, size, size, "output split sizes");
      int64_t rows = 0;
      for (int q = 0; q < size; ++q) rows += per_rank[q];
      const int64_t have = sig.shape.empty() ? int64_t(count) : sig.shape[0];
      if (rows != have)
        fail(sig, name,
             "input split sizes " + list_text(std::vector<int64_t>(per_rank.begin(), per_rank.begin() + size)) +
                 " add up to " + std::to_string(rows) + " rows, the input has " + std::to_string(have));
      break;
    }
    default:
      break;
  }
}

std::string check_ragged(const std::string& name, const Signature& sig,
                         const std::vector<std::vector<int64_t>>& per_rank, int size) {
  const size_t P = size_t(size);
  const std::string what = std::string(op_type_name(sig.op)) + " '" + name + "': ";
  const int64_t row_elems = checked_product(sig.shape, sig.shape.empty() ? 0 : 1);
  if (row_elems < 0) return what + "invalid shape " + list_text(sig.shape);
  const int64_t row_bytes = row_elems * int64_t(dtype_size(sig.dtype));
  const bool gather = sig.op == OpType::kAllgather;
  // Rows each rank sends: allgather, one number; alltoall, one per receiver.
  const size_t sent = gather ? 1 : P;
  for (size_t q = 0; q < P; ++q) {
    const size_t n = per_rank[q].size();
    if (n != sent + 1 && n != sent + P + 1)
      return what + "rank " + std::to_string(q) + " announced a malformed record " + list_text(per_rank[q]);
  }
  for (size_t q = 0; q < P; ++q) {
    std::vector<int64_t> incoming(P);
    int64_t bytes = 0;
    for (size_t s = 0; s < P; ++s) {
      incoming[s] = gather ? per_rank[s][0] : per_rank[s][q];
      if (incoming[s] < 0) return what + "rank " + std::to_string(s) + " announced a negative row count";
      bytes += incoming[s] * row_bytes;
    }
    const std::vector<int64_t>& mine = per_rank[q];
    if (mine.size() == sent + P + 1) {
      std::vector<int64_t> expected(mine.begin() + long(sent), mine.begin() + long(sent + P));
      if (expected != incoming)
        return what + "rank " + std::to_string(q) + " expects " + list_text(expected) +
               " rows from the ranks in order, but they send " + list_text(incoming);
    }
    const int64_t capacity = announced_capacity(mine);
    if (capacity >= 0 && bytes > capacity)
      return what + "rank " + std::to_string(q) + "'s output buffer holds " + std::to_string(capacity) +
             " bytes but receives " + std::to_string(bytes) + " (rows from the ranks in order: " + list_text(incoming) +
             ")";
  }
  return "";
}

}  // namespace smddp
