// The Python face of the smddp c10d Backend: a torch.distributed Backend subclass that
// register_backend's creator returns, so torch attaches it to the ProcessGroup per device.
#include "backend.h"

namespace smddp_torch {

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smddp as a torch c10d Backend (built against the installed torch on first import)";
  m.def("load_core", &load_core, "Reads the core's C interface from smdistributed._core._c_api.");
  m.attr("C_API_VERSION") = SMDDP_C_API_VERSION;
  m.def("stop_all_at_exit", &EngineLink::stop_all_at_exit,
        "Ends every completion thread (registered with atexit by native_backend.py).");

  // torch.distributed.Backend is the Python name registry; the C++ class is bound here.
  auto backend_type = py::module_::import("torch._C._distributed_c10d").attr("Backend");
  py::class_<OptionsSMDDP, c10::intrusive_ptr<OptionsSMDDP>>(m, "Options", backend_type.attr("Options"))
      .def(py::init([](int64_t timeout_ms) {
             return c10::make_intrusive<OptionsSMDDP>(std::chrono::milliseconds(timeout_ms));
           }),
           py::arg("timeout_ms"))
      .def("__deepcopy__", [](const OptionsSMDDP& o, py::dict) { return c10::make_intrusive<OptionsSMDDP>(o); })
      .def("__copy__", [](const OptionsSMDDP& o) { return c10::make_intrusive<OptionsSMDDP>(o); });
  // torch's own bindings use a holder that releases the GIL when the last reference goes.
  py::class_<BackendSMDDP, c10::intrusive_ptr<BackendSMDDP>>(m, "BackendSMDDP", backend_type)
      .def(py::init([](py::object impl, int rank, int size, int64_t timeout_ms) {
             return c10::make_intrusive<BackendSMDDP>(std::move(impl), rank, size,
                                                      std::chrono::milliseconds(timeout_ms));
           }),
           py::arg("impl"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"))
      .def_property_readonly("options", &BackendSMDDP::getBackendOptions)
      .def_property_readonly("impl", &BackendSMDDP::impl, "The group's Python implementation (ProcessGroupSMDDP).")
      .def("engine_counters", &BackendSMDDP::engine_counters,
           "[submitted, cache hits, cache misses] of the group's CPU engine (zeros before first use).")
      // torch calls this on the default group's split source for ranks outside a new group;
      // our groups are made from the store, so there is nothing to take part in.
      .def("perform_nocolor_split", [](BackendSMDDP&, py::object) {});
}

}  // namespace smddp_torch
