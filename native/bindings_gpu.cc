// Python binding of the NCCL data plane (nccl_group.h). Pointers and streams travel as
// integers; every call that may wait on NCCL or the GPU releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "nccl_group.h"

namespace py = pybind11;
using namespace smddp;

void bind_gpu(py::module_& m) {
  m.def("gpu_unavailable_reason", &gpu::unavailable_reason,
        "Why CUDA tensors cannot be used (the CUDA runtime or NCCL did not load), or '' when they can.",
        py::call_guard<py::gil_scoped_release>());
  m.def("nccl_unique_id", [] { return py::bytes(NcclGroup::make_unique_id()); });

  py::class_<GpuEvent, std::shared_ptr<GpuEvent>>(m, "GpuEvent")
      .def("block", &GpuEvent::block, py::arg("stream"), "Makes the stream wait for this event (no host wait).")
      .def("query", &GpuEvent::query)
      .def("synchronize", &GpuEvent::synchronize, py::call_guard<py::gil_scoped_release>());

  py::class_<NcclGroup>(m, "NcclGroup")
      .def(
          py::init([](py::bytes unique_id, int rank, int size, int device, int max_ctas, int min_ctas, double timeout) {
            NcclOptions o;
            if (max_ctas > 0) o.max_ctas = max_ctas;
            if (min_ctas > 0) o.min_ctas = min_ctas;
            if (timeout > 0) o.timeout_s = timeout;
            std::string id = unique_id;
            py::gil_scoped_release nogil;  // waits for every rank of the group
            return new NcclGroup(id, rank, size, device, o);
          }),
          py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("max_ctas") = 0,
          py::arg("min_ctas") = 0, py::arg("timeout") = -1.0)
      .def_property_readonly("rank", &NcclGroup::rank)
      .def_property_readonly("size", &NcclGroup::size)
      .def_property_readonly("device", &NcclGroup::device)
      .def_property_readonly("max_ctas", &NcclGroup::max_ctas)
      .def_property_readonly("stream", &NcclGroup::stream)
      .def(
          "_address", [](NcclGroup& g) { return reinterpret_cast<uintptr_t>(&g); },
          "The group's address, for native frontends that call it through _c_api.")
      .def_property_readonly("nccl_version", &NcclGroup::nccl_version)
      .def("wait_for", &NcclGroup::wait_for, py::arg("stream"))
      .def("allreduce", &NcclGroup::allreduce, py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &NcclGroup::broadcast, py::call_guard<py::gil_scoped_release>())
      .def("reduce", &NcclGroup::reduce, py::call_guard<py::gil_scoped_release>())
      .def("allgather", &NcclGroup::allgather, py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &NcclGroup::reduce_scatter, py::call_guard<py::gil_scoped_release>())
      .def("send", &NcclGroup::send, py::call_guard<py::gil_scoped_release>())
      .def("recv", &NcclGroup::recv, py::call_guard<py::gil_scoped_release>())
      .def("group_start", &NcclGroup::group_start)
      .def("group_end", &NcclGroup::group_end, py::call_guard<py::gil_scoped_release>())
      .def("record", &NcclGroup::record)
      .def("allreduce_after", &NcclGroup::allreduce_after, py::call_guard<py::gil_scoped_release>())
      .def(
          "attach_engine", [](NcclGroup& g, Engine& e) { g.attach_engine(&e); }, py::keep_alive<1, 2>())
      .def("check", [](NcclGroup& g, const std::string& kind, OpType op, DType dtype, const std::vector<int64_t>& shape,
                       ReduceOp reduce, int root) { g.check(kind.c_str(), op, dtype, shape, reduce, root); })
      .def_property_readonly("check_waits", &NcclGroup::check_waits,
                             "argument checks that waited for the previous check of their name")
      .def_property_readonly("check_wait_us", &NcclGroup::check_wait_us, "microseconds those waits took in all")
      .def_property_readonly("checks_deferred", &NcclGroup::checks_deferred,
                             "argument checks queued because their name was still in use (a rank ahead)")
      .def("error", &NcclGroup::error)
      .def("abort", &NcclGroup::abort, py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &NcclGroup::shutdown, py::call_guard<py::gil_scoped_release>());
}
