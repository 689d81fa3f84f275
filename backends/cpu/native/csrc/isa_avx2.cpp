// AVX2 + FMA + F16C variant, selected at run time when the CPU has them.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma,f16c")
#define CT_NS avx2
#define CT_AVX2 1
#include "kernels_impl.h"

namespace crosstrain_native {
const IsaTable& avx2_table() {
  static const IsaTable table = avx2::make_table("avx2");
  return table;
}
}  // namespace crosstrain_native
