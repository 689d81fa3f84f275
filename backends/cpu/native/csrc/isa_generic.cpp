// Portable variant: plain scalar code (the compiler may auto-vectorise it with the baseline ISA).
#include <cstdint>
#include <cstring>

#define CT_NS generic
#include "kernels_impl.h"

namespace crosstrain_native {
const IsaTable& generic_table() {
  static const IsaTable table = generic::make_table("generic");
  return table;
}
}  // namespace crosstrain_native
