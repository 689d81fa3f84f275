// The fused optimizer kernels, written once against a small vector interface and compiled per instruction
// set. Each isa_*.cpp defines CT_NS (a distinct namespace, so no inline function is shared between
// instruction sets) and CT_AVX2 / CT_AVX512, switches the target with #pragma GCC target, then includes
// this file. Standard headers are included before the pragma so none of their code gets the wider target.
//
// Arithmetic mirrors torch.optim's single-tensor AdamW / SGD operation by operation (same order, FMA only
// where torch's CPU kernels use it), so results match torch to a few ulps.

#include "common.h"
#include "convert.h"

namespace crosstrain_native {
namespace CT_NS {

// ---------------------------------------------------------------------------------------------- scalar
struct Scalar {
  using vec = float;
  static constexpr int W = 1;
  static inline vec set1(float x) { return x; }
  static inline vec load(const float* p) { return *p; }
  static inline void store(float* p, vec x) { *p = x; }
  static inline vec load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static inline void store_bf16(uint16_t* p, vec x) { *p = f32_to_bf16(x); }
#if defined(CT_AVX2) || defined(CT_AVX512)
  static inline vec load_f16(const uint16_t* p) { return _cvtsh_ss(*p); }
  static inline void store_f16(uint16_t* p, vec x) {
    *p = static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static inline vec fmadd(vec a, vec b, vec c) { return __builtin_fmaf(a, b, c); }
#else
  static inline vec load_f16(const uint16_t* p) { return f16_to_f32_soft(*p); }
  static inline void store_f16(uint16_t* p, vec x) { *p = f32_to_f16_soft(x); }
#if defined(__FMA__) || defined(__aarch64__)
  static inline vec fmadd(vec a, vec b, vec c) { return __builtin_fmaf(a, b, c); }  // one instruction
#else
  static inline vec fmadd(vec a, vec b, vec c) { return a * b + c; }  // no FMA unit assumed (libm fmaf is slow)
#endif
#endif
  static inline vec add(vec a, vec b) { return a + b; }
  static inline vec sub(vec a, vec b) { return a - b; }
  static inline vec mul(vec a, vec b) { return a * b; }
  static inline vec div(vec a, vec b) { return a / b; }
  static inline vec sqrt(vec a) { return __builtin_sqrtf(a); }
  static inline vec max(vec a, vec b) { return (a != a) ? a : (a > b ? a : b); }
  static inline vec neg(vec a) { return -a; }
};

#if defined(CT_AVX2) || defined(CT_AVX512)
// ------------------------------------------------------------------------------------------------ AVX2
struct Avx2 {
  using vec = __m256;
  static constexpr int W = 8;
  static inline vec set1(float x) { return _mm256_set1_ps(x); }
  static inline vec load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, vec x) { _mm256_storeu_ps(p, x); }
  static inline vec load_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline void store_bf16(uint16_t* p, vec x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    r = _mm256_srli_epi32(r, 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static inline vec load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_f16(uint16_t* p, vec x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
  static inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
  static inline vec div(vec a, vec b) { return _mm256_div_ps(a, b); }
  static inline vec sqrt(vec a) { return _mm256_sqrt_ps(a); }
  static inline vec max(vec a, vec b) {  // NaN in a propagates, like torch.maximum
    vec m = _mm256_max_ps(a, b);
    return _mm256_blendv_ps(m, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static inline vec neg(vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
};
#endif

#if defined(CT_AVX512)
// --------------------------------------------------------------------------------------------- AVX-512
struct Avx512 {
  using vec = __m512;
  static constexpr int W = 16;
  static inline vec set1(float x) { return _mm512_set1_ps(x); }
  static inline vec load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, vec x) { _mm512_storeu_ps(p, x); }
  static inline vec load_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline void store_bf16(uint16_t* p, vec x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
    r = _mm512_srli_epi32(r, 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static inline vec load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void store_f16(uint16_t* p, vec x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
  static inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
  static inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
  static inline vec sqrt(vec a) { return _mm512_sqrt_ps(a); }
  static inline vec max(vec a, vec b) {
    vec m = _mm512_max_ps(a, b);
    return _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
  }
  static inline vec neg(vec a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x80000000)));
  }
};
using Wide = Avx512;
#elif defined(CT_AVX2)
using Wide = Avx2;
#else
using Wide = Scalar;
#endif

// ----------------------------------------------------------------------------------------- load/store
template <class V, int G>
static inline typename V::vec load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return V::load(static_cast<const float*>(g) + i);
  else if constexpr (G == kBF16) return V::load_bf16(static_cast<const uint16_t*>(g) + i);
  else return V::load_f16(static_cast<const uint16_t*>(g) + i);
}

template <class V, int O>
static inline void store_out(void* o, int64_t i, typename V::vec x) {
  if constexpr (O == kF32) V::store(static_cast<float*>(o) + i, x);
  else if constexpr (O == kBF16) V::store_bf16(static_cast<uint16_t*>(o) + i, x);
  else if constexpr (O == kF16) V::store_f16(static_cast<uint16_t*>(o) + i, x);
}

// ---------------------------------------------------------------------------------------------- AdamW
template <class V, int G, int O, bool AMS>
static inline void adam_one(const AdamArgs& a, int64_t i) {
  using vec = typename V::vec;
  vec g = load_grad<V, G>(a.g, i);
  if (a.scale_grad) g = V::mul(g, V::set1(a.grad_scale));
  if (a.maximize) g = V::neg(g);
  vec p = V::mul(V::load(a.p + i), V::set1(a.decay));            // param.mul_(1 - lr * wd)
  vec m = V::load(a.m + i);
  m = V::fmadd(V::set1(a.omb1), V::sub(g, m), m);                 // exp_avg.lerp_(grad, 1 - beta1)
  vec v = V::mul(V::load(a.v + i), V::set1(a.beta2));             // exp_avg_sq.mul_(beta2)
  v = V::fmadd(V::mul(V::set1(a.omb2), g), g, v);                 //   .addcmul_(grad, grad, 1 - beta2)
  vec den;
  if constexpr (AMS) {
    vec vm = V::max(V::load(a.vmax + i), v);
    V::store(a.vmax + i, vm);
    den = V::sqrt(vm);
  } else {
    den = V::sqrt(v);
  }
  den = V::fmadd(den, V::set1(a.inv_bc2_sqrt), V::set1(a.eps));  // sqrt(v) / bc2_sqrt + eps (one divide less)
  p = V::add(p, V::div(V::mul(V::set1(a.neg_step_size), m), den));  // param.addcdiv_(m, den, -step_size)
  V::store(a.p + i, p);
  V::store(a.m + i, m);
  V::store(a.v + i, v);
  store_out<V, O>(a.out, i, p);
}

template <int G, int O, bool AMS>
static void adam_range(const AdamArgs& a, int64_t begin, int64_t end) {
  int64_t i = begin;
#if defined(CT_AVX2) || defined(CT_AVX512)
  if (a.prefetch > 0) {
    // one 64-byte line per fp32 array every 16 elements, a.prefetch elements ahead
    for (; i + 16 <= end; i += 16) {
      const int64_t j = i + a.prefetch;
      if (j < end) {
        _mm_prefetch(reinterpret_cast<const char*>(a.p + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a.m + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a.v + j), _MM_HINT_T0);
        _mm_prefetch(static_cast<const char*>(a.g) + j * (G == kF32 ? 4 : 2), _MM_HINT_T0);
      }
      for (int k = 0; k < 16; k += Wide::W) adam_one<Wide, G, O, AMS>(a, i + k);
    }
  }
#endif
  for (; i + Wide::W <= end; i += Wide::W) adam_one<Wide, G, O, AMS>(a, i);
  for (; i < end; ++i) adam_one<Scalar, G, O, AMS>(a, i);
}

// ------------------------------------------------------------------------------------------------ SGD
template <class V, int G, int O>
static inline void sgd_one(const SgdArgs& a, int64_t i) {
  using vec = typename V::vec;
  vec g = load_grad<V, G>(a.g, i);
  if (a.scale_grad) g = V::mul(g, V::set1(a.grad_scale));
  if (a.maximize) g = V::neg(g);
  vec p = V::load(a.p + i);
  if (a.has_wd) g = V::fmadd(p, V::set1(a.wd), g);                 // grad.add(param, alpha=wd)
  if (a.has_momentum) {
    vec b;
    if (a.first) {
      b = g;                                                       // buf = clone(grad)
    } else {
      b = V::mul(V::load(a.buf + i), V::set1(a.momentum));         // buf.mul_(momentum)
      b = V::fmadd(g, V::set1(a.omd), b);                          //    .add_(grad, alpha=1 - dampening)
    }
    V::store(a.buf + i, b);
    g = a.nesterov ? V::fmadd(b, V::set1(a.momentum), g) : b;     // grad.add(buf, alpha=momentum)
  }
  p = V::fmadd(g, V::set1(a.neg_lr), p);                           // param.add_(grad, alpha=-lr)
  V::store(a.p + i, p);
  store_out<V, O>(a.out, i, p);
}

template <int G, int O>
static void sgd_range(const SgdArgs& a, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + Wide::W <= end; i += Wide::W) sgd_one<Wide, G, O>(a, i);
  for (; i < end; ++i) sgd_one<Scalar, G, O>(a, i);
}

// ---------------------------------------------------------------------------------------------- table
template <int G, int O>
static void fill(IsaTable& t) {
  t.adam[G][O][0] = &adam_range<G, O, false>;
  t.adam[G][O][1] = &adam_range<G, O, true>;
  t.sgd[G][O] = &sgd_range<G, O>;
}

template <int G>
static void fill_grad(IsaTable& t) {
  fill<G, kF32>(t);
  fill<G, kBF16>(t);
  fill<G, kF16>(t);
  fill<G, kNone>(t);
}

static IsaTable make_table(const char* name) {
  IsaTable t{};
  t.name = name;
  fill_grad<kF32>(t);
  fill_grad<kBF16>(t);
  fill_grad<kF16>(t);
  return t;
}

}  // namespace CT_NS
}  // namespace crosstrain_native
