// The model-op kernels, written once as plain loops and compiled per instruction set: each ops_*.cpp
// defines CT_NS (a distinct namespace, so no inline function is shared between targets), switches the
// target with #pragma GCC target and includes this file. `#pragma omp simd` (-fopenmp-simd) lets the
// compiler vectorise the reductions without -ffast-math; every function handles rows [begin, end) of its
// arguments on one thread, the OpenMP split lives in ops_module.cpp.
//
// Arithmetic follows the pure-torch references in crosstrain.kernels.reference: fp32 throughout, bf16
// only at load (a shift) and store (round to nearest even, NaN kept quiet).

#include "ops_common.h"

namespace crosstrain_ops {
namespace CT_NS {

template <class T>
struct El;

template <>
struct El<float> {
  static inline float get(const float* p, int64_t i) { return p[i]; }
  static inline void put(float* p, int64_t i, float v) { p[i] = v; }
};

template <>
struct El<uint16_t> {  // bf16: the high half of an fp32
  static inline float get(const uint16_t* p, int64_t i) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(p[i]) << 16);
  }
  static inline void put(uint16_t* p, int64_t i, float v) {
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (u >> 16) | 0x40u;
    p[i] = static_cast<uint16_t>(v != v ? quiet : rounded);
  }
};

// exp(x) in the Cephes expf scheme (S. L. Moshier, Cephes Math Library): x = n ln2 + r with ln2 split in
// two constants, a degree-6 polynomial for exp(r) on |r| <= ln2/2, and 2^n built in the exponent bits.
// About 1 ulp; branch-free, so it vectorises. NaN propagates; inputs below -87.3 give exp(-87.3), the smallest
// normal result, and inputs from 88.4 on give +inf, so sigmoid(x) = 1 / (1 + exp(-x)) is exactly 0 for x <= -88.4.
// A denormal there instead (the old clamp at 88.3) made GCC's vectorised select multiply every lane by a denormal
// constant: a microcode assist per vector, swiglu forward 7x slower.
static inline float ct_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 89.0f ? 89.0f : x;
  float n = x * 1.44269504088896341f;
  n = (n + 12582912.0f) - 12582912.0f;  // round to nearest integer (|n| < 2^22)
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  return p * __builtin_bit_cast(float, static_cast<uint32_t>(e) << 23);
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + ct_exp(-x)); }

// ---------------------------------------------------------------------------------------------- rms_norm
// y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization"); backward with xhat = x * rstd, g = dy * w:
//   dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat;
// with dres (the gradient of x's other use, a residual branch) dx += dres in the same pass over the row.
template <class T>
void rms_fwd(const void* pa, int64_t begin, int64_t end, float*) {
  const RmsArgs& a = *static_cast<const RmsArgs*>(pa);
  const int64_t d = a.d;
  const float* w = a.w;
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(a.x) + r * d;
    T* y = static_cast<T*>(a.y) + r * d;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) {
      const float v = El<T>::get(x, i);
      ss += v * v;
    }
    const float rs = 1.0f / __builtin_sqrtf(ss / static_cast<float>(d) + a.eps);
    a.rstd[r] = rs;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) El<T>::put(y, i, El<T>::get(x, i) * rs * w[i]);
  }
}

template <class T>
void rms_bwd(const void* pa, int64_t begin, int64_t end, float* dw) {
  const RmsArgs& a = *static_cast<const RmsArgs*>(pa);
  const int64_t d = a.d;
  const float* w = a.w;
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(a.x) + r * d;
    const T* dy = static_cast<const T*>(a.dy) + r * d;
    T* dx = static_cast<T*>(a.y) + r * d;
    const float rs = a.rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < d; ++i) dot += El<T>::get(dy, i) * w[i] * (El<T>::get(x, i) * rs);
    const float c = dot / static_cast<float>(d);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      const float g = El<T>::get(dy, i);
      const float xh = El<T>::get(x, i) * rs;
      El<T>::put(dx, i, rs * (g * w[i] - xh * c));
      dw[i] += g * xh;
    }
    if (a.dres) {  // dx rounded to T, then the sum rounded again: what autograd's separate add computes
      const T* dr = static_cast<const T*>(a.dres) + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) El<T>::put(dx, i, El<T>::get(dx, i) + El<T>::get(dr, i));
    }
  }
}

// -------------------------------------------------------------------------------------- rotary_embedding
// Rotate-half RoPE (Su et al. 2021, "RoFormer"; GPT-NeoX layout): y1 = x1 c - x2 s, y2 = x2 c + x1 s.
// The backward is the same rotation by -angle (sign = -1).
template <class T>
void rope(const void* pa, int64_t begin, int64_t end, float*) {
  const RopeArgs& a = *static_cast<const RopeArgs*>(pa);
  const int64_t d = a.d, half = d / 2;
  const float sign = a.sign;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t t = (r / a.heads) % a.seq;
    const float* c = a.cos + t * half;
    const float* s = a.sin + t * half;
    const T* x = static_cast<const T*>(a.x) + r * d;
    T* y = static_cast<T*>(a.y) + r * d;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = El<T>::get(x, i), x2 = El<T>::get(x, i + half);
      const float si = sign * s[i];
      El<T>::put(y, i, x1 * c[i] - x2 * si);
      El<T>::put(y, i + half, x2 * c[i] + x1 * si);
    }
  }
}

// ---------------------------------------------------------------------------------------------- swiglu
// silu(g) * u (Shazeer 2020, "GLU Variants Improve Transformer"), sig = sigmoid(g):
//   d g = dy * u * sig * (1 + g * (1 - sig)),   d u = dy * g * sig.
template <class T>
void swiglu_fwd(const void* pa, int64_t begin, int64_t end, float*) {
  const SwigluArgs& a = *static_cast<const SwigluArgs*>(pa);
  const T* g = static_cast<const T*>(a.gate);
  const T* u = static_cast<const T*>(a.up);
  T* out = static_cast<T*>(a.out);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gv = El<T>::get(g, i);
    El<T>::put(out, i, gv * sigmoid(gv) * El<T>::get(u, i));
  }
}

template <class T>
void swiglu_bwd(const void* pa, int64_t begin, int64_t end, float*) {
  const SwigluArgs& a = *static_cast<const SwigluArgs*>(pa);
  const T* g = static_cast<const T*>(a.gate);
  const T* u = static_cast<const T*>(a.up);
  const T* dy = static_cast<const T*>(a.dy);
  T* dg = static_cast<T*>(a.out);
  T* du = static_cast<T*>(a.dup);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gv = El<T>::get(g, i), uv = El<T>::get(u, i), dyv = El<T>::get(dy, i);
    const float sig = sigmoid(gv);
    El<T>::put(dg, i, dyv * uv * sig * (1.0f + gv * (1.0f - sig)));
    El<T>::put(du, i, dyv * gv * sig);
  }
}

// ------------------------------------------------------------------------------------------ cross_entropy
// loss_r = logsumexp(l_r) - l_r[t_r]; d l_r = (softmax(l_r) - onehot(t_r)) * scale. Ignored rows: loss 0,
// gradient 0. The log-sum-exp subtracts the row max (two passes over a row that stays in cache); the
// `dlt * 0` term is 0 unless a NaN/inf logit appears, and then makes the row's loss NaN as torch's does.
template <class T>
static inline float row_lse(const T* l, int64_t v) {
  float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < v; ++i) {
    const float x = El<T>::get(l, i);
    m = x > m ? x : m;
  }
  float s = 0.0f, z = 0.0f;
#pragma omp simd reduction(+ : s, z)
  for (int64_t i = 0; i < v; ++i) {
    const float dlt = El<T>::get(l, i) - m;
    s += ct_exp(dlt);
    z += dlt * 0.0f;
  }
  return m + __builtin_logf(s) + z;
}

// Row r's log-sum-exp and loss from its logits l; both 0 for an ignored row.
template <class T>
static inline void ce_loss_row(const CeArgs& a, int64_t r, const T* l) {
  const int64_t t = a.targets[r];
  if (t == a.ignore_index) {
    a.lse[r] = 0.0f;
    a.loss[r] = 0.0f;
    return;
  }
  const float lse = row_lse(l, a.vocab);
  a.lse[r] = lse;
  a.loss[r] = lse - El<T>::get(l, t);
}

// Row r's gradient (softmax(l) - onehot(t)) * scale from its logits l and the lse the forward wrote; 0 for an
// ignored row. g may be l itself (the fused kernel): l[t] is read before the row is overwritten.
template <class T>
static inline void ce_grad_row(const CeArgs& a, int64_t r, const T* l, T* g) {
  const int64_t v = a.vocab;
  const int64_t t = a.targets[r];
  if (t == a.ignore_index) {
#pragma omp simd
    for (int64_t i = 0; i < v; ++i) El<T>::put(g, i, 0.0f);
    return;
  }
  const float lse = a.lse[r];
  const float sc = a.scale;
  const float lt = El<T>::get(l, t);
#pragma omp simd
  for (int64_t i = 0; i < v; ++i) El<T>::put(g, i, ct_exp(El<T>::get(l, i) - lse) * sc);
  El<T>::put(g, t, (ct_exp(lt - lse) - 1.0f) * sc);
}

template <class T>
void ce_fwd(const void* pa, int64_t begin, int64_t end, float*) {
  const CeArgs& a = *static_cast<const CeArgs*>(pa);
  for (int64_t r = begin; r < end; ++r) ce_loss_row(a, r, static_cast<const T*>(a.logits) + r * a.vocab);
}

template <class T>
void ce_bwd(const void* pa, int64_t begin, int64_t end, float*) {
  const CeArgs& a = *static_cast<const CeArgs*>(pa);
  for (int64_t r = begin; r < end; ++r)
    ce_grad_row(a, r, static_cast<const T*>(a.logits) + r * a.vocab, static_cast<T*>(a.grad) + r * a.vocab);
}

// Forward and backward in one pass over fp32 logits, which are overwritten with their gradient.
void ce_fused(const void* pa, int64_t begin, int64_t end, float*) {
  const CeArgs& a = *static_cast<const CeArgs*>(pa);
  for (int64_t r = begin; r < end; ++r) {
    float* l = const_cast<float*>(static_cast<const float*>(a.logits)) + r * a.vocab;
    ce_loss_row(a, r, l);
    ce_grad_row(a, r, l, l);
  }
}

inline const OpsTable& table(const char* name) {
  static const OpsTable t = {
      name,
      {rms_fwd<float>, rms_fwd<uint16_t>},
      {rms_bwd<float>, rms_bwd<uint16_t>},
      {rope<float>, rope<uint16_t>},
      {swiglu_fwd<float>, swiglu_fwd<uint16_t>},
      {swiglu_bwd<float>, swiglu_bwd<uint16_t>},
      {ce_fwd<float>, ce_fwd<uint16_t>},
      {ce_bwd<float>, ce_bwd<uint16_t>},
      ce_fused,
  };
  return t;
}

}  // namespace CT_NS
}  // namespace crosstrain_ops
