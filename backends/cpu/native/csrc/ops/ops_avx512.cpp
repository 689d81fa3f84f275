// AVX-512 (F, BW, VL) variant, selected at run time when the CPU has it.
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define CT_NS avx512
#include "ops_impl.h"

namespace crosstrain_ops {
const OpsTable& ops_avx512() { return avx512::table("avx512"); }
}  // namespace crosstrain_ops
