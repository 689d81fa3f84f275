// Python bindings of the native CPU model-op kernels (module crosstrain.backends.cpu.native._kernels).
// Buffers arrive as raw addresses of contiguous tensors (tensor.data_ptr()), so the extension never links
// against torch's C++ ABI and builds in seconds. The instruction set is chosen once at import (AVX-512,
// AVX2 or generic; env CROSSTRAIN_NATIVE_ISA forces one), rows are split over OpenMP threads here.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "ops_common.h"

namespace py = pybind11;
using namespace crosstrain_ops;

namespace {

const OpsTable* g_ops = nullptr;

bool cpu_has(const std::string& isa) {
#if defined(CROSSTRAIN_X86)
  __builtin_cpu_init();
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "generic";
}

void set_isa(const std::string& requested) {
  std::string name = requested;
  if (name == "auto") name = cpu_has("avx512") ? "avx512" : cpu_has("avx2") ? "avx2" : "generic";
  if (name != "avx512" && name != "avx2" && name != "generic")
    throw std::invalid_argument("unknown instruction set '" + requested + "'; use auto, avx512, avx2 or generic");
  if (!cpu_has(name)) throw std::invalid_argument("this CPU does not support the '" + name + "' instruction set");
#if defined(CROSSTRAIN_X86)
  if (name == "avx512") g_ops = &ops_avx512();
  if (name == "avx2") g_ops = &ops_avx2();
#endif
  if (name == "generic") g_ops = &ops_generic();
}

template <class T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

int dtype_index(int code) {
  if (code != 0 && code != 1) throw std::invalid_argument("unsupported dtype code (the kernels take fp32 and bf16)");
  return code;
}

// Threads to use for `rows` rows of `per_row` elements: one below ~32K elements (a fork/join costs more).
int plan_threads(int64_t rows, int64_t per_row, int threads) {
  if (threads <= 1 || rows < 2 || rows * std::max<int64_t>(per_row, 1) < (int64_t{1} << 15)) return 1;
  return static_cast<int>(std::min<int64_t>(threads, rows));
}

// Run fn(args, begin, end, scratch + tid * scratch_stride) on one contiguous block of rows per thread.
void run_rows(RowFn fn, const void* args, int64_t rows, int nt, float* scratch = nullptr, int64_t stride = 0) {
  if (nt <= 1) {
    fn(args, 0, rows, scratch);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  {
    const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
    fn(args, rows * tid / n, rows * (tid + 1) / n, scratch ? scratch + tid * stride : nullptr);
  }
#else
  fn(args, 0, rows, scratch);
#endif
}

void rms_norm_fwd(std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, std::uintptr_t rstd, int64_t rows,
                  int64_t d, double eps, int dtype, int threads) {
  RmsArgs a{ptr<const void>(x), ptr<const float>(w), nullptr, ptr<void>(y), ptr<float>(rstd), d,
            static_cast<float>(eps)};
  run_rows(g_ops->rms_fwd[dtype_index(dtype)], &a, rows, plan_threads(rows, d, threads));
}

void rms_norm_bwd(std::uintptr_t dy, std::uintptr_t x, std::uintptr_t w, std::uintptr_t rstd, std::uintptr_t dx,
                  std::uintptr_t dw, int64_t rows, int64_t d, int dtype, int threads, std::uintptr_t dres) {
  RmsArgs a{ptr<const void>(x), ptr<const float>(w), ptr<const void>(dy), ptr<void>(dx), ptr<float>(rstd), d, 0.f,
            ptr<const void>(dres)};
  const int nt = plan_threads(rows, d, threads);
  std::vector<float> partial(static_cast<size_t>(nt * d), 0.0f);  // one dw row per thread, summed below
  run_rows(g_ops->rms_bwd[dtype_index(dtype)], &a, rows, nt, partial.data(), d);
  float* out = ptr<float>(dw);
  for (int64_t i = 0; i < d; ++i) out[i] = partial[i];
  for (int t = 1; t < nt; ++t)
    for (int64_t i = 0; i < d; ++i) out[i] += partial[t * d + i];
}

void rotary(std::uintptr_t x, std::uintptr_t cos, std::uintptr_t sin, std::uintptr_t y, int64_t rows, int64_t seq,
            int64_t heads, int64_t d, double sign, int dtype, int threads) {
  if (d % 2 != 0 || seq < 1 || heads < 1) throw std::invalid_argument("rotary: head dim must be even, seq/heads >= 1");
  RopeArgs a{ptr<const void>(x), ptr<const float>(cos), ptr<const float>(sin), ptr<void>(y), seq, heads, d,
             static_cast<float>(sign)};
  run_rows(g_ops->rope[dtype_index(dtype)], &a, rows, plan_threads(rows, d, threads));
}

// Elementwise ops are split in blocks of 4096 elements ("rows") so each thread gets whole vectors.
constexpr int64_t kBlock = 4096;

template <class Args>
struct Blocked {
  RowFn fn;
  const Args* args;
  int64_t n;
};

template <class Args>
void blocked(const void* pb, int64_t begin, int64_t end, float*) {
  const auto& b = *static_cast<const Blocked<Args>*>(pb);
  b.fn(b.args, begin * kBlock, std::min(b.n, end * kBlock), nullptr);
}

void run_elementwise(RowFn fn, const SwigluArgs& a, int64_t n, int threads) {
  const Blocked<SwigluArgs> b{fn, &a, n};
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  run_rows(&blocked<SwigluArgs>, &b, blocks, plan_threads(blocks, kBlock, threads));
}

void swiglu_fwd(std::uintptr_t gate, std::uintptr_t up, std::uintptr_t out, int64_t n, int dtype, int threads) {
  SwigluArgs a{ptr<const void>(gate), ptr<const void>(up), nullptr, ptr<void>(out), nullptr};
  run_elementwise(g_ops->swiglu_fwd[dtype_index(dtype)], a, n, threads);
}

void swiglu_bwd(std::uintptr_t dy, std::uintptr_t gate, std::uintptr_t up, std::uintptr_t dgate, std::uintptr_t dup,
                int64_t n, int dtype, int threads) {
  SwigluArgs a{ptr<const void>(gate), ptr<const void>(up), ptr<const void>(dy), ptr<void>(dgate), ptr<void>(dup)};
  run_elementwise(g_ops->swiglu_bwd[dtype_index(dtype)], a, n, threads);
}

// Counts the rows that are not ignored; a target outside [0, vocab) is an IndexError (as in torch).
int64_t check_targets(const int64_t* targets, int64_t rows, int64_t vocab, int64_t ignore_index) {
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= vocab)
      throw py::index_error("cross_entropy: target " + std::to_string(t) + " is out of bounds for " +
                            std::to_string(vocab) + " classes");
    ++count;
  }
  return count;
}

double sum_rows(const float* loss, int64_t rows) {
  double s = 0.0;
  for (int64_t r = 0; r < rows; ++r) s += loss[r];
  return s;
}

std::pair<double, int64_t> cross_entropy_fwd(std::uintptr_t logits, std::uintptr_t targets, std::uintptr_t lse,
                                             std::uintptr_t loss, int64_t rows, int64_t vocab, int64_t ignore_index,
                                             int dtype, int threads) {
  const int64_t count = check_targets(ptr<const int64_t>(targets), rows, vocab, ignore_index);
  CeArgs a{ptr<const void>(logits), ptr<const int64_t>(targets), ptr<float>(lse), ptr<float>(loss), nullptr,
           vocab, ignore_index, 0.f};
  run_rows(g_ops->ce_fwd[dtype_index(dtype)], &a, rows, plan_threads(rows, vocab, threads));
  return {sum_rows(ptr<const float>(loss), rows), count};
}

void cross_entropy_bwd(std::uintptr_t logits, std::uintptr_t targets, std::uintptr_t lse, std::uintptr_t grad,
                       int64_t rows, int64_t vocab, int64_t ignore_index, double scale, int dtype, int threads) {
  CeArgs a{ptr<const void>(logits), ptr<const int64_t>(targets), ptr<float>(lse), nullptr, ptr<void>(grad), vocab,
           ignore_index, static_cast<float>(scale)};
  run_rows(g_ops->ce_bwd[dtype_index(dtype)], &a, rows, plan_threads(rows, vocab, threads));
}

double cross_entropy_fused(std::uintptr_t logits, std::uintptr_t targets, std::uintptr_t lse, std::uintptr_t loss,
                           int64_t rows, int64_t vocab, int64_t ignore_index, double scale, int threads) {
  check_targets(ptr<const int64_t>(targets), rows, vocab, ignore_index);
  CeArgs a{ptr<const void>(logits), ptr<const int64_t>(targets), ptr<float>(lse), ptr<float>(loss), nullptr, vocab,
           ignore_index, static_cast<float>(scale)};
  run_rows(g_ops->ce_fused, &a, rows, plan_threads(rows, vocab, threads));
  return sum_rows(ptr<const float>(loss), rows);
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "crosstrain native CPU model-op kernels (raw-buffer interface, OpenMP, runtime ISA dispatch)";
  const char* forced = std::getenv("CROSSTRAIN_NATIVE_ISA");
  set_isa(forced && *forced ? forced : "auto");
  using guard = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm_fwd", &rms_norm_fwd, guard(), "y = rms_norm(x) * w; writes rstd per row.");
  m.def("rms_norm_bwd", &rms_norm_bwd, guard(), py::arg("dy"), py::arg("x"), py::arg("w"), py::arg("rstd"),
        py::arg("dx"), py::arg("dw"), py::arg("rows"), py::arg("d"), py::arg("dtype"), py::arg("threads"),
        py::arg("dres") = 0, "dx (plus dres where given: x's gradient from a residual branch) and the fp32 dw.");
  m.def("rotary", &rotary, guard(), "Rotate-half RoPE by +angle (sign 1) or -angle (sign -1).");
  m.def("swiglu_fwd", &swiglu_fwd, guard(), "silu(gate) * up.");
  m.def("swiglu_bwd", &swiglu_bwd, guard(), "d gate and d up of silu(gate) * up.");
  m.def("cross_entropy_fwd", &cross_entropy_fwd, guard(), "(sum of row losses, counted rows); writes lse.");
  m.def("cross_entropy_bwd", &cross_entropy_bwd, guard(), "d logits = (softmax - onehot) * scale.");
  m.def("cross_entropy_fused", &cross_entropy_fused, guard(),
        "fp32 logits overwritten with their gradient (scaled); returns the sum of row losses.");
  m.def("isa", []() { return std::string(g_ops->name); }, "The instruction set in use.");
  m.def("set_isa", &set_isa, py::arg("isa"), "Force 'avx512', 'avx2', 'generic' or 'auto'.");
  m.attr("openmp") = py::bool_(
#ifdef _OPENMP
      true
#else
      false
#endif
  );
}
