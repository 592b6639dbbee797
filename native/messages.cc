#include "messages.h"

#include <sstream>

#include "wire.h"

namespace smddp {

namespace {
bool ragged_first_dim(OpType op) { return op == OpType::kAllgather || op == OpType::kAlltoall; }
}  // namespace

std::string Signature::first_difference(const Signature& o) const {
  if (op != o.op) return "op";
  if (dtype != o.dtype) return "dtype";
  if ((op == OpType::kAllreduce || op == OpType::kReduce || op == OpType::kReduceScatter) &&
      reduce_op != o.reduce_op)
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
         splits == o.splits && prescale == o.prescale && postscale == o.postscale && check_only == o.check_only;
}

std::string Signature::field_text(const std::string& field) const {
  if (field == "op") return op_type_name(op);
  if (field == "dtype") return dtype_name(dtype);
  if (field == "reduce op") return reduce_op_name(reduce_op);
  if (field == "root") return std::to_string(root);
  if (field == "shape") return list_text(shape);
  if (field == "splits") return list_text(splits);
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
  return s;
}

std::string encode_announcements(const std::vector<Announcement>& list) {
  Writer w;
  w.put<uint8_t>(uint8_t(MessageType::kAnnounce));
  w.put<uint32_t>(uint32_t(list.size()));
  for (const auto& a : list) {
    w.put<uint32_t>(a.cache_id);
    if (a.cache_id == Announcement::kNoCacheId) {
      w.put_string(a.name);
      a.sig.write(w);
    }
    w.put_i64s(a.per_rank);
  }
  return w.take();
}

std::vector<Announcement> decode_announcements(Reader& r) {
  std::vector<Announcement> list(r.get<uint32_t>());
  for (auto& a : list) {
    a.cache_id = r.get<uint32_t>();
    if (a.cache_id == Announcement::kNoCacheId) {
      a.name = r.get_string();
      a.sig = Signature::read(r);
    }
    a.per_rank = r.get_i64s();
  }
  return list;
}

std::string encode_responses(const std::vector<Response>& rs) {
  Writer w;
  w.put<uint8_t>(uint8_t(MessageType::kRespond));
  w.put<uint32_t>(uint32_t(rs.size()));
  for (const auto& resp : rs) {
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

std::vector<Response> decode_responses(Reader& r) {
  std::vector<Response> rs(r.get<uint32_t>());
  for (auto& resp : rs) {
    resp.is_error = r.get<uint8_t>();
    if (resp.is_error) resp.error = r.get_string();
    resp.sig = Signature::read(r);
    resp.entries.resize(r.get<uint32_t>());
    for (auto& e : resp.entries) {
      e.name = r.get_string();
      e.cache_id = r.get<uint32_t>();
    }
    resp.per_rank.resize(r.get<uint32_t>());
    for (auto& v : resp.per_rank) v = r.get_i64s();
  }
  return rs;
}

}  // namespace smddp
