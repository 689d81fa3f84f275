// Devices, the device guard (with streams and events), the per-device generators and the PrivateUse1 hooks.
#include "runtime.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace simdev {

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex n = [] {
    const char* env = std::getenv("SIMDEV_DEVICES");
    if (env == nullptr || *env == '\0') return c10::DeviceIndex(2);
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    TORCH_CHECK(end != env && *end == '\0' && v >= 1 && v <= 64, "SIMDEV_DEVICES=", env,
                " is not a device count from 1 to 64; set it like SIMDEV_DEVICES=2");
    return static_cast<c10::DeviceIndex>(v);
  }();
  return n;
}

namespace {
thread_local c10::DeviceIndex current = 0;
// the current stream id of each device, per thread (as torch does for CUDA)
thread_local std::vector<c10::StreamId> current_streams;
std::atomic<c10::StreamId> next_stream{1};

c10::StreamId& current_stream_id(c10::DeviceIndex index) {
  if (current_streams.size() < static_cast<size_t>(device_count())) current_streams.resize(device_count(), 0);
  return current_streams[index];
}

// An event: the time it was recorded (work on simdev is synchronous, so a recorded event is complete).
struct Event {
  std::chrono::steady_clock::time_point at;
  bool recorded = false;
};
}  // namespace

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "simdev:", int(index), " does not exist: this process has ",
              int(device_count()), " simdev device(s) (SIMDEV_DEVICES)");
}

c10::DeviceIndex current_device() { return current; }

void set_device(c10::DeviceIndex index) {
  check_index(index);
  current = index;
}

namespace {

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(kType, current);
    if (d.index() >= 0) set_device(d.index());
    return old;
  }
  c10::Device getDevice() const override { return {kType, current}; }
  void setDevice(c10::Device d) const override {
    if (d.index() >= 0) set_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) current = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    const auto idx = d.index() < 0 ? current : d.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, idx), current_stream_id(idx));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kType, d.index() < 0 ? current : d.index()));
  }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, d.index() < 0 ? current : d.index()),
                       next_stream++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority = false) const override {
    return getNewStream(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto& id = current_stream_id(s.device_index());
    c10::Stream old(c10::Stream::UNSAFE, s.device(), id);
    id = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override { delete static_cast<Event*>(event); }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    e->at = std::chrono::steady_clock::now();
    e->recorded = true;
  }
  void block(void*, const c10::Stream&) const override {}  // everything already ran: nothing to wait for
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void* a, void* b, const c10::DeviceIndex) const override {
    auto* e1 = static_cast<Event*>(a);
    auto* e2 = static_cast<Event*>(b);
    TORCH_CHECK(e1 && e2 && e1->recorded && e2->recorded, "simdev: both events must be recorded before elapsed_time");
    return std::chrono::duration<double, std::milli>(e2->at - e1->at).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl)

// A generator of device simdev:i whose state is a CPU (mt19937 + Philox-free) generator: the fallback hands that
// CPU generator to the CPU kernels, so simdev draws exactly what the CPU draws from the same seed.
struct Generator final : public c10::GeneratorImpl {
  explicit Generator(c10::DeviceIndex index, at::Generator cpu = at::make_generator<at::CPUGeneratorImpl>())
      : c10::GeneratorImpl(c10::Device(kType, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(std::move(cpu)) {}
  void set_current_seed(uint64_t seed) override { cpu_.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu_.set_offset(offset); }
  uint64_t get_offset() const override { return cpu_.get_offset(); }
  uint64_t current_seed() const override { return cpu_.current_seed(); }
  uint64_t seed() override { return cpu_.seed(); }
  void set_state(const c10::TensorImpl& state) override { cpu_.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return cpu_.unsafeGetGeneratorImpl()->get_state(); }
  Generator* clone_impl() const override { return new Generator(device().index(), cpu_.clone()); }
  at::Generator cpu_;
};

std::once_flag gens_once;
std::vector<at::Generator>* gens = nullptr;

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  std::call_once(gens_once, [] {
    gens = new std::vector<at::Generator>();
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      gens->push_back(at::make_generator<Generator>(i));
      gens->back().set_current_seed(c10::detail::getNonDeterministicRandom());
    }
  });
  if (index < 0) index = current;
  check_index(index);
  return (*gens)[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  return at::make_generator<Generator>(index < 0 ? current : index);
}

at::Generator cpu_generator_of(const at::Generator& gen) {
  auto* impl = dynamic_cast<Generator*>(gen.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl != nullptr, "simdev: expected a simdev generator, got one of device ", gen.device());
  return impl->cpu_;
}

namespace {

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index = -1) const override { return new_generator(index); }
  at::Device getDeviceFromPtr(void* data) const override { return {kType, device_of(data)}; }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex index) const override { set_device(index); }
  c10::DeviceIndex getCurrentDevice() const override { return current; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    auto old = current;
    set_device(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override { return exchangeDevice(index); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_bytes(storage, newsize);
  }
};

}  // namespace

void register_cpu_kernel_choices();

void register_runtime() {
  static bool done = [] {
    register_cpu_kernel_choices();
    at::RegisterPrivateUse1HooksInterface(new Hooks());
    c10::SetAllocator(kType, allocator());
    return true;
  }();
  (void)done;
}

}  // namespace simdev
