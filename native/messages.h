// The wire protocol between ranks: what they send each other, byte by byte. The code that
// writes and reads these messages is messages.cc (negotiation) and comm.cc / store.cc
// (bootstrap); the coordinator's rules are coordinator.h, the cache's response_cache.h.
//
// ## Encoding
// Little-endian, packed, no padding (wire.h). u8/u32/i32/u64/f64 are fixed-size integers and
// doubles; `string` is u32 length + bytes; `i64s` is u32 count + count x i64.
//
// ## Bootstrap (comm.cc, store.cc)
// - Rendezvous store (served by rank 0, or a framework's store): every frame on its TCP
//   connection is u64 length + payload. The client's first frame is the job secret
//   (SMDDP_SECRET; at most 4 KiB, within 2 s, or the server closes it and counts a refusal);
//   the server answers "smddp-store-ok<generation>" or "smddp-store-refused". Then requests:
//   u8 1 (set) + string key + string value -> u8 1; u8 2 (get) + string key -> u8 found +
//   string value. At most 1 MiB per request.
// - Each rank's record, key "rank/<r>": five lines "host key\naddress\nport\npid\nprotocol\n".
//   Every rank reads every record and refuses to start if any record's protocol is not
//   kProtocolVersion, naming the rank and both versions.
// - Between hosts, the lower rank connects to the higher rank's bootstrap listener once per
//   channel kind and sends one frame: string secret + i32 rank + i32 channel kind (4 KiB and
//   2 s at most, as the store). Inside a host, channels are shared-memory rings.
//
// ## Channels
// Each pair of ranks has three channels (channel.h): data (collective payloads, raw bytes in
// the order both sides' algorithms agree on), control (the messages below, each framed as
// u64 length + body, at most 4 GiB), and point-to-point (each message is i64 tag + i64 bytes,
// then the bytes; engine_p2p.cc).
//
// ## Negotiation (control channels)
// The first byte of every control message is its MessageType. Two paths lead to the same
// total order of collectives on every rank: rank 0's responses, for collectives announced in
// full (or ragged ones by id), and hit cycles, for collectives every rank has cached.
// - kAnnounce (rank r -> rank 0): u64 responses_applied + u32 n + n x announcement, where an
//   announcement is u32 cache_id, then (only if cache_id == 0xffffffff) string name +
//   signature, then i64s per_rank. responses_applied counts the kRespond messages rank r has
//   applied when it wrote this one; rank 0 needs it to resolve ids it has evicted since.
//   A signature is u8 op + u8 dtype + u8 reduce op + i32 root + i64s shape + i64s splits +
//   f64 prescale + f64 postscale + u8 check_only + u32 caller (the submitting
//   thread's number, calling_threads.h; 0 when not checked). Announced by id are only allgathers and
//   alltoalls (per_rank travels with them); other cached collectives go through hit cycles.
// - kRespond (rank 0 -> every other rank, the same bytes to each): u64 after_cycle,
//   u32 h + h x u32 handed-over id, u32 e + e x u32 evicted id, then u32 n + n x response,
//   where a response is u8 is_error (+ string error if set), signature, u32 k + k x (string
//   name + u32 cache_id), u32 m + m x i64s per_rank. A rank applies it right after hit cycle
//   after_cycle and before the next (rank 0 never builds one while its own cycle is open),
//   in this order: hand-overs, then the responses in order and, inside one, in entry order
//   (a fused allreduce lists its tensors in buffer order), then the evictions. Rank 0 applies
//   its own responses as it sends them.
// - kHits (every rank -> every other rank): u64 cycle + u64 responses_applied + i64
//   fusion_bytes (rank 0's threshold; 0 from others) + u32 n + n x u32 id: the cached
//   collectives this rank has queued since its previous kHits. This is Horovod's bit-vector
//   AND without a round trip through rank 0: cycle c completes on a rank once it holds every
//   rank's kHits for c (or that rank's goodbye), and every rank then computes the same result
//   from the same messages (hit_agreement.h): an id every rank has listed runs, all such ids
//   of the cycle in the order rank 0 listed them, allreduces fused by rank 0's threshold.
//   A rank sends kHits for c+1 only after completing c, when it has new hits or has received
//   someone's kHits for c+1 (so idle ranks exchange nothing). Ids mean what the cache said
//   when cycle c-1 completed; a listed id that is no longer live is dropped, and its owner
//   announces that collective in full instead.
//   Hand-over: an id listed but not yet run moves to the coordinator when its name is also
//   announced in full (ranks disagree on its signature), when it has waited 1 s, or when a
//   rank has left; rank 0 names it in a kRespond, every rank drops its listings there and
//   rank 0 turns them (and later listings of it) into announcements, until a response for
//   that name is applied. Mismatches, stalls and ranks that left are then reported as for
//   any other announcement.
// - kHeartbeat (rank 0 -> others, every kHeartbeatUs while idle or busy): no body. A rank
//   whose operations wait on negotiation and that hears nothing from rank 0 (no response, no
//   heartbeat) for the timeout raises, naming rank 0. A rank whose hit cycle waits on ranks
//   that send nothing for the timeout raises, naming them.
// - kPing / kPong (any rank <-> any rank): no body. A rank that waits on a point-to-point
//   transfer with a peer and has heard nothing from it (no control message, no received
//   bytes) for kHeartbeatUs pings it, once per kHeartbeatUs; the peer's engine thread answers
//   kPong whatever its frontend is doing. A peer that answers nothing for the timeout is
//   stopped, hung or cut off, and the waiting rank raises naming it; a peer that answers is
//   alive, and a transfer it does not post fails alone ("made no progress").
// - kGoodbye (every rank -> every other rank, at an orderly shutdown): no body. Rank 0 fails
//   whatever the leaving rank never announced ("shut down without submitting"); other ranks
//   fail everything after rank 0's goodbye; hit cycles stop waiting for a rank that left.
// - kAbort (any rank -> every rank; rank 0 relays it): string cause. The rank that sees a
//   failure first sends it, so every rank raises the root cause ("rank 3 died during
//   allreduce (detected by rank 2)") rather than a closed connection. Ranks on one host also
//   see an abort in their shared segment (shm_segment.h).
//
// ## Names and the cache
// - A name identifies one collective among those in flight on a rank: submitting a name
//   that is still in flight is refused at submission. Ranks match announcements by name, in
//   any order, and then must agree on the signature (else every rank gets the same error,
//   naming the field and each rank's value). allgather and alltoall may differ in their
//   first dimension; per_rank carries each rank's part, checked against every receiver.
// - Check-only entries (signature.check_only) are negotiated, cached and answered like any
//   other but never fused or run: the CUDA path checks arguments this way while NCCL moves
//   the data.
// - cache ids: rank 0 assigns them in kRespond entries (cache_id of an agreed entry); other
//   ranks learn them from there and use them next time (kHits, or kAnnounce by id).
//   When the cache is full (SMDDP_CACHE_CAPACITY), rank 0 evicts the least recently used
//   entry and lists its id in the message's evicted ids, which a rank applies after learning
//   the message's entries (an entry's id may be evicted later in the same message). An
//   evicted id is not reused until every rank's responses_applied shows it has seen the
//   eviction and the hit cycle after it has completed (response_cache.h).
//
// Raise kProtocolVersion whenever any of this changes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace smddp {

// Everything all ranks must agree on for one named collective.
struct Signature {
  OpType op = OpType::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  int32_t root = 0;
  // Compared in full, except for allgather and alltoall, whose first dimension may differ.
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // reduce_scatter: elements per rank (must agree)
  double prescale = 1.0, postscale = 1.0;
  // Negotiated but not run: the CUDA path checks that every rank calls the same collective
  // with the same arguments this way, while NCCL moves the data (never fused, never cached).
  bool check_only = false;
  // Which of the engine's calling threads submitted it (calling_threads.h), for collectives
  // matched by order (no user-given name); 0 for named ones, or with SMDDP_CHECK_CALLING_THREAD=0.
  uint32_t caller = 0;

  bool operator==(const Signature& o) const;
  bool operator!=(const Signature& o) const { return !(*this == o); }
  // The first field that differs, or "" if the two agree (allgather/alltoall ignore dim 0).
  std::string first_difference(const Signature& o) const;
  std::string field_text(const std::string& field) const;
  void write(class Writer& w) const;
  static Signature read(class Reader& r);
};

// One rank's announcement of one tensor.
struct Announcement {
  std::string name;  // empty when cache_id is used
  uint32_t cache_id = kNoCacheId;
  Signature sig;                  // valid when not cached
  std::vector<int64_t> per_rank;  // allgather: [first dim]; alltoall: rows sent to each rank
  static constexpr uint32_t kNoCacheId = 0xffffffffu;
};

// The version of everything above. Checked at bootstrap.
constexpr int kProtocolVersion = 5;

// kHeartbeat: rank 0 says it is alive (every kHeartbeatUs), so a rank that waits on it can
// tell a coordinator that is merely busy from one that is stopped or cut off.
enum class MessageType : uint8_t {
  kAnnounce = 1,
  kRespond = 2,
  kGoodbye = 3,
  kAbort = 4,
  kHeartbeat = 5,
  kHits = 6,
  kPing = 7,
  kPong = 8
};
constexpr int64_t kHeartbeatUs = 250000;

struct ResponseEntry {
  std::string name;
  uint32_t cache_id = Announcement::kNoCacheId;  // id assigned for future announcements
};

struct Response {
  bool is_error = false;
  std::string error;
  Signature sig;
  std::vector<ResponseEntry> entries;          // fused group in buffer order
  std::vector<std::vector<int64_t>> per_rank;  // for single-tensor allgather/alltoall
};

// One kAnnounce message.
struct AnnouncementMessage {
  uint64_t responses_applied = 0;
  std::vector<Announcement> announcements;
};

// One kRespond message.
struct ResponseMessage {
  uint64_t after_cycle = 0;           // applied after this hit cycle, before the next
  std::vector<uint32_t> handed_over;  // listed hits the coordinator takes over from now on
  // Cache ids no longer valid once this message is applied; a rank forgets them after it has
  // learned the ids of the message's entries (rank 0 may evict, later in one message, an
  // id it gave an earlier entry of it).
  std::vector<uint32_t> evicted;
  std::vector<Response> responses;
};

// One kHits message: the cached collectives a rank lists in one hit cycle.
struct HitsMessage {
  uint64_t cycle = 0;
  uint64_t responses_applied = 0;
  int64_t fusion_bytes = 0;  // rank 0's fusion threshold (0 from other ranks)
  std::vector<uint32_t> ids;
};

// Whole messages, type byte included (the decoders expect it already read).
std::string encode_announcements(const AnnouncementMessage& m);
AnnouncementMessage decode_announcements(class Reader& r);
std::string encode_responses(const ResponseMessage& m);
ResponseMessage decode_responses(class Reader& r);
std::string encode_hits(const HitsMessage& m);
HitsMessage decode_hits(class Reader& r);

}  // namespace smddp
