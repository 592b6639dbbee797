// The communicator: who the ranks are, where they live, and the channels between them.
// Bootstraps through the rendezvous store (addresses, host grouping, the host's shared
// memory segment, the TCP mesh between hosts) and drives non-blocking transfers to
// completion while watching for dead peers and timeouts.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "channel.h"
#include "config.h"
#include "shm_segment.h"
#include "store.h"

namespace smddp {

struct WorldSpec {
  int rank = 0;
  int size = 1;
  int local_rank = -1;  // -1: unknown, computed from host keys
  int local_size = -1;
  std::string host;  // host key; ranks with equal keys share memory
  std::string store_addr = "127.0.0.1";
  int store_port = 0;
  std::string secret;
  // A framework's store to bootstrap through instead of our own (then store_addr/port are
  // unused), and the address other hosts reach this rank at (default: found by the store).
  std::shared_ptr<Rendezvous> rendezvous;
  std::string advertise_addr;
  // Seconds a tensor may wait for ranks that have not submitted it; <0: SMDDP_TIMEOUT.
  double stall_timeout_s = -1;
};

// One pending piece of a transfer set: send or receive `n` bytes on a channel.
struct Transfer {
  Channel* channel;
  bool is_send;
  char* ptr;
  size_t n;
  size_t done = 0;
};

class Comm {
 public:
  Comm(const WorldSpec& spec, const EngineConfig& config);
  ~Comm();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int num_hosts() const { return int(host_ranks_.size()); }
  int host_index() const { return host_index_; }
  // Global ranks on host h, in rank order; the first is that host's leader.
  const std::vector<int>& host_ranks(int h) const { return host_ranks_[h]; }
  int host_of(int rank) const { return rank_host_[rank]; }
  const EngineConfig& config() const { return config_; }
  HostSegment* host_segment() { return segment_.get(); }
  Channel* channel(int peer, ChannelKind kind);
  int store_refused_connections() const { return store_server_ ? store_server_->refused_connections() : 0; }
  // Connections this rank's bootstrap listener turned away (each is logged too).
  int bootstrap_refused_connections() const { return bootstrap_refused_; }

  // Runs transfers until all complete. Fails with PeerError after `timeout_s` without
  // progress, or as soon as the host is aborted or a peer dies; `what` names the operation.
  void run(std::vector<Transfer>& transfers, const std::string& what);
  void send_message(int peer, ChannelKind kind, const std::string& payload, const std::string& what);
  // Barrier among this host's ranks with liveness checks.
  void host_barrier(const std::string& what);
  // This rank's doorbell (null without local peers), and ringing it (new local work).
  Doorbell* own_doorbell() { return segment_ ? &segment_->doorbell(local_rank_) : nullptr; }
  // Raises PeerError if another rank aborted or a local peer died.
  void check_alive(const std::string& what);
  // Marks the job aborted for the local peers and closes remote connections so every rank
  // learns of the failure quickly.
  void abort(const std::string& message);
  // Whether local ranks can read each other's memory (cross-memory attach).
  bool cma_enabled() const { return cma_enabled_; }
  int local_pid(int local_rank) const { return segment_->control()->pids[local_rank]; }
  // Scratch memory owned by the communicator (grown on demand, reused across calls).
  char* scratch(size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }
  // Counter shared by all local ranks' staging-slot rounds (they run in lockstep).
  uint64_t next_slot_round() { return slot_round_++; }

 private:
  void bootstrap(const WorldSpec& spec);
  void accept_peer_connections(Socket& listener, int expected, double timeout);
  void connect_mesh(const std::vector<std::string>& addrs);

  EngineConfig config_;
  int rank_, size_;
  int local_rank_ = 0, local_size_ = 1;
  int host_index_ = 0;
  std::vector<std::vector<int>> host_ranks_;
  std::vector<int> rank_host_;
  std::string secret_;
  std::unique_ptr<StoreServer> store_server_;
  std::shared_ptr<Rendezvous> store_;
  std::unique_ptr<HostSegment> segment_;
  // channels_[peer][kind]
  std::vector<std::vector<std::unique_ptr<Channel>>> channels_;
  uint64_t slot_round_ = 0;
  bool cma_enabled_ = false;
  std::vector<char> scratch_;
  bool aborted_ = false;
  int bootstrap_refused_ = 0;
};

}  // namespace smddp
