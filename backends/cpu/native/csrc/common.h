// Shared declarations of the native CPU optimizer kernels (no torch headers: raw buffers only).
#pragma once

#include <cstdint>
#include <cstring>

namespace crosstrain_native {

// dtype codes shared with Python (crosstrain.backends.cpu.native._DTYPE_CODES)
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

struct AdamArgs {
  float* p;            // fp32 master parameter (updated in place)
  const void* g;       // gradient, fp32/bf16/fp16
  float* m;            // exp_avg
  float* v;            // exp_avg_sq
  float* vmax;         // max_exp_avg_sq (amsgrad) or nullptr
  void* out;           // optional low-precision copy of the new parameter
  float decay;         // 1 - lr * weight_decay
  float omb1;          // 1 - beta1
  float beta2;
  float omb2;          // 1 - beta2
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float neg_step_size; // -lr / (1 - beta1^step)
  float eps;
  float grad_scale;
  bool scale_grad;
  bool maximize;
  int64_t prefetch;    // software prefetch distance in elements (0 = none)
};

struct SgdArgs {
  float* p;
  const void* g;
  float* buf;          // momentum buffer or nullptr
  void* out;
  float wd;
  float momentum;
  float omd;           // 1 - dampening
  float neg_lr;
  float grad_scale;
  bool scale_grad;
  bool has_wd;
  bool has_momentum;
  bool first;          // first step: buf = grad
  bool nesterov;
  bool maximize;
};

using AdamFn = void (*)(const AdamArgs&, int64_t, int64_t);
using SgdFn = void (*)(const SgdArgs&, int64_t, int64_t);

// One instruction-set variant of every kernel: [grad dtype][out dtype][amsgrad] and [grad dtype][out dtype].
struct IsaTable {
  const char* name;
  AdamFn adam[3][4][2];
  SgdFn sgd[3][4];
};

const IsaTable& generic_table();
const IsaTable& avx2_table();
const IsaTable& avx512_table();

}  // namespace crosstrain_native
