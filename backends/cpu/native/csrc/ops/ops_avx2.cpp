// AVX2 + FMA variant, selected at run time when the CPU has it.
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma,f16c")
#define CT_NS avx2
#include "ops_impl.h"

namespace crosstrain_ops {
const OpsTable& ops_avx2() { return avx2::table("avx2"); }
}  // namespace crosstrain_ops
