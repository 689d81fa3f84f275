// The ATen operators of simdev: memory and view ops natively, everything else by a boxed fallback that copies the
// arguments to the host, runs the CPU kernel and copies the results back (correctness, not speed).
#include "runtime.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
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

// scaled_dot_product_attention picks its kernel per device type; simdev computes with the CPU's kernels, so it
// takes the CPU's choice (flash attention for CPU where it applies), which the fallback then runs
int64_t sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                   double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  std::optional<at::Tensor> host_mask;
  if (mask.has_value() && mask->defined()) host_mask = mask->device().type() == kType ? host_view(*mask) : *mask;
  return at::_fused_sdp_choice(host_view(q), host_view(k), host_view(v), host_mask, dropout_p, is_causal, scale,
                               enable_gqa);
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

bool on_device(const at::Tensor& t) { return t.defined() && t.device().type() == kType; }

// One fallback call: simdev arguments become CPU views of the same bytes (no copies, the same strides), the CPU
// kernel runs on them, and results that are not views of an argument are copied to a new simdev tensor.
struct HostCall {
  std::vector<std::pair<const void*, at::Tensor>> bases;  // readable base -> the simdev tensor it belongs to

  at::Tensor in(const at::Tensor& t) {
    if (!on_device(t)) return t;
    at::Tensor h = host_view(t);
    if (t.storage().nbytes() > 0) bases.emplace_back(h.storage().data(), t);
    return h;
  }

  at::Tensor out(const at::Tensor& h, c10::DeviceIndex index) const {
    if (!h.defined() || h.device().type() != c10::kCPU) return h;
    for (const auto& [base, t] : bases) {
      if (h.storage().data() != base) continue;
      if (h.sizes() == t.sizes() && h.strides() == t.strides() && h.storage_offset() == t.storage_offset() &&
          h.dtype() == t.dtype()) {
        return t;  // an in-place or out= result: the argument itself
      }
      at::Tensor v = at::empty({0}, t.options().dtype(h.dtype()));
      return v.set_(t.storage(), h.storage_offset(), h.sizes(), h.strides());
    }
    c10::DeviceGuard guard(c10::Device(kType, index));
    at::Tensor d = h.is_non_overlapping_and_dense()
                       ? at::empty_strided(h.sizes(), h.strides(), h.options().device(kType))
                       : at::empty(h.sizes(), h.options().device(kType));
    host_view(d).copy_(h);
    return d;
  }
};

// The CPU kernel on host views of the arguments. Returns false, with the stack untouched, where an argument
// the op writes to is empty (an out= tensor the kernel would resize: a view's storage cannot grow), so the
// caller takes the copying path instead.
bool run_on_views(const c10::OperatorHandle& op, torch::jit::Stack* stack, c10::DeviceIndex index) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  for (size_t i = 0; i < n; ++i) {
    const auto& alias = schema.arguments()[i].alias_info();
    const auto& v = (*stack)[first + i];
    if (alias && alias->isWrite() && v.isTensor() && v.toTensor().numel() == 0) return false;
    if (alias && alias->isWrite() && v.isTensorList()) return false;
  }
  HostCall call;
  torch::jit::Stack host(stack->begin() + first, stack->end());
  for (auto& v : host) {
    if (v.isTensor()) {
      v = call.in(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const at::Tensor& t : v.toTensorList().vec()) l.push_back(call.in(t));
      v = l;
    } else if (v.isList() && v.toListRef().size() > 0 && v.type()->containedType(0)->kind() ==
               c10::TypeKind::OptionalType) {
      c10::List<std::optional<at::Tensor>> l;
      for (const auto& e : v.toListRef()) {
        l.push_back(e.isNone() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(call.in(e.toTensor())));
      }
      v = l;
    } else if (v.isDevice() && v.toDevice().type() == kType) {
      v = c10::Device(c10::kCPU);
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &host);
  stack->erase(stack->begin() + first, stack->end());
  for (auto& r : host) {
    if (r.isTensor()) {
      stack->push_back(call.out(r.toTensor(), index));
    } else if (r.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const at::Tensor& t : r.toTensorList().vec()) l.push_back(call.out(t, index));
      stack->push_back(l);
    } else {
      stack->push_back(r);
    }
  }
  return true;
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
  const c10::DeviceIndex index = op_device(schema, *stack, first);
  c10::DeviceGuard guard(c10::Device(kType, index));
  if (!run_on_views(op, stack, index)) at::native::cpu_fallback(op, stack);
}

}  // namespace

// Ops that have a CPU kernel and also a CompositeImplicitAutograd decomposition (silu_backward, ...) would run the
// decomposition on a backend without its own kernel, so simdev would compute something other than the CPU does.
// A real device registers its kernels for them; simdev registers the CPU-kernel fallback, where the op's
// autograd formula does not come from that decomposition (an Autograd kernel exists).
void register_cpu_kernel_choices() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                        __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNamesForDispatchKey(c10::DispatchKey::CPU)) {
    auto op = dispatcher.findOp(name);
    if (!op || name.name.rfind("aten::", 0) != 0) continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::Autograd)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    const std::string full = name.overload_name.empty() ? name.name.substr(6) : name.name.substr(6) + "." +
                                                                                   name.overload_name;
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

}  // namespace simdev

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &simdev::sdp_choice)
}

namespace simdev {

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
