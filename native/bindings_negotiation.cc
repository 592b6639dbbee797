// Python binding of the negotiation units (smdistributed._core.negotiation): the coordinator,
// the response cache and the message codecs, driven in process by tests/test_coordinator.py
// with no sockets and no engine thread. Frontends never use it.
#include <pybind11/pybind11.h>
#include <algorithm>
#include <pybind11/stl.h>

#include "coordinator.h"
#include "hit_agreement.h"
#include "response_cache.h"
#include "wire.h"

namespace py = pybind11;
using namespace smddp;

namespace {

Signature make_signature(OpType op, DType dtype, std::vector<int64_t> shape, ReduceOp reduce_op, int root,
                         std::vector<int64_t> splits, double prescale, double postscale, bool check_only) {
  Signature s;
  s.op = op;
  s.dtype = dtype;
  s.shape = std::move(shape);
  s.reduce_op = reduce_op;
  s.root = root;
  s.splits = std::move(splits);
  s.prescale = prescale;
  s.postscale = postscale;
  s.check_only = check_only;
  return s;
}

// Decoders take the message without its type byte, as the engine's readers do.
Reader body_of(const py::bytes& message, MessageType expected) {
  std::string s = message;
  if (s.empty() || uint8_t(s[0]) != uint8_t(expected)) throw Error("not a message of the expected type");
  return Reader(s.substr(1));
}

}  // namespace

void bind_negotiation(py::module_& m) {
  py::class_<Signature>(m, "Signature")
      .def(py::init(&make_signature), py::arg("op"), py::arg("dtype"), py::arg("shape"),
           py::arg("reduce_op") = ReduceOp::kSum, py::arg("root") = 0, py::arg("splits") = std::vector<int64_t>{},
           py::arg("prescale") = 1.0, py::arg("postscale") = 1.0, py::arg("check_only") = false)
      .def_readonly("op", &Signature::op)
      .def_readonly("dtype", &Signature::dtype)
      .def_readonly("shape", &Signature::shape)
      .def("__eq__", &Signature::operator==);

  py::class_<Announcement>(m, "Announcement")
      .def(py::init([](const std::string& name, const Signature& sig, std::vector<int64_t> per_rank) {
             Announcement a;
             a.name = name;
             a.sig = sig;
             a.per_rank = std::move(per_rank);
             return a;
           }),
           py::arg("name"), py::arg("sig"), py::arg("per_rank") = std::vector<int64_t>{})
      .def_static(
          "by_id",
          [](uint32_t id, std::vector<int64_t> per_rank) {
            Announcement a;
            a.cache_id = id;
            a.per_rank = std::move(per_rank);
            return a;
          },
          py::arg("cache_id"), py::arg("per_rank") = std::vector<int64_t>{})
      .def_readonly("name", &Announcement::name)
      .def_readonly("cache_id", &Announcement::cache_id)
      .def_readonly("per_rank", &Announcement::per_rank);

  py::class_<Response>(m, "Response")
      .def_readonly("is_error", &Response::is_error)
      .def_readonly("error", &Response::error)
      .def_readonly("sig", &Response::sig)
      .def_readonly("per_rank", &Response::per_rank)
      .def_property_readonly("names",
                             [](const Response& r) {
                               std::vector<std::string> v;
                               for (const auto& e : r.entries) v.push_back(e.name);
                               return v;
                             })
      .def_property_readonly("cache_ids", [](const Response& r) {
        std::vector<uint32_t> v;
        for (const auto& e : r.entries) v.push_back(e.cache_id);
        return v;
      });

  py::class_<ResponseMessage>(m, "ResponseMessage")
      .def(py::init([](uint64_t after_cycle, std::vector<uint32_t> handed_over, std::vector<uint32_t> evicted) {
             ResponseMessage r;
             r.after_cycle = after_cycle;
             r.handed_over = std::move(handed_over);
             r.evicted = std::move(evicted);
             return r;
           }),
           py::arg("after_cycle") = 0, py::arg("handed_over") = std::vector<uint32_t>{},
           py::arg("evicted") = std::vector<uint32_t>{})
      .def_readonly("after_cycle", &ResponseMessage::after_cycle)
      .def_readonly("handed_over", &ResponseMessage::handed_over)
      .def_readonly("evicted", &ResponseMessage::evicted)
      .def_readonly("responses", &ResponseMessage::responses);

  m.attr("NO_CACHE_ID") = ResponseCache::kNone;
  m.attr("PROTOCOL_VERSION") = kProtocolVersion;

  m.def("encode_announcements", [](uint64_t applied, const std::vector<Announcement>& list) {
    AnnouncementMessage msg{applied, list};
    return py::bytes(encode_announcements(msg));
  });
  m.def("decode_announcements", [](const py::bytes& message) {
    Reader r = body_of(message, MessageType::kAnnounce);
    AnnouncementMessage msg = decode_announcements(r);
    return py::make_tuple(msg.responses_applied, msg.announcements);
  });
  m.def("encode_responses", [](const ResponseMessage& msg) { return py::bytes(encode_responses(msg)); });
  m.def("decode_responses", [](const py::bytes& message) {
    Reader r = body_of(message, MessageType::kRespond);
    return decode_responses(r);
  });

  py::class_<ResponseCache>(m, "ResponseCache")
      .def(py::init<size_t>(), py::arg("capacity"))
      .def("find", &ResponseCache::find)
      .def("resolve",
           [](const ResponseCache& c, uint32_t id, int from) {
             const auto& item = c.resolve(id, from);
             return py::make_tuple(item.name, item.sig);
           })
      .def(
          "use",
          [](ResponseCache& c, const std::string& name, const Signature& sig, uint64_t seq, uint64_t cycle) {
            std::vector<uint32_t> evicted;
            uint32_t id = c.use(name, sig, seq, cycle, &evicted);
            return py::make_tuple(id, evicted);
          },
          py::arg("name"), py::arg("sig"), py::arg("seq"), py::arg("cycle") = 0)
      .def("acknowledged", &ResponseCache::acknowledged, py::arg("seq"), py::arg("cycles") = UINT64_MAX)
      .def("live_item",
           [](const ResponseCache& c, uint32_t id) -> py::object {
             const auto* item = c.live_item(id);
             if (!item) return py::none();
             return py::make_tuple(item->name, item->sig);
           })
      .def("touch", &ResponseCache::touch)
      .def("learn", &ResponseCache::learn)
      .def("forget", &ResponseCache::forget)
      .def_property_readonly("size", &ResponseCache::size)
      .def_property_readonly("capacity", &ResponseCache::capacity)
      .def_property_readonly("retired", &ResponseCache::retired)
      .def_property_readonly("evictions", &ResponseCache::evictions)
      .def_property_readonly("ids_made", &ResponseCache::ids_made);

  py::class_<Coordinator>(m, "Coordinator")
      .def(py::init<int, size_t, double, double, bool>(), py::arg("world_size"), py::arg("cache_capacity"),
           py::arg("stall_timeout"), py::arg("stall_warning") = 1e9, py::arg("hit_cycles") = false)
      .def("acknowledge", &Coordinator::acknowledge)
      .def("cycle_completed", &Coordinator::cycle_completed)
      .def("has_tally", &Coordinator::has_tally)
      .def("receive", &Coordinator::receive, py::arg("rank"), py::arg("announcements"), py::arg("applied"),
           py::arg("now_us"))
      .def("rank_left", &Coordinator::rank_left)
      .def("respond", &Coordinator::respond, py::arg("fusion_bytes"), py::arg("now_us"),
           py::arg("handed_over") = std::vector<uint32_t>{})
      .def_property_readonly(
          "cache", [](Coordinator& c) -> ResponseCache& { return c.cache(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly("messages_built", &Coordinator::messages_built)
      .def_property_readonly("waiting", &Coordinator::waiting);

  py::class_<HitsMessage>(m, "HitsMessage")
      .def(py::init([](uint64_t cycle, std::vector<uint32_t> ids, uint64_t applied, int64_t fusion_bytes) {
             return HitsMessage{cycle, applied, fusion_bytes, std::move(ids)};
           }),
           py::arg("cycle"), py::arg("ids"), py::arg("responses_applied") = 0, py::arg("fusion_bytes") = 0)
      .def_readonly("cycle", &HitsMessage::cycle)
      .def_readonly("responses_applied", &HitsMessage::responses_applied)
      .def_readonly("fusion_bytes", &HitsMessage::fusion_bytes)
      .def_readonly("ids", &HitsMessage::ids);
  m.def("encode_hits", [](const HitsMessage& msg) { return py::bytes(encode_hits(msg)); });
  m.def("decode_hits", [](const py::bytes& message) {
    Reader r = body_of(message, MessageType::kHits);
    return decode_hits(r);
  });

  // One rank's view of hit cycles. complete() returns None while the cycle waits, else a
  // dict of what the cycle decided (hit_agreement.h).
  py::class_<HitAgreement>(m, "HitAgreement")
      .def(py::init<int, int>(), py::arg("world_size"), py::arg("rank"))
      .def_property_readonly("completed", &HitAgreement::completed)
      .def_property_readonly("open", &HitAgreement::open)
      .def_property_readonly("listed", &HitAgreement::listed)
      .def("should_begin", &HitAgreement::should_begin)
      .def("begin", &HitAgreement::begin, py::arg("ids"), py::arg("responses_applied") = 0, py::arg("fusion_bytes") = 0,
           py::arg("now_us") = 0)
      .def("receive", &HitAgreement::receive)
      .def("receive_goodbye", &HitAgreement::receive_goodbye)
      .def("missing", &HitAgreement::missing)
      .def(
          "complete",
          [](HitAgreement& h, const ResponseCache& cache, int64_t now_us) -> py::object {
            HitAgreement::Outcome out;
            if (!h.complete(cache, now_us, &out)) return py::none();
            py::dict d;
            d["responses"] = out.responses;
            d["ran"] = out.ran;
            d["dropped"] = out.dropped;
            py::list fwd;
            for (const auto& l : out.forwarded) fwd.append(py::make_tuple(l.rank, l.id));
            d["forwarded"] = fwd;
            d["acks"] = out.acks;
            return d;
          },
          py::arg("cache"), py::arg("now_us") = 0)
      .def("hand_over",
           [](HitAgreement& h, const std::vector<uint32_t>& ids) {
             py::list taken;
             for (const auto& l : h.hand_over(ids)) taken.append(py::make_tuple(l.rank, l.id));
             return taken;
           })
      .def("settled", &HitAgreement::settled, py::arg("name"), py::arg("seq"), py::arg("failed") = false)
      .def("evicted", &HitAgreement::evicted)
      .def(
          "due_for_hand_over",
          [](const HitAgreement& h, int64_t now_us, int64_t max_wait_us, const std::vector<std::string>& contested) {
            return h.due_for_hand_over(now_us, max_wait_us, [&](const std::string& name) {
              return std::find(contested.begin(), contested.end(), name) != contested.end();
            });
          },
          py::arg("now_us"), py::arg("max_wait_us"), py::arg("contested") = std::vector<std::string>{});
}
