// The ATen operators of simdev: memory and view ops natively, everything else by a boxed fallback that copies the
// arguments to the host, runs the CPU kernel and copies the results back (correctness, not speed).
#include "runtime.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/set_native.h>
#include <torch/library.h>

namespace simdev {
namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

c10::Device target(std::optional<c10::Device> d) {
  c10::Device dev = d.value_or(c10::Device(kType));
  TORCH_CHECK(dev.type() == kType, "simdev: expected a simdev device, got ", dev);
  return dev.has_index() ? dev : c10::Device(kType, current_device());
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "simdev: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "simdev: only host tensors can be pinned");
  c10::DeviceGuard guard(target(device));
  return at::detail::empty_generic(size, allocator(), kKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "simdev: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "simdev: only host tensors can be pinned");
  c10::DeviceGuard guard(target(device));
  return at::detail::empty_strided_generic(size, stride, allocator(), kKeys, c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// Grow the storage (through the runtime, never a host memcpy on device memory) so the tensor's view fits.
void ensure_storage(const at::Tensor& self) {
  const size_t need = at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.element_size(),
                                                       self.storage_offset());
  if (need > self.storage().nbytes()) resize_bytes(self.storage(), need);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value() && *memory_format != c10::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  ensure_storage(self);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage storage, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(storage));
  impl->set_storage_offset(offset);
  impl->set_sizes_and_strides(size, stride);
  ensure_storage(self);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes()) / self.element_size();
  return set_storage(self, std::move(source), 0, {n}, {1});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

// Host <-> device and device <-> device copies: the device side is read through its readable mapping.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor src_host = self.device().type() == kType ? host_view(self) : self;
  at::Tensor dst_host = dst.device().type() == kType ? host_view(dst) : dst;
  TORCH_CHECK(src_host.is_cpu() && dst_host.is_cpu(), "simdev: copies only between simdev and the host, not ",
              self.device(), " -> ", dst.device());
  dst_host.copy_(src_host, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) { return at::_local_scalar_dense(host_view(self)); }

// dropout draws its mask from the simdev generator (torch's CPU kernel would use the host's default generator)
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0 || (train.has_value() && !*train) || p == 0) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  const double p1m = 1. - p;
  const double scale = p1m == 0 ? 0. : 1. / p1m;
  at::Tensor mask = at::empty_like(input);
  mask.bernoulli_(p1m);
  at::Tensor output = input.mul(mask).mul_(scale);
  return {output, mask.to(at::kBool)};
}

bool is_generator(const c10::Argument& arg) {
  auto t = arg.type();
  if (t->kind() == c10::TypeKind::OptionalType) t = t->castRaw<c10::OptionalType>()->getElementType();
  return t->kind() == c10::TypeKind::GeneratorType;
}

// The simdev device an op runs on: its first simdev tensor argument, else its device argument.
c10::DeviceIndex op_device(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& v = stack[first + i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kType) {
      return v.toTensor().device().index();
    }
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (t.defined() && t.device().type() == kType) return t.device().index();
      }
    }
    if (v.isDevice() && v.toDevice().type() == kType && v.toDevice().has_index()) return v.toDevice().index();
  }
  return current_device();
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  // Random ops draw from the simdev generator: the CPU kernel gets the CPU generator that holds its state.
  for (size_t i = 0; i < n; ++i) {
    if (!is_generator(schema.arguments()[i])) continue;
    auto& v = (*stack)[first + i];
    if (v.isNone()) {
      v = c10::IValue(cpu_generator_of(default_generator(op_device(schema, *stack, first))));
    } else if (v.toGenerator().device().type() == kType) {
      v = c10::IValue(cpu_generator_of(v.toGenerator()));
    }
  }
  c10::DeviceGuard guard(c10::Device(kType, op_device(schema, *stack, first)));
  at::native::cpu_fallback(op, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("native_dropout", native_dropout);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

}  // namespace simdev
