// Response building and fusion (response_builder.h).
#include "response_builder.h"

namespace smddp {

void ResponseBuilder::add(ResponseEntry entry, const Signature& sig, std::vector<std::vector<int64_t>> per_rank) {
  if (sig.op == OpType::kAllreduce && !sig.check_only) {
    int64_t bytes = int64_t(dtype_size(sig.dtype));
    for (int64_t d : sig.shape) bytes *= d;
    OpenBucket* fit = nullptr;
    for (auto& b : open_) {
      const Signature& bs = (*out_)[b.index].sig;
      if (bs.dtype == sig.dtype && bs.reduce_op == sig.reduce_op && bs.prescale == sig.prescale &&
          bs.postscale == sig.postscale) {
        fit = &b;
        break;
      }
    }
    if (fit && fit->bytes + bytes <= fusion_bytes_) {
      (*out_)[fit->index].entries.push_back(std::move(entry));
      fit->bytes += bytes;
      return;
    }
    // A new bucket; it replaces the full one of its kind as the one open for fusion.
    if (fit)
      *fit = {out_->size(), bytes};
    else
      open_.push_back({out_->size(), bytes});
  }
  Response r;
  r.sig = sig;
  r.entries.push_back(std::move(entry));
  if (sig.op == OpType::kAllgather || sig.op == OpType::kAlltoall) r.per_rank = std::move(per_rank);
  out_->push_back(std::move(r));
}

}  // namespace smddp
