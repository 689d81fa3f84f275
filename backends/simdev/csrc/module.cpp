// The Python module crosstrain.backends.simdev._C: the runtime's functions and the staging c10d backend.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "collective.h"
#include "runtime.h"

namespace simdev {
void register_runtime();
}

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "simdev: a software PrivateUse1 device for testing (not hardware)";
  m.def("register_runtime", &simdev::register_runtime, "install the allocator and the PrivateUse1 hooks");
  m.def("device_count", [] { return int(simdev::device_count()); });
  m.def("current_device", [] { return int(simdev::current_device()); });
  m.def("set_device", [](int i) { simdev::set_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("memory_stats", [](int i) {
    auto s = simdev::memory_stats(static_cast<c10::DeviceIndex>(i));
    py::dict d;
    d["allocated_bytes"] = s.allocated;
    d["reserved_bytes"] = s.reserved;
    d["peak_allocated_bytes"] = s.peak_allocated;
    d["peak_reserved_bytes"] = s.peak_reserved;
    d["capacity_bytes"] = s.capacity;
    d["num_allocs"] = s.num_allocs;
    d["num_ooms"] = s.num_ooms;
    return d;
  });
  m.def("reset_peak_memory_stats", [](int i) { simdev::reset_peak_memory_stats(static_cast<c10::DeviceIndex>(i)); });
  m.def("empty_cache", &simdev::empty_cache);
  m.def("default_generator", [](int i) { return simdev::default_generator(static_cast<c10::DeviceIndex>(i)); });
  // the readable host address of a device address (for tests that prove the device address itself is not)
  m.def("host_address", [](uintptr_t p) {
    return reinterpret_cast<uintptr_t>(simdev::device_alias(reinterpret_cast<void*>(p)));
  });

  auto backend = py::module::import("torch._C._distributed_c10d").attr("Backend");
  py::class_<simdev::StagingBackend, c10::intrusive_ptr<simdev::StagingBackend>>(m, "StagingBackend", backend)
      .def(py::init<c10::intrusive_ptr<c10d::Backend>, int, int>(), py::arg("host"), py::arg("rank"),
           py::arg("size"));
}
