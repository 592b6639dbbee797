// The coordinator's tally, response building, fusion and stall checks (coordinator.h).
#include "coordinator.h"

#include <algorithm>
#include <sstream>

#include "response_builder.h"
#include "validate.h"

namespace smddp {

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream o;
  for (size_t i = 0; i < ranks.size(); ++i) o << (i ? ", " : "") << ranks[i];
  return o.str();
}

Response error_response(const std::string& name, const Signature& sig, const std::string& error) {
  Response r;
  r.is_error = true;
  r.error = error;
  r.sig = sig;
  r.entries.push_back({name, Announcement::kNoCacheId});
  return r;
}

}  // namespace

Coordinator::Coordinator(int world_size, size_t cache_capacity, double stall_timeout_s, double stall_warning_s,
                         bool hit_cycles)
    : size_(world_size),
      hit_cycles_(hit_cycles),
      stall_timeout_s_(stall_timeout_s),
      stall_warning_s_(stall_warning_s),
      cache_(cache_capacity),
      gone_(world_size, false),
      applied_(world_size, 0) {}

void Coordinator::receive(int from, const std::vector<Announcement>& list, uint64_t applied, int64_t now_us) {
  acknowledge(from, applied);
  for (const auto& a : list) {
    std::string name = a.name;
    Signature sig = a.sig;
    if (a.cache_id != Announcement::kNoCacheId) {
      const ResponseCache::Item& item = cache_.resolve(a.cache_id, from);
      name = item.name;
      sig = item.sig;
    }
    Tally& t = tallies_[name];
    if (t.seen.empty()) {
      t.seen.assign(size_, false);
      t.sigs.resize(size_);
      t.per_rank.resize(size_);
      t.first_us = now_us;
    }
    if (t.seen[from]) throw Error("rank " + std::to_string(from) + " announced '" + name + "' twice");
    t.seen[from] = true;
    t.sigs[from] = std::move(sig);
    t.per_rank[from] = a.per_rank;
    if (++t.count == size_) ready_.push_back(name);
  }
}

void Coordinator::rank_left(int rank) {
  if (rank < 0 || rank >= size_) return;
  gone_[rank] = true;
  release_retired_ids();
}

void Coordinator::release_retired_ids() {
  if (cache_.retired() == 0) return;
  uint64_t everyone = seq_;
  for (int r = 1; r < size_; ++r)  // rank 0 applies each message as it builds it
    if (!gone_[r]) everyone = std::min(everyone, applied_[r]);
  // Without hit cycles no kHits can name an evicted id: acknowledgements alone decide.
  cache_.acknowledged(everyone, hit_cycles_ ? cycles_completed_ : UINT64_MAX);
}

std::string Coordinator::describe_mismatch(const std::string& name, const Tally& t) const {
  for (int r = 1; r < size_; ++r) {
    std::string field = t.sigs[0].first_difference(t.sigs[r]);
    if (field.empty()) continue;
    std::ostringstream o;
    o << "ranks disagree on the " << field << " of tensor '" << name << "': ";
    for (int q = 0; q < size_; ++q) o << (q ? ", " : "") << "rank " << q << " has " << t.sigs[q].field_text(field);
    if (field == "calling thread")
      o << " (threads numbered in the order they first called this process group). Collectives without a name, "
           "such as torch.distributed's, are matched across ranks by the order of the calls; threads that call "
           "concurrently reach the group in a different order on each rank, which would reduce one thread's "
           "tensors with another's. Call a group from one thread at a time in the same order on every rank, or "
           "give each thread a group of its own; SMDDP_CHECK_CALLING_THREAD=0 turns this check off for programs "
           "that fix the order while moving calls between threads";
    return o.str();
  }
  return "";
}

ResponseMessage Coordinator::respond(int64_t fusion_bytes, int64_t now_us, std::vector<uint32_t> handed_over) {
  ResponseMessage m;
  m.after_cycle = cycles_completed_;
  m.handed_over = std::move(handed_over);
  ResponseBuilder build(&m.responses, fusion_bytes);
  for (const auto& name : ready_) {
    auto it = tallies_.find(name);
    Tally t = std::move(it->second);
    tallies_.erase(it);
    add_ready(name, std::move(t), build, m);
  }
  ready_.clear();
  add_stall_errors(now_us, m);
  if (!m.responses.empty() || !m.handed_over.empty()) ++seq_;
  return m;
}

void Coordinator::acknowledge(int from, uint64_t applied) {
  if (from < 0 || from >= size_) throw Error("internal: acknowledgement from rank " + std::to_string(from));
  if (applied > seq_)
    throw Error("rank " + std::to_string(from) + " says it applied response " + std::to_string(applied) +
                ", but rank 0 has built only " + std::to_string(seq_));
  // Messages arrive in order on each rank's channel: from now on this rank names no id
  // evicted by a message it has applied.
  if (applied > applied_[from]) {
    applied_[from] = applied;
    release_retired_ids();
  }
}

void Coordinator::cycle_completed(uint64_t cycles) {
  cycles_completed_ = cycles;
  release_retired_ids();
}

void Coordinator::add_ready(const std::string& name, Tally t, ResponseBuilder& build, ResponseMessage& m) {
  const Signature& sig = t.sigs[0];
  std::string mismatch = describe_mismatch(name, t);
  if (!mismatch.empty()) {
    m.responses.push_back(error_response(name, sig, mismatch));
    return;
  }
  if ((sig.op == OpType::kAllgather || sig.op == OpType::kAlltoall) && !sig.check_only) {
    // Only all announcements together tell whether every receiver's output fits. (A
    // check-only entry moves no bytes through the engine: NCCL's sizes are checked apart.)
    std::string bad = check_ragged(name, sig, t.per_rank, size_);
    if (!bad.empty()) {
      m.responses.push_back(error_response(name, sig, bad));
      return;
    }
  }
  // Agreed: cached from now on (the message being built is number seq_ + 1).
  build.add({name, cache_.use(name, sig, seq_ + 1, cycles_completed_, &m.evicted)}, sig, std::move(t.per_rank));
}

void Coordinator::add_stall_errors(int64_t now_us, ResponseMessage& m) {
  if (now_us - last_stall_check_us_ < 100000 || tallies_.empty()) return;
  last_stall_check_us_ = now_us;
  std::vector<std::string> expired;
  for (auto& kv : tallies_) {
    Tally& t = kv.second;
    std::vector<int> have, missing, gone;
    for (int r = 0; r < size_; ++r) {
      (t.seen[r] ? have : missing).push_back(r);
      if (!t.seen[r] && gone_[r]) gone.push_back(r);
    }
    const double age = double(now_us - t.first_us) / 1e6;
    std::string problem;
    if (!gone.empty()) {
      problem = "rank(s) " + rank_list(gone) + " shut down without submitting tensor '" + kv.first + "'";
    } else if (age > stall_timeout_s_) {
      problem = "tensor '" + kv.first + "' was submitted by rank(s) " + rank_list(have) + " but rank(s) " +
                rank_list(missing) + " did not submit it within " + std::to_string(int(stall_timeout_s_)) +
                " s (the timeout: SMDDP_TIMEOUT, or the framework's)";
    } else if (age > stall_warning_s_ && !t.stall_warned) {
      t.stall_warned = true;
      SMDDP_LOG(1, "tensor '" + kv.first + "' has waited " + std::to_string(int(age)) + " s: submitted by rank(s) " +
                       rank_list(have) + ", still missing rank(s) " + rank_list(missing));
    }
    if (problem.empty()) continue;
    m.responses.push_back(error_response(kv.first, t.sigs[have.front()], problem));
    expired.push_back(kv.first);
  }
  for (const auto& name : expired) tallies_.erase(name);
}

}  // namespace smddp
