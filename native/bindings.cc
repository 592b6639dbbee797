// Python binding of the core: one typed entry point per operation kind, pointers as
// integers (frontends pass numpy/torch/TF data pointers; no framework inside), and every
// blocking call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "c_api.h"
#include "config.h"
#include "engine.h"
#include "reduce_kernels.h"

namespace py = pybind11;
using namespace smddp;

namespace {

const void* as_ptr(uintptr_t p) { return reinterpret_cast<const void*>(p); }

// A Python object with set(key: str, value: bytes) and get(key: str) -> bytes (a
// torch.distributed Store, or anything shaped like one) as the bootstrap rendezvous.
class PyRendezvous : public Rendezvous {
 public:
  explicit PyRendezvous(py::object store) : store_(std::move(store)) {}
  ~PyRendezvous() override {
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }
  void set(const std::string& key, const std::string& value) override {
    py::gil_scoped_acquire gil;
    try {
      store_.attr("set")(key, py::bytes(value));
    } catch (const py::error_already_set& e) {
      throw PeerError("rendezvous set('" + key + "') failed: " + e.what());
    }
  }
  std::string get(const std::string& key, double timeout_s) override {
    py::gil_scoped_acquire gil;
    try {
      // The framework store's own get() would block for the store's timeout (torch's: the
      // group's, 30 minutes by default); wait() takes ours.
      if (timeout_s > 0 && py::hasattr(store_, "wait")) {
        py::object seconds = py::module_::import("datetime").attr("timedelta")(py::arg("seconds") = timeout_s);
        py::list keys;
        keys.append(key);
        try {
          store_.attr("wait")(keys, seconds);
        } catch (const py::error_already_set& e) {
          throw PeerError("timed out after " + std::to_string(int(timeout_s)) + " s waiting for rendezvous key '" +
                          key + "' (is every rank of the group up?): " + e.what());
        }
      }
      return store_.attr("get")(key).cast<std::string>();
    } catch (const py::error_already_set& e) {
      throw PeerError("rendezvous get('" + key + "') failed (is every rank of the group up?): " + e.what());
    }
  }

 private:
  py::object store_;
};

py::dict counters_dict(const Counters& c) {
  py::dict d;
  d["submitted"] = c.submitted.load();
  d["completed"] = c.completed.load();
  d["failed"] = c.failed.load();
  d["responses"] = c.responses.load();
  d["fused_responses"] = c.fused_responses.load();
  d["fused_tensors"] = c.fused_tensors.load();
  d["allreduce_bytes"] = c.allreduce_bytes.load();
  d["negotiation_round_trips"] = c.negotiation_round_trips.load();
  d["negotiation_bytes"] = c.negotiation_bytes.load();
  d["hit_cycles"] = c.hit_cycles.load();
  d["cache_hits"] = c.cache_hits.load();
  d["cache_misses"] = c.cache_misses.load();
  d["cache_evictions"] = c.cache_evictions.load();
  d["p2p_messages"] = c.p2p_messages.load();
  return d;
}

}  // namespace

void bind_gpu(py::module_& m);          // bindings_gpu.cc
void bind_negotiation(py::module_& m);  // bindings_negotiation.cc
namespace smddp {
const smddp_c_api* c_api();  // c_api.cc
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "smdistributed native collective engine (framework-neutral)";
  py::register_exception<Error>(m, "SmddpError", PyExc_RuntimeError);

  py::enum_<DType>(m, "DType")
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("int8", DType::kInt8)
      .value("uint8", DType::kUInt8)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("bool", DType::kBool);
  py::enum_<ReduceOp>(m, "ReduceOp")
      .value("SUM", ReduceOp::kSum)
      .value("AVERAGE", ReduceOp::kAverage)
      .value("MIN", ReduceOp::kMin)
      .value("MAX", ReduceOp::kMax)
      .value("PRODUCT", ReduceOp::kProduct);
  py::enum_<OpType>(m, "OpType")
      .value("ALLREDUCE", OpType::kAllreduce)
      .value("BROADCAST", OpType::kBroadcast)
      .value("REDUCE", OpType::kReduce)
      .value("ALLGATHER", OpType::kAllgather)
      .value("REDUCE_SCATTER", OpType::kReduceScatter)
      .value("ALLTOALL", OpType::kAlltoall)
      .value("BARRIER", OpType::kBarrier);

  bind_gpu(m);
  py::module_ negotiation =
      m.def_submodule("negotiation", "The coordinator and the response cache, for in-process tests.");
  bind_negotiation(negotiation);
  // Native frontends (the torch c10d Backend) call the engine through this table, without
  // Python in between; see c_api.h.
  m.attr("_c_api") = py::capsule(static_cast<const void*>(c_api()), SMDDP_C_API_CAPSULE);
  m.attr("C_API_VERSION") = SMDDP_C_API_VERSION;
  m.def("dtype_size", &dtype_size);
  m.def(
      "config_table",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string>> rows;
        for (const auto& v : config_table()) rows.emplace_back(v.name, v.default_value, v.meaning);
        return rows;
      },
      "The configuration variables: (name, default, meaning) tuples.");

  // Local reduction kernel, exposed so benchmarks can measure the memory-bound floor.
  m.def("reduce_into", [](uintptr_t dst, uintptr_t src, size_t count, DType dtype, ReduceOp op) {
    py::gil_scoped_release nogil;
    reduce_into(reinterpret_cast<void*>(dst), as_ptr(src), count, dtype, op);
  });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](int rank, int size, int local_rank, int local_size, const std::string& host,
                       const std::string& store_addr, int store_port, const std::string& secret, py::object rendezvous,
                       const std::string& advertise_addr, double stall_timeout) {
             WorldSpec s;
             s.rank = rank;
             s.size = size;
             s.local_rank = local_rank;
             s.local_size = local_size;
             s.host = host;
             s.store_addr = store_addr;
             s.store_port = store_port;
             s.secret = secret;
             if (!rendezvous.is_none()) s.rendezvous = std::make_shared<PyRendezvous>(rendezvous);
             s.advertise_addr = advertise_addr;
             s.stall_timeout_s = stall_timeout;
             py::gil_scoped_release nogil;
             return new Engine(s);
           }),
           py::arg("rank"), py::arg("size"), py::arg("local_rank"), py::arg("local_size"), py::arg("host"),
           py::arg("store_addr"), py::arg("store_port"), py::arg("secret"), py::arg("rendezvous") = py::none(),
           py::arg("advertise_addr") = "", py::arg("stall_timeout") = -1.0)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("local_rank", &Engine::local_rank)
      .def_property_readonly("local_size", &Engine::local_size)
      .def_property_readonly("num_hosts", &Engine::num_hosts)
      .def_property_readonly("host_index", &Engine::host_index)
      .def(
          "_address", [](Engine& e) { return reinterpret_cast<uintptr_t>(&e); },
          "The engine's address, for native frontends that call it through _c_api.")
      .def(
          "submit",
          [](Engine& e, OpType op, const std::string& name, uintptr_t in, uintptr_t out, size_t count,
             size_t out_capacity, DType dtype, std::vector<int64_t> shape, ReduceOp reduce_op, int root,
             std::vector<int64_t> splits, std::vector<int64_t> per_rank, double prescale, double postscale,
             bool check_only, bool by_order) {
            Signature sig;
            sig.op = op;
            sig.dtype = dtype;
            sig.reduce_op = reduce_op;
            sig.root = root;
            sig.shape = std::move(shape);
            sig.splits = std::move(splits);
            sig.prescale = prescale;
            sig.postscale = postscale;
            sig.check_only = check_only;
            if (by_order) sig.caller = e.calling_thread();  // calling_threads.h
            return e.submit(name, sig, as_ptr(in), reinterpret_cast<void*>(out), count, out_capacity, per_rank);
          },
          py::arg("op"), py::arg("name"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"),
          py::arg("out_capacity"), py::arg("dtype"), py::arg("shape"), py::arg("reduce_op") = ReduceOp::kSum,
          py::arg("root") = 0, py::arg("splits") = std::vector<int64_t>{}, py::arg("per_rank") = std::vector<int64_t>{},
          py::arg("prescale") = 1.0, py::arg("postscale") = 1.0, py::arg("check_only") = false,
          py::arg("by_order") = false)
      .def(
          "send",
          [](Engine& e, int peer, int64_t tag, uintptr_t ptr, size_t bytes) {
            return e.submit_p2p(true, peer, tag, reinterpret_cast<void*>(ptr), bytes);
          },
          py::arg("peer"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"))
      .def(
          "recv",
          [](Engine& e, int peer, int64_t tag, uintptr_t ptr, size_t bytes) {
            return e.submit_p2p(false, peer, tag, reinterpret_cast<void*>(ptr), bytes);
          },
          py::arg("peer"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"))
      .def("wait", &Engine::wait, py::arg("handle"), py::arg("timeout") = -1.0, py::arg("keep") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("poll", &Engine::poll, py::arg("handle"))
      .def("wait_done", &Engine::wait_done, py::arg("handle"), py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("result_counts", &Engine::result_counts)
      .def("owned_output_bytes", &Engine::owned_output_bytes)
      .def("copy_owned_output",
           [](Engine& e, uint64_t h, uintptr_t dst) { e.copy_owned_output(h, reinterpret_cast<void*>(dst)); })
      .def("release", &Engine::release)
      .def("watch", &Engine::watch, py::arg("handle"), py::arg("channel") = 0)
      .def("begin_batch", &Engine::begin_batch)
      .def("end_batch", &Engine::end_batch)
      .def_property("fusion_threshold", &Engine::fusion_threshold, &Engine::set_fusion_threshold)
      .def("next_completions", &Engine::next_completions, py::arg("timeout"), py::arg("channel") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("counters", [](Engine& e) { return counters_dict(e.counters()); })
      .def("abort_message", &Engine::abort_message)
      .def("store_refused_connections", &Engine::store_refused_connections)
      .def("bootstrap_refused_connections", &Engine::bootstrap_refused_connections)
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>());
}
