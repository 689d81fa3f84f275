// Device memory of simdev: every block is a memfd mapped twice (PROT_NONE for the tensor, read-write for the
// runtime), a per-device capacity, CUDA-like counters and a cache of freed blocks (reserved >= allocated).
#include "runtime.h"

#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace simdev {
namespace {

struct Block {
  char* device = nullptr;  // PROT_NONE mapping: what data_ptr() returns
  char* alias = nullptr;   // read-write mapping of the same pages
  size_t size = 0;         // page-rounded
  c10::DeviceIndex index = 0;
};

struct DeviceMemory {
  MemoryStats stats;
  std::unordered_map<size_t, std::vector<Block*>> cache;  // freed blocks by size, reused before mapping new ones
};

std::mutex mu;
std::map<uintptr_t, Block*> live;  // device address -> block (for device_alias on interior pointers)
std::vector<DeviceMemory>* devices_ = nullptr;

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

int64_t capacity_bytes() {
  const char* env = std::getenv("SIMDEV_MEMORY_GB");
  double gb = 8.0;
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    gb = std::strtod(env, &end);
    TORCH_CHECK(end != env && *end == '\0' && gb > 0, "SIMDEV_MEMORY_GB=", env,
                " is not a positive number of GiB; set it like SIMDEV_MEMORY_GB=0.5");
  }
  return static_cast<int64_t>(gb * (1ull << 30));
}

std::vector<DeviceMemory>& devices() {  // under mu
  if (devices_ == nullptr) {
    devices_ = new std::vector<DeviceMemory>(device_count());  // leaked: blocks may be freed at exit
    const int64_t cap = capacity_bytes();
    for (auto& d : *devices_) d.stats.capacity = cap;
  }
  return *devices_;
}

std::string gib(int64_t bytes) {
  char buf[64];
  if (bytes >= (1ll << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", bytes / double(1ll << 30));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", bytes / double(1ll << 20));
  }
  return buf;
}

Block* map_block(size_t size, c10::DeviceIndex index) {
  int fd = memfd_create("simdev", MFD_CLOEXEC);
  TORCH_CHECK(fd >= 0, "simdev: memfd_create failed: ", std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    TORCH_CHECK(false, "simdev: ftruncate failed: ", std::strerror(errno));
  }
  void* dev = mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd, 0);
  void* alias = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mappings keep the pages
  TORCH_CHECK(dev != MAP_FAILED && alias != MAP_FAILED, "simdev: mmap failed: ", std::strerror(errno));
  return new Block{static_cast<char*>(dev), static_cast<char*>(alias), size, index};
}

void unmap_block(Block* b) {
  munmap(b->device, b->size);
  munmap(b->alias, b->size);
  delete b;
}

void release_cache(DeviceMemory& d) {  // under mu
  for (auto& [size, blocks] : d.cache) {
    for (Block* b : blocks) {
      d.stats.reserved -= static_cast<int64_t>(b->size);
      unmap_block(b);
    }
  }
  d.cache.clear();
}

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  std::lock_guard<std::mutex> lock(mu);
  live.erase(reinterpret_cast<uintptr_t>(b->device));
  auto& d = devices()[b->index];
  d.stats.allocated -= static_cast<int64_t>(b->size);
  d.cache[b->size].push_back(b);  // stays reserved until empty_cache()
}

class SimdevAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex index = current_device();
    const c10::Device device(kType, index);
    if (nbytes == 0) return {nullptr, nullptr, &free_block, device};
    const size_t size = (nbytes + page_size() - 1) / page_size() * page_size();
    std::lock_guard<std::mutex> lock(mu);
    auto& d = devices()[index];
    Block* b = nullptr;
    auto it = d.cache.find(size);
    if (it != d.cache.end() && !it->second.empty()) {
      b = it->second.back();
      it->second.pop_back();
    } else {
      if (d.stats.reserved + static_cast<int64_t>(size) > d.stats.capacity) release_cache(d);
      if (d.stats.allocated + static_cast<int64_t>(size) > d.stats.capacity) {
        d.stats.num_ooms++;
        const int64_t free = d.stats.capacity - d.stats.reserved;
        // worded like CUDA's message, so tools that parse it (and people) recognise it
        TORCH_CHECK_WITH(OutOfMemoryError, false, "simdev out of memory. Tried to allocate ", gib(size),
                         ". simdev ", int(index), " has a total capacity of ", gib(d.stats.capacity), " of which ",
                         gib(free < 0 ? 0 : free), " is free. Of the allocated memory ", gib(d.stats.allocated),
                         " is allocated by PyTorch, and ", gib(d.stats.reserved - d.stats.allocated),
                         " is reserved by PyTorch but unallocated. (simdev is a software device; its capacity is "
                         "SIMDEV_MEMORY_GB)");
      }
      b = map_block(size, index);
      d.stats.reserved += static_cast<int64_t>(size);
      d.stats.peak_reserved = std::max(d.stats.peak_reserved, d.stats.reserved);
    }
    d.stats.allocated += static_cast<int64_t>(size);
    d.stats.peak_allocated = std::max(d.stats.peak_allocated, d.stats.allocated);
    d.stats.num_allocs++;
    live[reinterpret_cast<uintptr_t>(b->device)] = b;
    return {b->device, b, &free_block, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(device_alias(dest), device_alias(src), count);
  }
};

}  // namespace

c10::Allocator* allocator() {
  static SimdevAllocator a;
  return &a;
}

void* device_alias(const void* ptr) {
  if (ptr == nullptr) return nullptr;
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu);
  auto it = live.upper_bound(p);
  TORCH_CHECK(it != live.begin(), "simdev: address ", ptr, " is not simdev device memory");
  --it;
  Block* b = it->second;
  TORCH_CHECK(p <= it->first + b->size, "simdev: address ", ptr, " is not simdev device memory");
  return b->alias + (p - it->first);
}

c10::DeviceIndex device_of(const void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu);
  auto it = live.upper_bound(p);
  if (it == live.begin()) return current_device();
  --it;
  return p <= it->first + it->second->size ? it->second->index : current_device();
}

at::Tensor host_view(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.device().type() == kType);
  if (t.storage().nbytes() == 0) {
    return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kCPU));
  }
  // a non-owning CPU storage over the whole block, so the view keeps the tensor's storage offset and strides
  // (CPU kernels then take exactly the paths they take on the host) and its data pointer names the device storage
  c10::Storage storage(c10::Storage::use_byte_size_t(), t.storage().nbytes(),
                       c10::DataPtr(device_alias(t.storage().data()), c10::Device(c10::kCPU)), nullptr, false);
  return at::empty({0}, t.options().device(at::kCPU)).set_(storage, t.storage_offset(), t.sizes(), t.strides());
}

MemoryStats memory_stats(c10::DeviceIndex index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu);
  return devices()[index].stats;
}

void reset_peak_memory_stats(c10::DeviceIndex index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu);
  auto& s = devices()[index].stats;
  s.peak_allocated = s.allocated;
  s.peak_reserved = s.reserved;
}

void empty_cache() {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& d : devices()) release_cache(d);
}

void resize_bytes(const c10::Storage& storage, size_t newsize) {
  c10::Storage s = storage;
  const size_t old = s.nbytes();
  c10::DataPtr fresh;
  {
    c10::DeviceGuard guard(s.device());
    fresh = allocator()->allocate(newsize);
  }
  const size_t n = std::min(old, newsize);
  if (n > 0) std::memcpy(device_alias(fresh.get()), device_alias(s.data()), n);
  s.set_data_ptr_noswap(std::move(fresh));
  s.set_nbytes(newsize);
}

// --- pinned host memory: plain host memory the runtime remembers, so is_pinned() is true ---
namespace {
std::mutex pin_mu;
std::unordered_map<void*, size_t> pinned;

void free_pinned(void* p) {
  {
    std::lock_guard<std::mutex> lock(pin_mu);
    pinned.erase(p);
  }
  std::free(p);
}

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = nbytes ? std::aligned_alloc(64, (nbytes + 63) / 64 * 64) : nullptr;
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(pin_mu);
      pinned[p] = nbytes;
    }
    return {p, p, &free_pinned, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
}  // namespace

c10::Allocator* pinned_allocator() {
  static PinnedAllocator a;
  return &a;
}

bool is_pinned(const void* ptr) {
  std::lock_guard<std::mutex> lock(pin_mu);
  return pinned.count(const_cast<void*>(ptr)) > 0;
}

}  // namespace simdev
