// Device memory the host cannot read or write, and pinned host memory.
//
// A device allocation gets an address range inside a PROT_NONE reservation (never
// mapped, never reused) and separate backing memory. torch only ever sees the address:
// a host dereference faults as device memory would, and only the copy routines, which
// translate addresses to backing memory, move bytes. Nothing is ever mprotect-ed after
// the reservation, so no thread can race another on page protections.
#include "zdev.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace zdev {
namespace {

constexpr size_t kReservation = size_t{1} << 40;  // address space only: nothing is mapped
constexpr size_t kAlignment = 512;                  // as cudaMalloc's

struct Reservation {
  uintptr_t next = 0;
  uintptr_t end = 0;
};

std::mutex mutex;
Reservation reservation;
std::map<uintptr_t, Block*> blocks;  // by address
std::atomic<uint64_t> next_id{1};
std::atomic<int64_t> allocated[kDeviceCount];

uintptr_t reserve(size_t nbytes) {
  // A gap after each block keeps a one-past-the-end pointer out of the next block.
  const size_t span = (nbytes + 2 * kAlignment - 1) / kAlignment * kAlignment;
  if (reservation.next + span > reservation.end) {
    void* base = mmap(nullptr, kReservation, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    TORCH_CHECK(base != MAP_FAILED, "zdev: cannot reserve device address space: ", strerror(errno));
    reservation.next = reinterpret_cast<uintptr_t>(base);
    reservation.end = reservation.next + kReservation;
    TORCH_CHECK(span <= kReservation, "zdev: an allocation of ", nbytes, " bytes is too large");
  }
  const uintptr_t address = reservation.next;
  reservation.next += span;
  return address;
}

void free_device(void* context) {
  auto* block = static_cast<Block*>(context);
  detector::on_free(block);
  {
    std::lock_guard<std::mutex> lock(mutex);
    blocks.erase(block->address);
  }
  allocated[block->device] -= static_cast<int64_t>(block->nbytes);
  std::free(block->host);
  delete block;
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    const c10::Device where(c10::DeviceType::PrivateUse1, device);
    if (nbytes == 0) return c10::DataPtr(nullptr, where);
    void* host = nullptr;
    TORCH_CHECK(posix_memalign(&host, 64, nbytes) == 0, "zdev: out of memory allocating ", nbytes,
                " bytes on zdev:", static_cast<int>(device));
    auto* block = new Block{next_id++, device, nbytes, 0, host};
    {
      std::lock_guard<std::mutex> lock(mutex);
      block->address = reserve(nbytes);
      blocks[block->address] = block;
    }
    allocated[device] += static_cast<int64_t>(nbytes);
    detector::on_alloc(block, current_stream(device));
    return c10::DataPtr(reinterpret_cast<void*>(block->address), block, &free_device, where);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    Block* to = block_containing(dest);
    Block* from = block_containing(src);
    TORCH_CHECK(to && from, "zdev: Allocator::copy_data between non-device pointers");
    std::memcpy(static_cast<char*>(to->host) + (reinterpret_cast<uintptr_t>(dest) - to->address),
                static_cast<char*>(from->host) + (reinterpret_cast<uintptr_t>(src) - from->address),
                count);
  }
};

// Pinned host memory: ordinary page-aligned memory, remembered so that is_pinned() and
// non-blocking copies can tell it from pageable memory.
std::mutex pinned_mutex;
std::map<uintptr_t, size_t> pinned;

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  std::free(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return c10::DataPtr(nullptr, cpu);
    void* ptr = nullptr;
    TORCH_CHECK(posix_memalign(&ptr, 4096, nbytes) == 0, "zdev: out of pinned memory (", nbytes,
                " bytes)");
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned[reinterpret_cast<uintptr_t>(ptr)] = nbytes;
    }
    return c10::DataPtr(ptr, ptr, &free_pinned, cpu);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

DeviceAllocator device_memory;
PinnedAllocator pinned_memory;

}  // namespace

c10::Allocator* device_allocator() { return &device_memory; }

c10::Allocator* pinned_allocator() { return &pinned_memory; }

bool is_pinned(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto after = pinned.upper_bound(address);
  if (after == pinned.begin()) return false;
  --after;
  return address < after->first + after->second;
}

Block* block_of(const c10::DataPtr& ptr) {
  if (ptr.get_deleter() != &free_device) return nullptr;
  return static_cast<Block*>(ptr.get_context());
}

Block* block_containing(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mutex);
  auto after = blocks.upper_bound(address);
  if (after == blocks.begin()) return nullptr;
  --after;
  Block* block = after->second;
  return address < block->address + block->nbytes ? block : nullptr;
}

int64_t memory_allocated(c10::DeviceIndex device) {
  TORCH_CHECK(device >= 0 && device < kDeviceCount, "zdev: no device ", static_cast<int>(device));
  return allocated[device].load();
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &device_memory)

}  // namespace zdev
