// Python bindings of the native CPU optimizer kernels. Buffers arrive as raw addresses (tensor.data_ptr())
// with an element count and dtype codes, so the extension never links against torch's C++ ABI. The
// instruction set is chosen once at import (AVX-512, AVX2 or generic) and can be forced for testing.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"

namespace py = pybind11;
using namespace crosstrain_native;

namespace {

const IsaTable* g_table = nullptr;
int64_t g_prefetch = 512;  // elements ahead (2 KiB of fp32): measured ~10-20 % faster than none here

bool cpu_has(const char* isa) {
#if defined(CROSSTRAIN_X86)
  __builtin_cpu_init();
  std::string s(isa);
  if (s == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (s == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  (void)isa;
#endif
  return std::string(isa) == "generic";
}

const IsaTable* table_for(const std::string& isa) {
  if (!cpu_has(isa.c_str())) return nullptr;
#if defined(CROSSTRAIN_X86)
  if (isa == "avx512") return &avx512_table();
  if (isa == "avx2") return &avx2_table();
#endif
  if (isa == "generic") return &generic_table();
  return nullptr;
}

std::string best_isa() {
  for (const char* isa : {"avx512", "avx2"})
    if (cpu_has(isa)) return isa;
  return "generic";
}

void set_isa(const std::string& isa) {
  std::string name = isa == "auto" ? best_isa() : isa;
  if (name != "avx512" && name != "avx2" && name != "generic")
    throw std::invalid_argument("unknown instruction set '" + isa + "'; use auto, avx512, avx2 or generic");
  const IsaTable* t = table_for(name);
  if (t == nullptr) throw std::invalid_argument("this CPU does not support the '" + name + "' instruction set");
  g_table = t;
}

std::string isa() { return g_table->name; }

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Split [0, n) into one contiguous block per thread (64-element aligned) and run fn on each.
template <class F>
void parallel_blocks(int64_t n, int threads, F&& fn) {
  constexpr int64_t kSerialBelow = 1 << 16;  // below ~256 KiB per array a fork/join costs more than it saves
  if (threads <= 0) threads = max_threads();
  if (n <= kSerialBelow || threads <= 1) {
    fn(0, n);
    return;
  }
  int64_t blocks = std::min<int64_t>(threads, (n + kSerialBelow - 1) / kSerialBelow);
  int64_t per = ((n + blocks - 1) / blocks + 63) / 64 * 64;
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(static_cast<int>(blocks))
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t begin = b * per, end = std::min(n, begin + per);
    if (begin < end) fn(begin, end);
  }
}

void check_code(int code, bool allow_none, const char* what) {
  if (code == kF32 || code == kBF16 || code == kF16 || (allow_none && code == kNone)) return;
  throw std::invalid_argument(std::string("unsupported dtype code for ") + what);
}

template <class T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void adamw_step(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
                std::uintptr_t exp_avg_sq, std::uintptr_t max_exp_avg_sq, std::uintptr_t out, int out_dtype,
                int64_t numel, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                bool maximize, double grad_scale, int threads) {
  check_code(grad_dtype, false, "grad");
  check_code(out_dtype, true, "out");
  if (numel < 0) throw std::invalid_argument("numel must be >= 0");
  if (step < 1) throw std::invalid_argument("step must be >= 1 (the step count after this update)");
  if (numel == 0) return;
  if (!param || !grad || !exp_avg || !exp_avg_sq || (out_dtype != kNone && !out))
    throw std::invalid_argument("null buffer address");
  AdamArgs a{};
  a.p = ptr<float>(param);
  a.g = ptr<const void>(grad);
  a.m = ptr<float>(exp_avg);
  a.v = ptr<float>(exp_avg_sq);
  a.vmax = ptr<float>(max_exp_avg_sq);
  a.out = ptr<void>(out);
  // Scalars as torch.optim.AdamW computes them: in double, then rounded to float by the element kernels.
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.omb1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.omb2 = static_cast<float>(1.0 - beta2);
  a.inv_bc2_sqrt = static_cast<float>(1.0 / std::pow(bc2, 0.5));
  a.neg_step_size = static_cast<float>(-(lr / bc1));
  a.eps = static_cast<float>(eps);
  a.grad_scale = static_cast<float>(grad_scale);
  a.scale_grad = grad_scale != 1.0;
  a.maximize = maximize;
  a.prefetch = g_prefetch;
  AdamFn fn = g_table->adam[grad_dtype][out_dtype][max_exp_avg_sq ? 1 : 0];
  parallel_blocks(numel, threads, [&](int64_t b, int64_t e) { fn(a, b, e); });
}

void sgd_step(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t momentum_buffer,
              std::uintptr_t out, int out_dtype, int64_t numel, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool first_step, bool maximize, double grad_scale, int threads) {
  check_code(grad_dtype, false, "grad");
  check_code(out_dtype, true, "out");
  if (numel < 0) throw std::invalid_argument("numel must be >= 0");
  if (numel == 0) return;
  if (!param || !grad || (out_dtype != kNone && !out)) throw std::invalid_argument("null buffer address");
  if (momentum != 0.0 && !momentum_buffer) throw std::invalid_argument("momentum needs a momentum buffer");
  SgdArgs a{};
  a.p = ptr<float>(param);
  a.g = ptr<const void>(grad);
  a.buf = ptr<float>(momentum_buffer);
  a.out = ptr<void>(out);
  a.wd = static_cast<float>(weight_decay);
  a.momentum = static_cast<float>(momentum);
  a.omd = static_cast<float>(1.0 - dampening);
  a.neg_lr = static_cast<float>(-lr);
  a.grad_scale = static_cast<float>(grad_scale);
  a.scale_grad = grad_scale != 1.0;
  a.has_wd = weight_decay != 0.0;
  a.has_momentum = momentum != 0.0;
  a.first = first_step;
  a.nesterov = nesterov;
  a.maximize = maximize;
  SgdFn fn = g_table->sgd[grad_dtype][out_dtype];
  parallel_blocks(numel, threads, [&](int64_t b, int64_t e) { fn(a, b, e); });
}

void copy_bytes(std::uintptr_t dst, std::uintptr_t src, int64_t nbytes, int threads) {
  if (nbytes <= 0) return;
  parallel_blocks(nbytes, threads, [&](int64_t b, int64_t e) {
    std::memcpy(ptr<char>(dst) + b, ptr<const char>(src) + b, static_cast<size_t>(e - b));
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "crosstrain native CPU optimizer kernels (raw-buffer interface, OpenMP, runtime ISA dispatch)";
  const char* forced = std::getenv("CROSSTRAIN_NATIVE_ISA");
  set_isa(forced && *forced ? forced : "auto");
  if (const char* pf = std::getenv("CROSSTRAIN_NATIVE_PREFETCH")) g_prefetch = std::atoll(pf);
  m.def("adamw_step", &adamw_step, py::call_guard<py::gil_scoped_release>(), py::arg("param"), py::arg("grad"),
        py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"), py::arg("out"),
        py::arg("out_dtype"), py::arg("numel"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("maximize"), py::arg("grad_scale"), py::arg("threads"),
        "One fused AdamW update over numel elements (addresses of contiguous buffers).");
  m.def("sgd_step", &sgd_step, py::call_guard<py::gil_scoped_release>(), py::arg("param"), py::arg("grad"),
        py::arg("grad_dtype"), py::arg("momentum_buffer"), py::arg("out"), py::arg("out_dtype"), py::arg("numel"),
        py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
        py::arg("first_step"), py::arg("maximize"), py::arg("grad_scale"), py::arg("threads"),
        "One fused SGD (momentum, nesterov) update over numel elements.");
  m.def("copy_bytes", &copy_bytes, py::call_guard<py::gil_scoped_release>(), py::arg("dst"), py::arg("src"),
        py::arg("nbytes"), py::arg("threads"), "Parallel memcpy (for bandwidth measurements).");
  m.def("isa", &isa, "The instruction set in use.");
  m.def("set_isa", &set_isa, py::arg("isa"), "Force 'avx512', 'avx2', 'generic' or 'auto'.");
  m.def("cpu_supports", [](const std::string& s) { return cpu_has(s.c_str()); }, py::arg("isa"));
  m.def("max_threads", &max_threads);
  m.def("set_prefetch", [](int64_t d) { g_prefetch = d < 0 ? 0 : d; }, py::arg("elements"),
        "AdamW software prefetch distance in elements (0 = off); env CROSSTRAIN_NATIVE_PREFETCH.");
  m.attr("openmp") = py::bool_(
#ifdef _OPENMP
      true
#else
      false
#endif
  );
}
