// Python binding of the negotiation units (smdistributed._core.negotiation): the coordinator,
// the response cache and the message codecs, driven in process by tests/test_coordinator.py
// with no sockets and no engine thread. Frontends never use it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "coordinator.h"
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
      .def("use",
           [](ResponseCache& c, const std::string& name, const Signature& sig, uint64_t seq) {
             std::vector<uint32_t> evicted;
             uint32_t id = c.use(name, sig, seq, &evicted);
             return py::make_tuple(id, evicted);
           })
      .def("acknowledged", &ResponseCache::acknowledged)
      .def("learn", &ResponseCache::learn)
      .def("forget", &ResponseCache::forget)
      .def_property_readonly("size", &ResponseCache::size)
      .def_property_readonly("capacity", &ResponseCache::capacity)
      .def_property_readonly("retired", &ResponseCache::retired)
      .def_property_readonly("evictions", &ResponseCache::evictions)
      .def_property_readonly("ids_made", &ResponseCache::ids_made);

  py::class_<Coordinator>(m, "Coordinator")
      .def(py::init<int, size_t, double, double>(), py::arg("world_size"), py::arg("cache_capacity"),
           py::arg("stall_timeout"), py::arg("stall_warning") = 1e9)
      .def("receive", &Coordinator::receive, py::arg("rank"), py::arg("announcements"), py::arg("applied"),
           py::arg("now_us"))
      .def("rank_left", &Coordinator::rank_left)
      .def("respond", &Coordinator::respond, py::arg("fusion_bytes"), py::arg("now_us"))
      .def_property_readonly(
          "cache", [](Coordinator& c) -> ResponseCache& { return c.cache(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly("messages_built", &Coordinator::messages_built)
      .def_property_readonly("waiting", &Coordinator::waiting);
}
