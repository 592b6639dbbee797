// The engine: one background thread per process. Frontends enqueue named operations and
// get a handle; the thread agrees with the other ranks (through the coordinator, rank 0) on
// what is ready, fuses ready allreduces into buckets, runs the collectives and completes the
// handles. Waiting is on a condition variable, never a busy loop in the caller.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "calling_threads.h"
#include "comm.h"
#include "coordinator.h"
#include "hit_agreement.h"
#include "messages.h"
#include "response_cache.h"
#include "timeline.h"

namespace smddp {

struct Counters {
  std::atomic<uint64_t> submitted{0};
  std::atomic<uint64_t> completed{0};
  std::atomic<uint64_t> failed{0};
  std::atomic<uint64_t> responses{0};        // collective responses executed
  std::atomic<uint64_t> fused_responses{0};  // of which carried more than one tensor
  std::atomic<uint64_t> fused_tensors{0};    // tensors that travelled in a fused response
  std::atomic<uint64_t> allreduce_bytes{0};
  std::atomic<uint64_t> negotiation_round_trips{0};  // response messages from rank 0 applied
  std::atomic<uint64_t> hit_cycles{0};               // hit cycles completed (hit_agreement.h)
  std::atomic<uint64_t> negotiation_bytes{0};        // bytes this rank sent for negotiation
  std::atomic<uint64_t> cache_hits{0};               // found in the cache (listed in a hit cycle or announced by id)
  std::atomic<uint64_t> cache_misses{0};             // announced in full
  std::atomic<uint64_t> cache_evictions{0};          // ids this rank saw evicted
  std::atomic<uint64_t> p2p_messages{0};
};

// One queued operation, owned by the engine until the caller waits on it.
struct Entry {
  uint64_t handle = 0;
  std::string name;
  Signature sig;
  std::vector<int64_t> per_rank;  // this rank's ragged information (see Announcement)
  const char* in = nullptr;
  char* out = nullptr;
  size_t count = 0;         // elements of `in`
  size_t out_capacity = 0;  // bytes available at `out`
  // Engine-owned output for results whose size only negotiation tells (ragged allgather, alltoall).
  std::vector<char> owned_output;
  std::vector<int64_t> result_counts;  // rows received from each rank (allgather/alltoall)
  int64_t submit_us = 0;
  int64_t announce_us = 0;                     // when the engine thread picked it up and announced it
  uint32_t hit_id = Announcement::kNoCacheId;  // the cache id it waits under in hit cycles
  // Point-to-point fields.
  bool is_p2p = false, is_send = false;
  int peer = -1;
  int64_t tag = 0;
  size_t p2p_done = 0;
  int64_t p2p_header[2] = {0, 0};
  size_t p2p_header_done = 0;
  // Completion.
  int notify_channel = -1;  // report through next_completions(channel); -1: not watched
  bool done = false;
  std::string error;
};

class Engine {
 public:
  Engine(const WorldSpec& spec);
  ~Engine();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int num_hosts() const { return num_hosts_; }
  int host_index() const { return host_index_; }
  const EngineConfig& config() const { return config_; }
  // The fusion threshold rank 0 applies from now on (a wrapper's bucket_cap_mb); every rank
  // may call it, only rank 0's value matters.
  void set_fusion_threshold(int64_t bytes) { fusion_bytes_ = bytes; }
  int64_t fusion_threshold() const { return fusion_bytes_; }

  // Queues a collective. `out` may be null for allgather/alltoall: the engine allocates.
  // `out_capacity` is the size of `out` in bytes, checked against what negotiation decides.
  uint64_t submit(const std::string& name, const Signature& sig, const void* in, void* out, size_t count,
                  size_t out_capacity, const std::vector<int64_t>& per_rank);
  uint64_t submit_p2p(bool is_send, int peer, int64_t tag, void* buf, size_t bytes);
  // For collectives matched by call order: the calling thread's number, to put in
  // Signature::caller (calling_threads.h); 0 with SMDDP_CHECK_CALLING_THREAD=0.
  uint32_t calling_thread() { return config_.check_calling_thread ? calling_threads_.number_of_this_thread() : 0; }
  // Operations submitted between begin_batch() and end_batch() reach the engine together,
  // so they are announced in one message and, once every rank's batch is in, fused. Waiting
  // on one of them before end_batch() announces what the batch holds so far.
  void begin_batch();
  void end_batch();

  // Blocks until done; throws Error with the failure's message. Releases the entry unless it
  // succeeded and `keep` asks to read its results first (then call release()).
  void wait(uint64_t handle, double timeout_s, bool keep = false);
  // Whether the operation finished within timeout_s (< 0: no limit); it stays unreleased.
  // An unknown handle counts as finished (it was released by whoever waited first).
  bool wait_done(uint64_t handle, double timeout_s);
  // True once done (successfully or not); never blocks.
  bool poll(uint64_t handle);
  // After completion: rows received per rank, and the engine-owned output (if any).
  std::vector<int64_t> result_counts(uint64_t handle);
  size_t owned_output_bytes(uint64_t handle);
  void copy_owned_output(uint64_t handle, void* dst);
  void release(uint64_t handle);
  // Completion notifications for frontends that complete futures: after watch(h, c), h is
  // returned once by next_completions(c) when it finishes (at once if it already has). Each
  // channel has one reader: the Python frontends read channel 0, the native torch Backend
  // channel 1, so neither takes the other's notifications.
  static constexpr int kCompletionChannels = 2;
  void watch(uint64_t handle, int channel = 0);
  std::vector<uint64_t> next_completions(double timeout_s, int channel = 0);
  bool is_shut_down();

  const Counters& counters() const { return counters_; }
  std::string abort_message();
  int store_refused_connections() const { return comm_ ? comm_->store_refused_connections() : 0; }
  int bootstrap_refused_connections() const { return comm_ ? comm_->bootstrap_refused_connections() : 0; }
  void shutdown();

 private:
  void loop();
  bool step();  // one pass of the background loop; true if anything happened
  // Fails every queued operation with `message`; a non-empty `abort_cause` also makes the
  // other ranks fail with it.
  void fail_everything(const std::string& message, const std::string& abort_cause);
  void wake_engine();  // new work or shutdown: the background thread must look
  void complete(const std::shared_ptr<Entry>& e, const std::string& error);
  // With mutex_ held (through `lock`): spins briefly, then sleeps until `e` is done.
  bool wait_until_done(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Entry>& e, double timeout_s);

  // Negotiation (engine_negotiation.cc): announcements to the coordinator, which decides
  // (coordinator.h), hit cycles for cached collectives (hit_agreement.h), and running what
  // both decide in the one order every rank shares (messages.h).
  bool announce_new_entries();
  void send_announcements(std::vector<Announcement> list);
  void announce_in_full(uint32_t hit_id);                       // a hit whose id was evicted goes to rank 0
  void taken_by_coordinator(int rank, uint32_t hit_id);         // rank's listing now answered by rank 0
  void forward_to_coordinator(const HitAgreement::Listing& l);  // rank 0
  bool poll_control_messages();                                 // every peer's control channel
  bool progress_negotiation();  // responses, hit cycles and rank 0's next message, in order
  void run_hit_cycle(HitAgreement::Outcome& out);
  bool send_responses();  // rank 0: the coordinator's next message, to everyone
  void apply(const ResponseMessage& m);
  uint64_t responses_applied() const;
  uint64_t cycles_completed() const { return hits_ ? hits_->completed() : 0; }
  // The cache this rank announces from: rank 0's own table, or this rank's replica of it.
  ResponseCache& known_ids() { return coordinator_ ? coordinator_->cache() : replica_; }

  // Execution (engine_execute.cc).
  void execute(const Response& r);
  static std::string failure_text(const Entry& e, const std::string& error);
  void fail_with_received_errors();
  void execute_allreduce(const Response& r, std::vector<std::shared_ptr<Entry>>& entries);
  void execute_single(const Response& r, const std::shared_ptr<Entry>& e);

  // Failure propagation (engine_abort.cc).
  void abort_job(const std::exception& ex);
  std::string wait_for_root_cause(double seconds);
  void broadcast_abort(const std::string& cause);
  std::vector<bool> quiet_peers_;  // peers whose control connection closed without a goodbye

  // Point-to-point (engine_p2p.cc).
  bool progress_p2p();
  bool progress_sends(int peer, std::deque<std::shared_ptr<Entry>>& queue);
  bool progress_receives(int peer, std::deque<std::shared_ptr<Entry>>& posted);
  // Completes a posted receive from a message that arrived before it (false if none matches).
  bool match_unexpected(int peer, const std::shared_ptr<Entry>& recv);

  EngineConfig config_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, num_hosts_ = 1, host_index_ = 0;
  std::unique_ptr<Comm> comm_;
  Timeline timeline_;
  Counters counters_;
  CallingThreads calling_threads_;

  std::mutex mutex_;
  std::condition_variable work_cv_;  // wakes the background thread
  std::condition_variable done_cv_;  // wakes waiting callers
  std::condition_variable completion_cv_;
  std::deque<uint64_t> completions_[kCompletionChannels];
  double stall_timeout_s_ = 0;
  std::atomic<int64_t> fusion_bytes_{0};
  std::deque<std::shared_ptr<Entry>> incoming_;
  // Names of collectives submitted and not yet done (guarded by mutex_): a duplicate is refused
  // at submission without scanning every handle.
  std::unordered_map<std::string, OpType> in_flight_names_;
  // Operations that move data here (not CUDA argument checks, whose data NCCL moves), in
  // flight, and when the last of them finished: the background thread spins for the next
  // message only while one is in flight or just finished. Checks arrive through a training
  // step with nothing waiting on them, and spinning after each one took a core from the
  // host thread issuing the step's GPU work.
  std::atomic<int> data_in_flight_{0};
  std::atomic<int64_t> last_data_done_us_{0};
  int batch_depth_ = 0;  // >0: incoming_ is held back (guarded by mutex_)
  // Someone waits on an operation a batch still holds: announce what it holds so far, or the
  // wait (a synchronous call inside the batch) would never return.
  bool flush_batch_ = false;
  std::unordered_map<uint64_t, std::shared_ptr<Entry>> handles_;
  std::string abort_message_;
  uint64_t next_handle_ = 1;
  std::atomic<bool> stop_{false};
  bool shut_down_ = false;
  std::thread thread_;

  // Background-thread state (no lock needed).
  std::unordered_map<std::string, std::shared_ptr<Entry>> pending_;   // announced, not yet run
  std::unique_ptr<Coordinator> coordinator_;                          // rank 0 only
  ResponseCache replica_{0};                                          // other ranks: what rank 0's responses said
  uint64_t responses_applied_ = 0;                                    // kRespond messages run (other ranks)
  std::deque<ResponseMessage> waiting_responses_;                     // other ranks: until their after_cycle
  std::unique_ptr<HitAgreement> hits_;                                // null with SMDDP_HIT_EXCHANGE=0
  std::unordered_map<uint32_t, std::shared_ptr<Entry>> hit_entries_;  // queued for hit cycles, by id
  std::vector<uint32_t> unlisted_hits_;                               // not yet in a kHits
  std::vector<char> fusion_buffer_;
  std::map<int, std::deque<std::shared_ptr<Entry>>> p2p_sends_, p2p_recvs_;
  // Receive side, per peer: the message being read (header, then payload into a posted
  // receive with its tag, or into a buffer when none is posted yet), and messages that
  // arrived before a receive for their tag was posted, in arrival order.
  struct IncomingMessage {
    int64_t header[2] = {0, 0};  // tag, bytes
    size_t header_done = 0;
    std::shared_ptr<Entry> target;  // null: buffered as unexpected
    std::vector<char> buffer;
    size_t payload_done = 0;
  };
  std::map<int, IncomingMessage> p2p_incoming_;
  std::map<int, std::deque<std::pair<int64_t, std::vector<char>>>> p2p_unexpected_;
  int64_t last_p2p_progress_us_ = 0;
  // Whether the peers of pending point-to-point transfers are alive (kPing/kPong, messages.h).
  struct PeerLiveness {
    int64_t last_heard_us = 0;        // its last control message or received bytes
    int64_t last_ping_us = 0;         // when this rank last pinged it
    int64_t unanswered_since_us = 0;  // the first ping it has not answered; 0: none
  };
  std::vector<PeerLiveness> liveness_;
  void heard_from(int peer, int64_t now);
  // Pings the peers this rank waits on that have been silent; raises PeerError naming one
  // that has answered nothing for the stall timeout.
  void check_p2p_peers_alive(int64_t now);
  // The error for a peer whose pings have gone unanswered longer than `seconds`, or "".
  std::string unresponsive(int peer, int64_t now, double seconds);

  std::vector<bool> rank_gone_;                 // ranks that said goodbye
  int64_t last_heartbeat_sent_us_ = 0;          // rank 0
  int64_t last_heard_from_coordinator_us_ = 0;  // other ranks: any message from rank 0
  // Other ranks: raises PeerError naming rank 0 when operations wait on negotiation and rank
  // 0 has been silent (no response, no heartbeat) for the stall timeout.
  void check_coordinator_alive();
  // Other ranks, after rank 0's goodbye: fails what can no longer run, once everything rank 0
  // decided before it left has run.
  void finish_after_rank0_left();
  bool rank0_left_handled_ = false;
  // Any rank: raises PeerError naming the ranks a hit cycle waits on when they have sent
  // nothing for the stall timeout, or closed their connection without a goodbye.
  void check_hit_cycle_alive();
  void expire_p2p();  // after SMDDP_TIMEOUT without point-to-point progress
};

}  // namespace smddp
