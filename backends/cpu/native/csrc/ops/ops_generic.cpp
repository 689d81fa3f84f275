// Portable variant: the loops in ops_impl.h auto-vectorised for the baseline instruction set.
#include <cmath>
#include <cstdint>
#include <cstring>

#define CT_NS generic
#include "ops_impl.h"

namespace crosstrain_ops {
const OpsTable& ops_generic() { return generic::table("generic"); }
}  // namespace crosstrain_ops
