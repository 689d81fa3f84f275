// AVX-512 (F, BW, VL) variant, selected at run time when the CPU has it.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define CT_NS avx512
#define CT_AVX512 1
#include "kernels_impl.h"

namespace crosstrain_native {
const IsaTable& avx512_table() {
  static const IsaTable table = avx512::make_table("avx512");
  return table;
}
}  // namespace crosstrain_native
