// Shared declarations of the native CPU model-op kernels (rms_norm, rotary, swiglu, cross-entropy).
// Raw buffers only (no torch headers), like the optimizer kernels one folder up: the Python side passes
// data_ptr() addresses of contiguous tensors, element counts and a dtype index (0 fp32, 1 bf16).
#pragma once

#include <cstdint>

namespace crosstrain_ops {

struct RmsArgs {
  const void* x;     // [rows, d], fp32/bf16
  const float* w;    // [d] fp32 (the Python side upcasts the scale once)
  const void* dy;    // backward: upstream gradient, same dtype as x
  void* y;           // forward output / backward dx, same dtype as x
  float* rstd;       // [rows]: 1 / sqrt(mean(x^2) + eps), written by forward, read by backward
  int64_t d;
  float eps;
  const void* dres = nullptr;  // backward: a gradient added to dx (x also feeds a residual branch), or null
};

struct RopeArgs {
  const void* x;     // [rows = B*T*H, d], fp32/bf16; row r uses table row (r / heads) % seq
  const float* cos;  // [seq, d/2]
  const float* sin;
  void* y;
  int64_t seq, heads, d;
  float sign;        // +1 forward, -1 backward (the transpose of a rotation is the rotation by -angle)
};

struct SwigluArgs {
  const void* gate;
  const void* up;
  const void* dy;    // backward only
  void* out;         // forward: silu(gate) * up; backward: d gate
  void* dup;         // backward: d up
};

struct CeArgs {
  const void* logits;     // [rows, vocab], fp32/bf16 (fused: fp32, overwritten with the gradient)
  const int64_t* targets; // [rows]
  float* lse;             // [rows] log-sum-exp (forward writes, backward reads)
  float* loss;            // [rows] per-row loss, 0 for ignored rows (forward)
  void* grad;             // backward: d logits, same dtype as logits
  int64_t vocab;
  int64_t ignore_index;
  float scale;            // backward: upstream gradient / number of counted rows
};

using RowFn = void (*)(const void* args, int64_t begin, int64_t end, float* scratch);

// One instruction-set variant of every kernel, indexed by dtype (0 fp32, 1 bf16).
struct OpsTable {
  const char* name;
  RowFn rms_fwd[2], rms_bwd[2];
  RowFn rope[2];
  RowFn swiglu_fwd[2], swiglu_bwd[2];
  RowFn ce_fwd[2], ce_bwd[2];
  RowFn ce_fused;  // fp32 only: forward and gradient in one visit of each row (linear_cross_entropy chunks)
};

const OpsTable& ops_generic();
const OpsTable& ops_avx2();
const OpsTable& ops_avx512();

}  // namespace crosstrain_ops
