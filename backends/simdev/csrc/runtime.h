// simdev runtime: the device memory, the per-device RNG and the device guard of the simulated device.
//
// simdev is a software device (torch PrivateUse1 renamed "simdev"): nothing here is hardware. Its memory is host
// memory mapped twice: the address a tensor's data pointer holds is mapped PROT_NONE, so any host code that reads
// a simdev tensor directly (a CPU kernel, numpy, ctypes) faults at once, as it would on a real accelerator; the
// runtime itself copies and computes through a second, readable mapping of the same pages (device_alias).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace simdev {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

// number of simdev devices in this process ($SIMDEV_DEVICES, default 2)
c10::DeviceIndex device_count();
c10::DeviceIndex current_device();
void set_device(c10::DeviceIndex index);
void check_index(c10::DeviceIndex index);

// --- memory ---
struct MemoryStats {
  int64_t allocated = 0;       // bytes in live blocks (page-rounded, as the device holds them)
  int64_t reserved = 0;        // allocated + blocks cached for reuse
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  int64_t capacity = 0;        // $SIMDEV_MEMORY_GB
  int64_t num_allocs = 0;
  int64_t num_ooms = 0;
};

c10::Allocator* allocator();
MemoryStats memory_stats(c10::DeviceIndex index);
void reset_peak_memory_stats(c10::DeviceIndex index);
void empty_cache();
// The readable host address of device address `ptr` (which must lie in a simdev block), or nullptr for nullptr.
void* device_alias(const void* ptr);
// The device a simdev data pointer belongs to.
c10::DeviceIndex device_of(const void* ptr);
// A CPU tensor viewing the same bytes as simdev tensor `t` (same sizes, strides and offset), for the runtime's
// own kernels and copies.
at::Tensor host_view(const at::Tensor& t);

// --- RNG ---
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);
// The CPU generator whose state a simdev generator holds (what the CPU kernels of the fallback draw from).
at::Generator cpu_generator_of(const at::Generator& gen);

// --- pinned host memory ---
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);

// --- storage resize (PrivateUse1 hooks) ---
void resize_bytes(const c10::Storage& storage, size_t newsize);

}  // namespace simdev
