// zdev: a simulated accelerator for zero3's tests (PrivateUse1, renamed "zdev").
//
// Three parts share this header:
//   memory.cpp   device memory the host cannot touch, pinned host memory
//   runtime.cpp  devices, streams, events, the device guard and the PrivateUse1 hooks
//   detector.cpp the race detector (vector clocks per stream, accesses per allocation)
//   kernels.cpp  the aten kernels, the CPU fallback and the zdev:: operators Python calls
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zdev {

constexpr c10::DeviceIndex kDeviceCount = 4;

// -- memory.cpp -------------------------------------------------------------------------

// One device allocation. `address` is what torch sees (inside a PROT_NONE reservation,
// so a host dereference faults); `host` is the backing memory the copy routines use.
struct Block {
  uint64_t id;
  c10::DeviceIndex device;
  size_t nbytes;
  uintptr_t address;
  void* host;
};

c10::Allocator* device_allocator();
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);
// The block a DataPtr made by the device allocator owns; nullptr for any other DataPtr.
Block* block_of(const c10::DataPtr& ptr);
// The block holding `ptr` (any address inside it); nullptr when it is not device memory.
Block* block_containing(const void* ptr);
int64_t memory_allocated(c10::DeviceIndex device);

// -- runtime.cpp ------------------------------------------------------------------------

c10::DeviceIndex current_device();
void set_device(c10::DeviceIndex device);
c10::Stream current_stream(c10::DeviceIndex device);
void register_hooks();

// -- detector.cpp -----------------------------------------------------------------------

namespace detector {

// The bytes ``[begin, end)`` of a block an operation touches (a tensor's span).
struct Access {
  const Block* block;
  bool write;
  size_t begin;
  size_t end;
};

// The access of a whole block.
inline Access whole(const Block* block, bool write) { return {block, write, 0, block->nbytes}; }

bool enabled();
void set_enabled(bool on);
// A kernel on `stream` touching `accesses`: raises on an unsynchronised access, else
// records them. Returns the kernel's tick on its stream (for writes made inside it).
uint64_t kernel(const std::string& what, const std::vector<Access>& accesses, c10::Stream stream);
// A write made inside a kernel already checked (the fallback's copies back to the device).
void write_at(const Access& access, c10::Stream stream, uint64_t tick, const std::string& what);
void on_alloc(const Block* block, c10::Stream stream);
void on_free(const Block* block) noexcept;
void record_stream(const Block* block, c10::Stream stream);
// The host waits for everything queued so far on `stream` (kind: a host_sync_counts slot).
void host_sync_stream(c10::Stream stream, int kind);
void host_sync_device(c10::DeviceIndex device);
void label_stream(c10::Stream stream, const std::string& label);
// Raises the first violation found where nothing could raise (a deallocation).
void raise_pending();
std::vector<std::string> take_pending();
std::vector<int64_t> host_sync_counts();

// Host synchronisation kinds counted by host_sync_counts(), in this order.
enum SyncKind : int { kSyncStream = 0, kSyncEvent, kSyncDevice, kToHost, kToDevice, kSyncKinds };

// Events: a point on a stream's clock.
void* event_create();
void event_destroy(void* event) noexcept;
void event_record(void* event, c10::Stream stream);
void event_block(void* event, c10::Stream stream);
void event_synchronize(void* event);
double event_elapsed_ms(void* start, void* end);

}  // namespace detector
}  // namespace zdev
