#include "messages.h"

#include <sstream>

#include "wire.h"

namespace smddp {

namespace {
bool ragged_first_dim(OpType op) { return op == OpType::kAllgather || op == OpType::kAlltoall; }

void put_ids(Writer& w, const std::vector<uint32_t>& ids) {
  w.put<uint32_t>(uint32_t(ids.size()));
  for (uint32_t id : ids) w.put<uint32_t>(id);
}

std::vector<uint32_t> get_ids(Reader& r) {
  std::vector<uint32_t> ids(r.get_count(sizeof(uint32_t)));
  for (auto& id : ids) id = r.get<uint32_t>();
  return ids;
}
}  // namespace

std::string Signature::first_difference(const Signature& o) const {
  // First: threads that raced explain every other difference they cause.
  if (caller != o.caller) return "calling thread";
  if (op != o.op) return "op";
  if (dtype != o.dtype) return "dtype";
  if ((op == OpType::kAllreduce || op == OpType::kReduce || op == OpType::kReduceScatter) && reduce_op != o.reduce_op)
    return "reduce op";
  if ((op == OpType::kBroadcast || op == OpType::kReduce) && root != o.root) return "root";
  if (ragged_first_dim(op)) {
    if (shape.size() != o.shape.size()) return "shape";
    for (size_t i = 1; i < shape.size(); ++i)
      if (shape[i] != o.shape[i]) return "shape";
  } else if (shape != o.shape) {
    return "shape";
  }
  if (splits != o.splits) return "splits";
  if (prescale != o.prescale || postscale != o.postscale) return "scale factors";
  return "";
}

bool Signature::operator==(const Signature& o) const {
  return op == o.op && dtype == o.dtype && reduce_op == o.reduce_op && root == o.root && shape == o.shape &&
         splits == o.splits && prescale == o.prescale && postscale == o.postscale && check_only == o.check_only &&
         caller == o.caller;
}

std::string Signature::field_text(const std::string& field) const {
  if (field == "op") return op_type_name(op);
  if (field == "dtype") return dtype_name(dtype);
  if (field == "reduce op") return reduce_op_name(reduce_op);
  if (field == "root") return std::to_string(root);
  if (field == "shape") return list_text(shape);
  if (field == "splits") return list_text(splits);
  if (field == "calling thread")
    return caller ? "thread " + std::to_string(caller) : std::string("no thread check (SMDDP_CHECK_CALLING_THREAD=0)");
  std::ostringstream o;
  o << prescale << "/" << postscale;
  return o.str();
}

void Signature::write(Writer& w) const {
  w.put<uint8_t>(uint8_t(op));
  w.put<uint8_t>(uint8_t(dtype));
  w.put<uint8_t>(uint8_t(reduce_op));
  w.put<int32_t>(root);
  w.put_i64s(shape);
  w.put_i64s(splits);
  w.put<double>(prescale);
  w.put<double>(postscale);
  w.put<uint8_t>(check_only ? 1 : 0);
  w.put<uint32_t>(caller);
}

Signature Signature::read(Reader& r) {
  Signature s;
  s.op = OpType(r.get<uint8_t>());
  s.dtype = DType(r.get<uint8_t>());
  s.reduce_op = ReduceOp(r.get<uint8_t>());
  s.root = r.get<int32_t>();
  s.shape = r.get_i64s();
  s.splits = r.get_i64s();
  s.prescale = r.get<double>();
  s.postscale = r.get<double>();
  s.check_only = r.get<uint8_t>() != 0;
  s.caller = r.get<uint32_t>();
  return s;
}

std::string encode_announcements(const AnnouncementMessage& m) {
  Writer w;
  w.put<uint8_t>(uint8_t(MessageType::kAnnounce));
  w.put<uint64_t>(m.responses_applied);
  w.put<uint32_t>(uint32_t(m.announcements.size()));
  for (const auto& a : m.announcements) {
    w.put<uint32_t>(a.cache_id);
    if (a.cache_id == Announcement::kNoCacheId) {
      w.put_string(a.name);
      a.sig.write(w);
    }
    w.put_i64s(a.per_rank);
  }
  return w.take();
}

AnnouncementMessage decode_announcements(Reader& r) {
  AnnouncementMessage m;
  m.responses_applied = r.get<uint64_t>();
  // The smallest announcement: a cache id and an empty per_rank list.
  m.announcements.resize(r.get_count(2 * sizeof(uint32_t)));
  for (auto& a : m.announcements) {
    a.cache_id = r.get<uint32_t>();
    if (a.cache_id == Announcement::kNoCacheId) {
      a.name = r.get_string();
      a.sig = Signature::read(r);
    }
    a.per_rank = r.get_i64s();
  }
  if (!r.done()) throw Error("malformed announcement message (trailing bytes)");
  return m;
}

std::string encode_responses(const ResponseMessage& m) {
  Writer w;
  w.put<uint8_t>(uint8_t(MessageType::kRespond));
  w.put<uint64_t>(m.after_cycle);
  put_ids(w, m.handed_over);
  put_ids(w, m.evicted);
  w.put<uint32_t>(uint32_t(m.responses.size()));
  for (const auto& resp : m.responses) {
    w.put<uint8_t>(resp.is_error);
    if (resp.is_error) w.put_string(resp.error);
    resp.sig.write(w);
    w.put<uint32_t>(uint32_t(resp.entries.size()));
    for (const auto& e : resp.entries) {
      w.put_string(e.name);
      w.put<uint32_t>(e.cache_id);
    }
    w.put<uint32_t>(uint32_t(resp.per_rank.size()));
    for (const auto& v : resp.per_rank) w.put_i64s(v);
  }
  return w.take();
}

ResponseMessage decode_responses(Reader& r) {
  ResponseMessage m;
  m.after_cycle = r.get<uint64_t>();
  m.handed_over = get_ids(r);
  m.evicted = get_ids(r);
  // The smallest response: is_error, a signature of empty lists, no entries, no per_rank.
  constexpr size_t kMinSignature = 3 + 4 + 4 + 4 + 8 + 8 + 1;
  m.responses.resize(r.get_count(1 + kMinSignature + 4 + 4));
  for (auto& resp : m.responses) {
    resp.is_error = r.get<uint8_t>();
    if (resp.is_error) resp.error = r.get_string();
    resp.sig = Signature::read(r);
    resp.entries.resize(r.get_count(sizeof(uint32_t) * 2));
    for (auto& e : resp.entries) {
      e.name = r.get_string();
      e.cache_id = r.get<uint32_t>();
    }
    resp.per_rank.resize(r.get_count(sizeof(uint32_t)));
    for (auto& v : resp.per_rank) v = r.get_i64s();
  }
  if (!r.done()) throw Error("malformed response message (trailing bytes)");
  return m;
}

std::string encode_hits(const HitsMessage& m) {
  Writer w;
  w.put<uint8_t>(uint8_t(MessageType::kHits));
  w.put<uint64_t>(m.cycle);
  w.put<uint64_t>(m.responses_applied);
  w.put<int64_t>(m.fusion_bytes);
  put_ids(w, m.ids);
  return w.take();
}

HitsMessage decode_hits(Reader& r) {
  HitsMessage m;
  m.cycle = r.get<uint64_t>();
  m.responses_applied = r.get<uint64_t>();
  m.fusion_bytes = r.get<int64_t>();
  m.ids = get_ids(r);
  if (!r.done()) throw Error("malformed hits message (trailing bytes)");
  return m;
}

}  // namespace smddp
