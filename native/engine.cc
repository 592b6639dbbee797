// Engine lifecycle, the caller-facing queue and handles, and the background loop.
#include "engine.h"

#include <sched.h>

#include <algorithm>
#include <cstring>

#include "reduce_kernels.h"
#include "validate.h"

namespace smddp {

Engine::Engine(const WorldSpec& spec) : config_(EngineConfig::from_environment()) {
  set_log_identity(spec.rank, config_.log_level);
  comm_ = std::make_unique<Comm>(spec, config_);
  config_ = comm_->config();  // with the values only the world's shape decides
  rank_ = comm_->rank();
  size_ = comm_->size();
  local_rank_ = comm_->local_rank();
  local_size_ = comm_->local_size();
  num_hosts_ = comm_->num_hosts();
  host_index_ = comm_->host_index();
  stall_timeout_s_ = spec.stall_timeout_s > 0 ? spec.stall_timeout_s : config_.timeout_s;
  fusion_bytes_ = config_.fusion_bytes;
  timeline_.open(config_.timeline_path, comm_->rank());
  rank_gone_.assign(comm_->size(), false);
  const bool hit_cycles = config_.hit_exchange && config_.cache_capacity > 0;
  if (rank_ == 0)
    coordinator_ = std::make_unique<Coordinator>(size_, size_t(std::max<int64_t>(config_.cache_capacity, 0)),
                                                 stall_timeout_s_, config_.stall_warning_s, hit_cycles);
  if (hit_cycles) hits_ = std::make_unique<HitAgreement>(size_, rank_);
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  try {
    shutdown();
  } catch (...) {
  }
}

uint64_t Engine::submit(const std::string& name, const Signature& sig, const void* in, void* out, size_t count,
                        size_t out_capacity, const std::vector<int64_t>& per_rank) {
  if (name.empty()) throw Error("a collective needs a non-empty name");
  if (int(sig.dtype) >= int(DType::kCount)) throw Error("unsupported dtype code " + std::to_string(int(sig.dtype)));
  if (sig.op == OpType::kAllreduce || sig.op == OpType::kReduce || sig.op == OpType::kReduceScatter)
    check_reduce_supported(sig.dtype, sig.reduce_op);
  if ((sig.op == OpType::kBroadcast || sig.op == OpType::kReduce) && (sig.root < 0 || sig.root >= size()))
    throw Error(std::string(op_type_name(sig.op)) + " '" + name + "': root " + std::to_string(sig.root) +
                " is not a rank of this world of " + std::to_string(size()));
  validate_submission(name, sig, in, out, count, out_capacity, per_rank, rank(), size());
  auto e = std::make_shared<Entry>();
  e->name = name;
  e->sig = sig;
  e->in = static_cast<const char*>(in);
  e->out = static_cast<char*>(out);
  e->count = count;
  e->out_capacity = out_capacity;
  e->per_rank = per_rank;
  if (sig.op == OpType::kAllgather || sig.op == OpType::kAlltoall)  // the coordinator checks it fits
    e->per_rank.push_back(out ? int64_t(out_capacity) : -1);
  e->submit_us = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abort_message_.empty()) throw Error(abort_message_);
  if (shut_down_) throw Error("the smddp engine was shut down");
  auto same = in_flight_names_.find(name);
  if (same != in_flight_names_.end())
    throw Error("tensor '" + name + "' was submitted again before its previous " + op_type_name(same->second) +
                " completed; names must be unique among operations in flight");
  in_flight_names_.emplace(name, sig.op);
  if (!sig.check_only) data_in_flight_++;
  e->handle = next_handle_++;
  handles_[e->handle] = e;
  incoming_.push_back(e);
  counters_.submitted++;
  wake_engine();
  return e->handle;
}

void Engine::begin_batch() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++batch_depth_;
}

void Engine::end_batch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (batch_depth_ == 0) throw Error("end_batch() without begin_batch()");
    if (--batch_depth_ > 0) return;
  }
  wake_engine();
}

void Engine::wake_engine() {
  work_cv_.notify_one();
  if (Doorbell* bell = comm_ ? comm_->own_doorbell() : nullptr) ring_doorbell(*bell);
}

uint64_t Engine::submit_p2p(bool is_send, int peer, int64_t tag, void* buf, size_t bytes) {
  if (peer < 0 || peer >= size() || peer == rank())
    throw Error(std::string(is_send ? "send" : "recv") + ": peer " + std::to_string(peer) +
                " is not another rank of this world of " + std::to_string(size()));
  auto e = std::make_shared<Entry>();
  e->is_p2p = true;
  e->is_send = is_send;
  e->peer = peer;
  e->tag = tag;
  e->name = std::string(is_send ? "send to " : "recv from ") + std::to_string(peer);
  e->in = static_cast<const char*>(buf);
  e->out = static_cast<char*>(buf);
  e->count = bytes;
  e->submit_us = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abort_message_.empty()) throw Error(abort_message_);
  if (shut_down_) throw Error("the smddp engine was shut down");
  data_in_flight_++;
  e->handle = next_handle_++;
  handles_[e->handle] = e;
  incoming_.push_back(e);
  counters_.submitted++;
  wake_engine();
  return e->handle;
}

void Engine::complete(const std::shared_ptr<Entry>& e, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (e->done) return;
    e->error = error;
    // Counted before done becomes visible under the lock: a caller that sees its work done
    // and then reads counters() finds it counted (the engine tests read counters per step).
    (error.empty() ? counters_.completed : counters_.failed)++;
    e->done = true;
    if (!e->is_p2p) in_flight_names_.erase(e->name);
    if (!e->sig.check_only) {
      data_in_flight_--;
      last_data_done_us_ = now_us();
    }
    if (e->notify_channel >= 0) {
      completions_[e->notify_channel].push_back(e->handle);
      completion_cv_.notify_all();
    }
  }
  done_cv_.notify_all();
}

bool Engine::wait_until_done(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Entry>& e, double timeout_s) {
  if (timeout_s == 0) return e->done;  // a poll
  if (batch_depth_ > 0 && !e->done) {
    flush_batch_ = true;
    wake_engine();
  }
  // A short spin first: back-to-back small collectives finish within microseconds and a
  // condition-variable sleep would double their latency.
  auto spin_until = Clock::now() + std::chrono::microseconds(config_.spin_us < 200 ? config_.spin_us : 200);
  while (!e->done && Clock::now() < spin_until) {
    lock.unlock();
    sched_yield();
    lock.lock();
  }
  auto pred = [&] { return e->done; };
  if (timeout_s < 0) {
    done_cv_.wait(lock, pred);
    return true;
  }
  return done_cv_.wait_for(lock, std::chrono::microseconds(int64_t(timeout_s * 1e6)), pred);
}

bool Engine::wait_done(uint64_t handle, double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return true;
  auto e = it->second;
  return wait_until_done(lock, e, timeout_s);
}

void Engine::wait(uint64_t handle, double timeout_s, bool keep) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) throw Error("unknown or already released handle " + std::to_string(handle));
  auto e = it->second;
  if (!wait_until_done(lock, e, timeout_s))
    throw Error("wait on '" + e->name + "' timed out after " + std::to_string(timeout_s) + " s");
  std::string error = e->error;
  if (!keep || !error.empty()) handles_.erase(handle);
  if (!error.empty()) throw Error(error);
}

bool Engine::poll(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) throw Error("unknown or already released handle " + std::to_string(handle));
  return it->second->done;
}

std::vector<int64_t> Engine::result_counts(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = handles_.find(handle);
  if (it == handles_.end() || !it->second->done) throw Error("result_counts: operation not complete");
  return it->second->result_counts;
}

size_t Engine::owned_output_bytes(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = handles_.find(handle);
  if (it == handles_.end() || !it->second->done) throw Error("output: operation not complete");
  return it->second->owned_output.size();
}

void Engine::copy_owned_output(uint64_t handle, void* dst) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = handles_.find(handle);
  if (it == handles_.end() || !it->second->done) throw Error("output: operation not complete");
  const auto& v = it->second->owned_output;
  if (!v.empty()) std::memcpy(dst, v.data(), v.size());
}

void Engine::watch(uint64_t handle, int channel) {
  if (channel < 0 || channel >= kCompletionChannels) throw Error("no completion channel " + std::to_string(channel));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) throw Error("unknown or already released handle " + std::to_string(handle));
  if (it->second->done) {
    completions_[channel].push_back(handle);
    completion_cv_.notify_all();
  } else {
    it->second->notify_channel = channel;
  }
}

std::vector<uint64_t> Engine::next_completions(double timeout_s, int channel) {
  if (channel < 0 || channel >= kCompletionChannels) throw Error("no completion channel " + std::to_string(channel));
  std::unique_lock<std::mutex> lock(mutex_);
  auto& queue = completions_[channel];
  completion_cv_.wait_for(lock, std::chrono::microseconds(int64_t(timeout_s * 1e6)),
                          [&] { return !queue.empty() || shut_down_; });
  std::vector<uint64_t> out(queue.begin(), queue.end());
  queue.clear();
  return out;
}

bool Engine::is_shut_down() {
  std::lock_guard<std::mutex> lock(mutex_);
  return shut_down_;
}

void Engine::release(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  handles_.erase(handle);
}

std::string Engine::abort_message() {
  std::lock_guard<std::mutex> lock(mutex_);
  return abort_message_;
}

void Engine::fail_with_received_errors() {
  // Rank 0's error responses wait here for a hit cycle that a stopped rank may never finish
  // (it stopped while listing): the decided error names the culprit, a closed connection
  // from ranks that raised it and left does not.
  for (const auto& m : waiting_responses_)
    for (const auto& resp : m.responses) {
      if (!resp.is_error) continue;
      for (const auto& re : resp.entries) {
        auto it = pending_.find(re.name);
        if (it == pending_.end()) continue;
        auto e = it->second;
        pending_.erase(it);
        complete(e, failure_text(*e, resp.error));
      }
    }
  waiting_responses_.clear();
}

void Engine::fail_everything(const std::string& message, const std::string& abort_cause) {
  fail_with_received_errors();
  std::vector<std::shared_ptr<Entry>> victims;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abort_message_.empty()) abort_message_ = message;
    for (auto& kv : handles_)
      if (!kv.second->done) victims.push_back(kv.second);
    incoming_.clear();
  }
  if (!abort_cause.empty()) comm_->abort(abort_cause);
  for (auto& e : victims) complete(e, message);
  pending_.clear();
  hit_entries_.clear();
  unlisted_hits_.clear();
  p2p_sends_.clear();
  p2p_recvs_.clear();
}

void Engine::loop() {
  auto idle_since = Clock::now();
  // With every peer on this host, all news (messages, submissions) rings our doorbell.
  Doorbell* bell = num_hosts() == 1 ? comm_->own_doorbell() : nullptr;
  while (!stop_) {
    const uint32_t seen = bell ? bell->rings.load(std::memory_order_acquire) : 0;
    bool busy = false;
    try {
      busy = step();
    } catch (const std::exception& ex) {
      abort_job(ex);
      // Stay alive so later submissions fail fast with the same message.
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_.load(); });
      break;
    }
    if (busy) {
      idle_since = Clock::now();
      continue;
    }
    int64_t idle_us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - idle_since).count();
    const bool data_waits = data_in_flight_ > 0 || now_us() - last_data_done_us_ < config_.spin_us;
    if (data_waits && idle_us < config_.spin_us) {
      sched_yield();
    } else if (bell) {
      // Time-bounded so stall checks and liveness checks still run.
      wait_doorbell(*bell, seen, idle_us < 50000 ? 2000 : 20000);
    } else {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait_for(lock, std::chrono::microseconds(idle_us < 50000 ? 100 : 1000),
                        [&] { return !incoming_.empty() || stop_.load(); });
    }
  }
  // Orderly goodbye so peers report "shut down" instead of waiting for a timeout.
  if (abort_message().empty() && size() > 1) {
    const std::string bye(1, char(MessageType::kGoodbye));
    // Each peer separately: one that has already left must not keep the others from hearing
    // the goodbye (they would report this rank as dead). Every peer, as hit cycles involve all.
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      try {
        comm_->send_message(r, kControlChannel, bye, "shutdown");
      } catch (const std::exception&) {
        // That peer is already gone: nothing to tell it.
      }
    }
  }
}

bool Engine::step() {
  bool busy = announce_new_entries();
  busy |= poll_control_messages();
  if (rank() == 0) {
    const int64_t now = now_us();
    if (size() > 1 && now - last_heartbeat_sent_us_ > kHeartbeatUs) {
      last_heartbeat_sent_us_ = now;
      const std::string beat(1, char(MessageType::kHeartbeat));
      for (int r = 1; r < size(); ++r)
        if (!rank_gone_[r]) comm_->send_message(r, kControlChannel, beat, "sending a heartbeat");
    }
  }
  if (!rank0_left_handled_) {
    busy |= progress_negotiation();
    if (rank() != 0) {
      check_coordinator_alive();
      if (rank_gone_[0]) finish_after_rank0_left();
    }
    check_hit_cycle_alive();
  }
  busy |= progress_p2p();
  if (!busy && (!pending_.empty() || !p2p_sends_.empty() || !p2p_recvs_.empty())) {
    static thread_local int64_t last_check = 0;
    int64_t now = now_us();
    if (now - last_check > 10000) {
      last_check = now;
      comm_->check_alive("a collective");
    }
  }
  return busy;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_ = true;
  }
  wake_engine();
  work_cv_.notify_all();
  completion_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  fail_everything("the smddp engine was shut down", "");
  timeline_.close();
  comm_.reset();  // closes channels and the store; the world's shape stays readable
}

}  // namespace smddp
