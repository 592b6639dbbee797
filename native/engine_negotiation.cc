// Negotiation: ranks announce queued tensors to the coordinator (rank 0), which checks that
// all ranks agree, decides the order and the fusion of what is ready, and answers everyone
// with the same list of responses.
#include <algorithm>
#include <sstream>

#include "engine.h"
#include "validate.h"
#include "wire.h"

namespace smddp {

namespace {

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream o;
  for (size_t i = 0; i < ranks.size(); ++i) o << (i ? ", " : "") << ranks[i];
  return o.str();
}

}  // namespace

std::string Engine::cache_key(const std::string& name, const Signature& sig) {
  Writer w;
  w.put_string(name);
  sig.write(w);
  return w.take();
}

bool Engine::announce_new_entries() {
  std::deque<std::shared_ptr<Entry>> fresh;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (batch_depth_ > 0 && !flush_batch_) return false;
    flush_batch_ = false;
    fresh.swap(incoming_);
  }
  if (fresh.empty()) return false;
  std::vector<Announcement> list;
  for (auto& e : fresh) {
    if (e->is_p2p) {
      if (p2p_sends_.empty() && p2p_recvs_.empty()) last_p2p_progress_us_ = now_us();
      (e->is_send ? p2p_sends_ : p2p_recvs_)[e->peer].push_back(e);
      continue;
    }
    pending_[e->name] = e;
    e->announce_us = now_us();
    Announcement a;
    a.per_rank = e->per_rank;
    auto cached = cache_by_key_.find(cache_key(e->name, e->sig));
    if (cached != cache_by_key_.end()) {
      a.cache_id = cached->second;
      counters_.cache_hits++;
    } else {
      a.name = e->name;
      a.sig = e->sig;
      counters_.cache_misses++;
    }
    list.push_back(std::move(a));
  }
  if (list.empty()) return true;
  if (rank() == 0) {
    tally(0, list);
  } else {
    std::string msg = encode_announcements(list);
    counters_.negotiation_bytes += msg.size();
    comm_->send_message(0, kControlChannel, msg, "announcing tensors to rank 0");
  }
  return true;
}

bool Engine::poll_coordinator_messages() {
  bool busy = false;
  std::string msg;
  for (int r = 1; r < size(); ++r) {
    if (rank_gone_[r]) continue;
    while (comm_->channel(r, kControlChannel)->poll_message(&msg)) {
      busy = true;
      Reader reader(std::move(msg));
      auto type = MessageType(reader.get<uint8_t>());
      if (type == MessageType::kGoodbye) {
        rank_gone_[r] = true;
        break;
      }
      if (type == MessageType::kAbort) throw PeerError(reader.get_string());
      if (type != MessageType::kAnnounce) throw Error("unexpected negotiation message from rank " + std::to_string(r));
      tally(r, decode_announcements(reader));
    }
  }
  return busy;
}

bool Engine::poll_responses() {
  bool busy = false;
  std::string msg;
  Channel* ch = comm_->channel(0, kControlChannel);
  while (ch->poll_message(&msg)) {
    busy = true;
    Reader reader(std::move(msg));
    auto type = MessageType(reader.get<uint8_t>());
    if (type == MessageType::kGoodbye) {
      // Rank 0 closes its connections next: stop reading them, it is not a failure.
      rank_gone_[0] = true;
      fail_everything("rank 0 has shut down; no further collectives are possible", "");
      return true;
    }
    if (type == MessageType::kAbort) throw PeerError(reader.get_string());
    last_heard_from_coordinator_us_ = now_us();
    if (type == MessageType::kHeartbeat) continue;
    if (type != MessageType::kRespond) throw Error("unexpected negotiation message from rank 0");
    counters_.negotiation_round_trips++;
    for (const auto& resp : decode_responses(reader)) execute(resp);
  }
  return busy;
}

void Engine::tally(int from, const std::vector<Announcement>& list) {
  for (const auto& a : list) {
    std::string name = a.name;
    Signature sig = a.sig;
    if (a.cache_id != Announcement::kNoCacheId) {
      if (a.cache_id >= cache_.size()) throw Error("rank " + std::to_string(from) + " used an unknown cache id");
      name = cache_[a.cache_id].name;
      sig = cache_[a.cache_id].sig;
    }
    Tally& t = tallies_[name];
    if (t.seen.empty()) {
      t.seen.assign(size(), false);
      t.sigs.resize(size());
      t.per_rank.resize(size());
      t.first_us = now_us();
    }
    if (t.seen[from]) throw Error("rank " + std::to_string(from) + " announced '" + name + "' twice");
    t.seen[from] = true;
    t.sigs[from] = sig;
    t.per_rank[from] = a.per_rank;
    if (++t.count == size()) ready_.push_back(name);
  }
}

std::string Engine::describe_mismatch(const std::string& name) {
  const Tally& t = tallies_.at(name);
  for (int r = 1; r < size(); ++r) {
    std::string field = t.sigs[0].first_difference(t.sigs[r]);
    if (field.empty()) continue;
    std::ostringstream o;
    o << "ranks disagree on the " << field << " of tensor '" << name << "': ";
    for (int q = 0; q < size(); ++q) o << (q ? ", " : "") << "rank " << q << " has " << t.sigs[q].field_text(field);
    return o.str();
  }
  return "";
}

std::vector<Response> Engine::build_responses() {
  std::vector<Response> out;
  struct OpenBucket {
    size_t index;
    int64_t bytes;
  };
  std::vector<OpenBucket> open;  // at most one per (dtype, op, scales)
  for (const auto& name : ready_) {
    std::string mismatch = describe_mismatch(name);
    Tally t = std::move(tallies_.at(name));
    tallies_.erase(name);
    const Signature& sig = t.sigs[0];
    if (!mismatch.empty()) {
      Response r;
      r.is_error = true;
      r.error = mismatch;
      r.sig = sig;
      r.entries.push_back({name, Announcement::kNoCacheId});
      out.push_back(std::move(r));
      continue;
    }
    ResponseEntry entry{name, Announcement::kNoCacheId};
    const std::string key = cache_key(name, sig);
    auto cached = cache_by_key_.find(key);
    if (cached != cache_by_key_.end()) {
      entry.cache_id = cached->second;
    } else if (int64_t(cache_.size()) < config_.cache_capacity) {
      entry.cache_id = uint32_t(cache_.size());
      cache_.push_back({name, sig});
      cache_by_key_[key] = entry.cache_id;
    }
    if (sig.check_only) {  // cached like the rest (the CUDA path's names repeat), never fused
      Response r;
      r.sig = sig;
      r.entries.push_back(entry);
      out.push_back(std::move(r));
      continue;
    }
    if (sig.op == OpType::kAllreduce) {
      const int64_t bytes = element_count(sig.shape) * int64_t(dtype_size(sig.dtype));
      OpenBucket* fit = nullptr;
      for (auto& b : open) {
        const Signature& bs = out[b.index].sig;
        if (bs.dtype == sig.dtype && bs.reduce_op == sig.reduce_op && bs.prescale == sig.prescale &&
            bs.postscale == sig.postscale) {
          fit = &b;
          break;
        }
      }
      if (fit && fit->bytes + bytes <= fusion_bytes_.load()) {
        out[fit->index].entries.push_back(entry);
        fit->bytes += bytes;
        continue;
      }
      Response r;
      r.sig = sig;
      r.entries.push_back(entry);
      out.push_back(std::move(r));
      if (fit) *fit = {out.size() - 1, bytes};
      else open.push_back({out.size() - 1, bytes});
      continue;
    }
    Response r;
    r.sig = sig;
    r.entries.push_back(entry);
    if (sig.op == OpType::kAllgather || sig.op == OpType::kAlltoall) {
      // Only all announcements together tell whether every receiver's output fits.
      std::string bad = check_ragged(name, sig, t.per_rank, size());
      if (!bad.empty()) {
        r.is_error = true;
        r.error = bad;
      } else {
        r.per_rank = t.per_rank;
      }
    }
    out.push_back(std::move(r));
  }
  ready_.clear();
  for (auto& r : check_stalls()) out.push_back(std::move(r));
  return out;
}

std::vector<Response> Engine::check_stalls() {
  std::vector<Response> errors;
  int64_t now = now_us();
  if (now - last_stall_check_us_ < 100000 || tallies_.empty()) return errors;
  last_stall_check_us_ = now;
  std::vector<std::string> expired;
  for (auto& kv : tallies_) {
    Tally& t = kv.second;
    std::vector<int> have, missing, gone;
    for (int r = 0; r < size(); ++r) {
      (t.seen[r] ? have : missing).push_back(r);
      if (!t.seen[r] && rank_gone_[r]) gone.push_back(r);
    }
    double age = double(now - t.first_us) / 1e6;
    std::string problem;
    if (!gone.empty()) {
      problem = "rank(s) " + rank_list(gone) + " shut down without submitting tensor '" + kv.first + "'";
    } else if (age > stall_timeout_s_) {
      problem = "tensor '" + kv.first + "' was submitted by rank(s) " + rank_list(have) + " but rank(s) " +
                rank_list(missing) + " did not submit it within " + std::to_string(int(stall_timeout_s_)) +
                " s (the timeout: SMDDP_TIMEOUT, or the framework's)";
    } else if (age > config_.stall_warning_s && !t.stall_warned) {
      t.stall_warned = true;
      SMDDP_LOG(1, "tensor '" + kv.first + "' has waited " + std::to_string(int(age)) + " s: submitted by rank(s) " +
                       rank_list(have) + ", still missing rank(s) " + rank_list(missing));
    }
    if (problem.empty()) continue;
    Response r;
    r.is_error = true;
    r.error = problem;
    r.sig = t.sigs[have.front()];
    r.entries.push_back({kv.first, Announcement::kNoCacheId});
    errors.push_back(std::move(r));
    expired.push_back(kv.first);
  }
  for (const auto& name : expired) tallies_.erase(name);
  return errors;
}

void Engine::check_coordinator_alive() {
  if (pending_.empty()) return;
  const int64_t now = now_us();
  int64_t waiting_since = now;
  for (const auto& kv : pending_) waiting_since = std::min(waiting_since, kv.second->announce_us);
  const int64_t silent_since = std::max(waiting_since, last_heard_from_coordinator_us_);
  const double silent_s = double(now - silent_since) / 1e6;
  if (silent_s <= stall_timeout_s_) return;
  throw PeerError("rank 0 (the coordinator) has not answered for " + std::to_string(int(silent_s)) +
                  " s while this rank waits on '" + pending_.begin()->first +
                  "': it is stalled (stopped, hung) or its host is unreachable (SMDDP_TIMEOUT, or the framework's "
                  "timeout)");
}

}  // namespace smddp
