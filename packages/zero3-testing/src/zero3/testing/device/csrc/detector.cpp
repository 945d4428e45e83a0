// The race detector: the algorithm of PyTorch's CUDA sanitizer, fed by the device itself.
//
// Every stream (and the host) keeps a vector clock: the last tick of every stream it is
// ordered after. A kernel ticks its stream; recording an event copies the stream's
// clock; waiting for an event merges it; a host synchronisation merges into the host's
// clock, and every kernel enqueued afterwards is ordered after the host. Per allocation
// the detector keeps the last write and the reads since; an access whose clock does not
// cover one of them (from another stream) is a race. Kernels run synchronously here, so
// the data is never wrong: the detector says where a real device would have raced.
#include "zdev.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace zdev::detector {
namespace {

using Clock = std::unordered_map<int64_t, uint64_t>;

// One access still relevant: a write, or a read since the last write over its bytes.
struct Touch {
  int64_t stream;
  uint64_t tick;
  std::string what;
  size_t begin;
  size_t end;
  bool write;
};

struct BlockState {
  int64_t home;  // the stream it was allocated on: its memory returns to that stream's pool
  uint64_t id;
  size_t nbytes;
  c10::DeviceIndex device;
  std::vector<Touch> touches;  // byte ranges: disjoint regions of one buffer do not race
  std::unordered_set<int64_t> recorded;  // record_stream: the allocator waits for these
};

struct Event {
  Clock clock;
  bool recorded = false;
  std::chrono::steady_clock::time_point when;
};

std::mutex mutex;
std::atomic<bool> on{true};
std::unordered_map<int64_t, Clock> streams;
std::unordered_map<int64_t, std::string> labels;
Clock host;
std::unordered_map<uint64_t, BlockState> blocks;
std::vector<std::string> pending;
std::atomic<int64_t> sync_counts[kSyncKinds];

int64_t key_of(c10::Stream stream) {
  return (static_cast<int64_t>(stream.device_index()) << 40) | (stream.id() & ((1LL << 40) - 1));
}

std::string stream_name(int64_t key) {
  auto found = labels.find(key);
  std::ostringstream out;
  out << "stream " << (key & ((1LL << 40) - 1)) << " of zdev:" << (key >> 40);
  if (found != labels.end()) {
    out << " (" << found->second << ")";
  } else if ((key & ((1LL << 40) - 1)) == 0) {
    out << " (the default stream)";
  }
  return out.str();
}

std::string block_name(const BlockState& state) {
  std::ostringstream out;
  out << "a " << state.nbytes << "-byte zdev:" << static_cast<int>(state.device)
      << " allocation (#" << state.id << ")";
  return out.str();
}

void merge(Clock& into, const Clock& from) {
  for (const auto& [stream, tick] : from) {
    auto& mine = into[stream];
    mine = std::max(mine, tick);
  }
}

uint64_t seen(const Clock& clock, int64_t stream) {
  auto found = clock.find(stream);
  return found == clock.end() ? 0 : found->second;
}

// The clock of the next work enqueued on `key`: ordered after what the host has seen.
Clock& enqueue(int64_t key) {
  Clock& clock = streams[key];
  merge(clock, host);
  return clock;
}

bool ordered(const Clock& clock, int64_t key, const Touch& touch) {
  return touch.stream == key || seen(clock, touch.stream) >= touch.tick;
}

[[noreturn]] void race(
    const std::string& what, int64_t key, bool write, const BlockState& state, const Touch& earlier,
    bool earlier_write) {
  std::ostringstream out;
  out << "zdev race detector: " << what << " on " << stream_name(key) << " "
      << (write ? "writes " : "reads ") << block_name(state) << ", "
      << (earlier_write ? "last written" : "read") << " on " << stream_name(earlier.stream)
      << " by " << earlier.what
      << ", and nothing ordered the two (no event or stream wait in between, no host "
      << "synchronisation). Make the second stream wait for the first (Work.wait(stream), "
      << "Stream.wait_stream, Stream.wait_event) before this access.";
  TORCH_CHECK(false, out.str());
}

bool overlap(const Touch& touch, size_t begin, size_t end) {
  return touch.begin < end && begin < touch.end;
}

void check(const std::string& what, int64_t key, const Clock& clock, const Access& access,
           const BlockState& state) {
  for (const Touch& touch : state.touches) {
    const bool conflict = touch.write || access.write;
    if (conflict && overlap(touch, access.begin, access.end) && !ordered(clock, key, touch)) {
      race(what, key, access.write, state, touch, touch.write);
    }
  }
}

// A write supersedes every touch inside its bytes (whatever is ordered after it is ordered
// after them); a read supersedes its own stream's earlier reads inside its bytes.
void note(BlockState& state, Touch touch) {
  auto superseded = [&](const Touch& old) {
    const bool inside = touch.begin <= old.begin && old.end <= touch.end;
    return inside && (touch.write || (!old.write && old.stream == touch.stream));
  };
  auto& touches = state.touches;
  touches.erase(std::remove_if(touches.begin(), touches.end(), superseded), touches.end());
  touches.push_back(std::move(touch));
}

}  // namespace

bool enabled() { return on.load(std::memory_order_relaxed); }

void set_enabled(bool value) {
  std::lock_guard<std::mutex> lock(mutex);
  on = value;
  if (!value) {
    for (auto& [id, state] : blocks) state.touches.clear();
  }
}

uint64_t kernel(const std::string& what, const std::vector<Access>& accesses, c10::Stream stream) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!pending.empty()) {
    std::string first = pending.front();
    pending.clear();
    TORCH_CHECK(false, first);
  }
  const int64_t key = key_of(stream);
  Clock& clock = enqueue(key);
  const uint64_t tick = ++clock[key];
  if (!on) return tick;
  for (const Access& access : accesses) {
    auto found = blocks.find(access.block->id);
    if (found != blocks.end()) check(what, key, clock, access, found->second);
  }
  for (const Access& access : accesses) {
    auto found = blocks.find(access.block->id);
    if (found != blocks.end() && access.begin < access.end) {
      note(found->second, Touch{key, tick, what, access.begin, access.end, access.write});
    }
  }
  return tick;
}

void write_at(const Access& access, c10::Stream stream, uint64_t tick, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex);
  auto found = blocks.find(access.block->id);
  if (on && found != blocks.end() && access.begin < access.end) {
    note(found->second, Touch{key_of(stream), tick, what, access.begin, access.end, true});
  }
}

void on_alloc(const Block* block, c10::Stream stream) {
  std::lock_guard<std::mutex> lock(mutex);
  blocks[block->id] = BlockState{key_of(stream), block->id, block->nbytes, block->device, {}, {}};
}

void on_free(const Block* block) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = blocks.find(block->id);
    if (found == blocks.end()) return;
    const BlockState& state = found->second;
    // The freed bytes go back to the pool of the stream they were allocated on: the next
    // allocation there may write them at once, so every other stream's use must be ordered
    // before that stream's next work, or covered by record_stream.
    Clock next = streams[state.home];
    merge(next, host);
    for (const Touch* touch = state.touches.data();
         touch != state.touches.data() + state.touches.size(); ++touch) {
      if (on && !ordered(next, state.home, *touch) && !state.recorded.count(touch->stream)) {
        std::ostringstream out;
        out << "zdev race detector: " << block_name(state) << " was freed (its memory back in "
            << "the pool of " << stream_name(state.home) << ") while " << stream_name(touch->stream)
            << " may still use it (" << touch->what << "), and that stream was neither waited "
            << "for nor recorded on the tensor. Call tensor.record_stream(stream), or make "
            << stream_name(state.home) << " wait for it, before the last reference goes.";
        pending.push_back(out.str());
        break;
      }
    }
    blocks.erase(found);
  } catch (...) {
    // A deallocation must not throw; the detector loses this one check at worst.
  }
}

void record_stream(const Block* block, c10::Stream stream) {
  std::lock_guard<std::mutex> lock(mutex);
  auto found = blocks.find(block->id);
  if (found != blocks.end()) found->second.recorded.insert(key_of(stream));
}

void host_sync_stream(c10::Stream stream, int kind) {
  std::lock_guard<std::mutex> lock(mutex);
  merge(host, streams[key_of(stream)]);
  sync_counts[kind]++;
}

void host_sync_device(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [key, clock] : streams) {
    if ((key >> 40) == device) merge(host, clock);
  }
  sync_counts[kSyncDevice]++;
}

void label_stream(c10::Stream stream, const std::string& label) {
  std::lock_guard<std::mutex> lock(mutex);
  labels[key_of(stream)] = label;
}

void raise_pending() {
  std::lock_guard<std::mutex> lock(mutex);
  if (pending.empty()) return;
  std::string first = pending.front();
  pending.clear();
  TORCH_CHECK(false, first);
}

std::vector<std::string> take_pending() {
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::string> out;
  out.swap(pending);
  return out;
}

std::vector<int64_t> host_sync_counts() {
  std::vector<int64_t> out;
  for (const auto& count : sync_counts) out.push_back(count.load());
  return out;
}

void* event_create() { return new Event(); }

void event_destroy(void* event) noexcept { delete static_cast<Event*>(event); }

void event_record(void* event, c10::Stream stream) {
  std::lock_guard<std::mutex> lock(mutex);
  auto* e = static_cast<Event*>(event);
  e->clock = enqueue(key_of(stream));
  e->recorded = true;
  e->when = std::chrono::steady_clock::now();
}

void event_block(void* event, c10::Stream stream) {
  std::lock_guard<std::mutex> lock(mutex);
  auto* e = static_cast<Event*>(event);
  if (e->recorded) merge(enqueue(key_of(stream)), e->clock);
}

void event_synchronize(void* event) {
  std::lock_guard<std::mutex> lock(mutex);
  auto* e = static_cast<Event*>(event);
  if (e->recorded) merge(host, e->clock);
  sync_counts[kSyncEvent]++;
}

double event_elapsed_ms(void* start, void* end) {
  auto* a = static_cast<Event*>(start);
  auto* b = static_cast<Event*>(end);
  TORCH_CHECK(a->recorded && b->recorded, "zdev: both events must be recorded before elapsed_time");
  return std::chrono::duration<double, std::milli>(b->when - a->when).count();
}

}  // namespace zdev::detector
