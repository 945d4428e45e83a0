// Devices, streams and events (the device guard), and the PrivateUse1 hooks.
//
// Kernels run synchronously on the calling thread, so a stream is only an identity: the
// current stream per thread and device (as CUDA's), and a clock in the race detector.
// Queries always answer "done"; synchronisations tell the detector what the host waited for.
#include "zdev.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Storage.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstring>

namespace zdev {
namespace {

thread_local c10::DeviceIndex this_device = 0;
thread_local std::array<c10::StreamId, kDeviceCount> this_stream{};
std::array<std::atomic<c10::StreamId>, kDeviceCount> next_stream_id{};

c10::DeviceIndex checked(c10::DeviceIndex device) {
  if (device < 0) return this_device;
  TORCH_CHECK(device < kDeviceCount, "zdev: device index ", static_cast<int>(device),
              " is out of range: there are ", static_cast<int>(kDeviceCount), " zdev devices");
  return device;
}

c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, device), id);
}

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }

  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::DeviceIndex old = this_device;
    this_device = checked(device.index());
    return c10::Device(c10::DeviceType::PrivateUse1, old);
  }

  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::PrivateUse1, this_device);
  }

  void setDevice(c10::Device device) const override { this_device = checked(device.index()); }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < kDeviceCount) this_device = device.index();
  }

  c10::Stream getStream(c10::Device device) const override {
    return current_stream(device.index());
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    return make_stream(checked(device.index()), 0);
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    const c10::DeviceIndex index = checked(device.index());
    return make_stream(index, ++next_stream_id[index]);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*high_priority*/) const override {
    return getNewStream(device, 0);
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    const c10::DeviceIndex index = checked(stream.device_index());
    const c10::Stream old = make_stream(index, this_stream[index]);
    this_stream[index] = stream.id();
    return old;
  }

  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }

  void destroyEvent(void* event, const c10::DeviceIndex /*device*/) const noexcept override {
    if (event != nullptr) detector::event_destroy(event);
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(device == -1 || device == stream.device_index(), "zdev: an event of zdev:",
                static_cast<int>(device), " cannot be recorded on a stream of zdev:",
                static_cast<int>(stream.device_index()));
    if (*event == nullptr) *event = detector::event_create();
    detector::event_record(*event, stream);
  }

  void block(void* event, const c10::Stream& stream) const override {
    if (event != nullptr) detector::event_block(event, stream);
  }

  bool queryEvent(void* /*event*/) const override { return true; }

  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }

  void synchronizeStream(const c10::Stream& stream) const override {
    detector::host_sync_stream(stream, detector::kSyncStream);
  }

  void synchronizeEvent(void* event) const override {
    if (event != nullptr) detector::event_synchronize(event);
  }

  void synchronizeDevice(const c10::DeviceIndex device) const override {
    detector::host_sync_device(checked(device));
  }

  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override {
    if (const Block* block = block_of(data)) detector::record_stream(block, stream);
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device*/) const override {
    return detector::event_elapsed_ms(start, end);
  }
};

// Random numbers on zdev come from the CPU generator: the CPU fallback runs the CPU
// kernels with it, so a zdev run draws exactly what a CPU run seeded the same way draws.
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*device*/) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return kDeviceCount; }
  void setCurrentDevice(c10::DeviceIndex device) const override { set_device(device); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex old = current_device();
    set_device(device);
    return old;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }

  at::Device getDeviceFromPtr(void* data) const override {
    const Block* block = block_containing(data);
    TORCH_CHECK(block != nullptr, "zdev: ", data, " is not zdev memory");
    return at::Device(c10::DeviceType::PrivateUse1, block->device);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device*/) const override {
    return at::detail::getDefaultCPUGenerator();
  }

  at::Generator getNewGenerator(c10::DeviceIndex /*device*/) const override {
    return at::detail::createCPUGenerator();
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override;
};

Hooks hooks;

}  // namespace

c10::DeviceIndex current_device() { return this_device; }

void set_device(c10::DeviceIndex device) { this_device = checked(device); }

c10::Stream current_stream(c10::DeviceIndex device) {
  const c10::DeviceIndex index = checked(device);
  return make_stream(index, this_stream[index]);
}

void register_hooks() { at::RegisterPrivateUse1HooksInterface(&hooks); }

// Storage.resize_: new memory on the storage's device, the old bytes copied in by a
// kernel on the current stream (reads the old allocation, writes the new one).
void Hooks::resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const {
  TORCH_CHECK(storage.resizable(), "zdev: this storage is not resizable");
  const c10::DeviceIndex device = storage.device().index();
  const c10::DeviceIndex previous = current_device();
  set_device(device);
  c10::DataPtr fresh = device_allocator()->allocate(nbytes);
  set_device(previous);
  const size_t kept = std::min(nbytes, storage.nbytes());
  const Block* from = block_of(storage.data_ptr());
  const Block* to = block_of(fresh);
  if (kept > 0 && from != nullptr && to != nullptr) {
    detector::kernel("UntypedStorage.resize_", {detector::whole(from, false), detector::whole(to, true)},
                     current_stream(device));
    std::memcpy(to->host, from->host, kept);
  }
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(nbytes);
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

}  // namespace zdev
