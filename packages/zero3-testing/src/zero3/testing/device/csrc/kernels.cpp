// The aten kernels zdev implements itself, the CPU fallback for every other operator,
// and the zdev:: operators the Python side calls (torch.ops.zdev.*).
//
// Every kernel tells the race detector what it reads and writes on which stream before
// it runs. Copies between host and device are where the host synchronises: a blocking
// copy (and .item()) waits for the current stream, a non-blocking one does not.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "zdev.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>

namespace zdev {
namespace {

// Set while the CPU fallback runs an operator: its copies to and from the device are
// part of that one kernel (already checked), not host transfers of their own.
struct FallbackScope {
  static thread_local const FallbackScope* active;
  c10::Stream stream;
  uint64_t tick;
  std::string what;
  const FallbackScope* outer;

  FallbackScope(c10::Stream s, uint64_t t, std::string name)
      : stream(s), tick(t), what(std::move(name)), outer(active) {
    active = this;
  }
  ~FallbackScope() { active = outer; }
};
thread_local const FallbackScope* FallbackScope::active = nullptr;

bool on_zdev(const at::Tensor& t) { return t.defined() && t.device().is_privateuseone(); }

const Block* block_or_null(const at::Tensor& t) {
  return on_zdev(t) && t.storage() ? block_of(t.storage().data_ptr()) : nullptr;
}

// The bytes of its block a tensor spans (lowest to highest element; strides >= 0).
std::optional<detector::Access> access_of(const at::Tensor& t, bool write) {
  const Block* block = block_or_null(t);
  if (block == nullptr) return std::nullopt;
  if (t.numel() == 0) return detector::Access{block, write, 0, 0};
  size_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    extent += static_cast<size_t>(t.size(d) - 1) * static_cast<size_t>(std::abs(t.stride(d)));
  }
  const size_t begin = reinterpret_cast<uintptr_t>(t.data_ptr()) - block->address;
  return detector::Access{block, write, begin, begin + extent * t.element_size()};
}

// The accesses of some tensors (those without device memory left out).
std::vector<detector::Access> accesses_of(
    std::initializer_list<std::pair<const at::Tensor*, bool>> tensors) {
  std::vector<detector::Access> out;
  for (const auto& [tensor, write] : tensors) {
    if (auto access = access_of(*tensor, write)) out.push_back(*access);
  }
  return out;
}

// A CPU tensor over the device tensor's backing memory (same sizes, strides, offset).
at::Tensor host_alias(const at::Tensor& t) {
  auto options = t.options().device(c10::DeviceType::CPU);
  if (t.numel() == 0 || t.storage().data() == nullptr) {
    return at::empty_strided(t.sizes(), t.strides(), options);
  }
  const Block* block = block_of(t.storage().data_ptr());
  TORCH_CHECK(block != nullptr, "zdev: a zdev tensor whose memory zdev did not allocate");
  const auto offset = reinterpret_cast<uintptr_t>(t.data_ptr()) - block->address;
  return at::from_blob(static_cast<char*>(block->host) + offset, t.sizes(), t.strides(), options);
}

std::string op_name(const c10::OperatorHandle& op) {
  const auto& name = op.schema().operator_name();
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

// -- memory and metadata kernels ------------------------------------------------------------

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  const c10::Device where = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "zdev supports strided tensors only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "zdev: only CPU memory can be pinned");
  const c10::DeviceGuard guard(where);
  return at::detail::empty_generic(size, device_allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  const c10::Device where = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "zdev supports strided tensors only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "zdev: only CPU memory can be pinned");
  const c10::DeviceGuard guard(where);
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> offset) {
  std::optional<int64_t> plain;
  if (offset.has_value()) plain = offset->expect_int();
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size),
                                           C10_AS_INTARRAYREF_SLOW(stride), plain);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);  // device-generic: via as_strided
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(C10_AS_INTARRAYREF_SLOW(size));
  if (memory_format.has_value() && *memory_format != c10::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  const size_t needed = impl->numel() == 0
      ? 0 : (impl->storage_offset() + impl->numel()) * self.dtype().itemsize();
  const c10::Storage& storage = impl->unsafe_storage();
  if (needed > storage.nbytes()) {
    at::detail::getPrivateUse1Hooks().resizePrivateUse1Bytes(storage, needed);
  }
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  TORCH_CHECK(source.device() == self.device(), "zdev: set_ with a storage on ", source.device(),
              " into a tensor on ", self.device());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  impl->set_sizes_and_strides(size, stride);
  return self;
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                                      c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return set_storage(self, std::move(source), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                     C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {1});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  const c10::DeviceGuard guard(self.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, device_allocator(), true);
  return set_storage(self, std::move(storage), 0, {0}, {});
}

// -- copies ------------------------------------------------------------------------------------

void record_fallback_write(const at::Tensor& dst) {
  const FallbackScope* scope = FallbackScope::active;
  if (auto access = access_of(dst, true)) {
    detector::write_at(*access, scope->stream, scope->tick, scope->what);
  }
}

// Device-to-device copies across devices order both devices' current streams around the
// copy (as CUDA's copy_ does), so neither side needs its own wait.
void copy_between_devices(const at::Tensor& src, const at::Tensor& dst) {
  const c10::Stream from = current_stream(src.device().index());
  const c10::Stream to = current_stream(dst.device().index());
  void* event = detector::event_create();
  detector::event_record(event, from);
  detector::event_block(event, to);
  detector::kernel("copy_ (zdev to zdev)", accesses_of({{&src, false}, {&dst, true}}), to);
  detector::event_record(event, to);
  detector::event_block(event, from);
  detector::event_destroy(event);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.sizes() == dst.sizes() || self.numel() == dst.numel(),
              "zdev: copy_ between tensors of sizes ", self.sizes(), " and ", dst.sizes());
  at::Tensor from = on_zdev(self) ? host_alias(self) : self;
  at::Tensor to = on_zdev(dst) ? host_alias(dst) : dst;
  if (FallbackScope::active != nullptr) {
    to.copy_(from);
    record_fallback_write(dst);
    return dst;
  }
  if (on_zdev(self) && on_zdev(dst)) {
    if (self.device() == dst.device()) {
      detector::kernel("copy_ (zdev to zdev)", accesses_of({{&self, false}, {&dst, true}}),
                       current_stream(dst.device().index()));
    } else {
      copy_between_devices(self, dst);
    }
  } else if (on_zdev(dst)) {
    const c10::Stream stream = current_stream(dst.device().index());
    detector::kernel("copy_ (host to zdev)", accesses_of({{&dst, true}}), stream);
    if (!non_blocking) detector::host_sync_stream(stream, detector::kToDevice);
  } else {
    const c10::Stream stream = current_stream(self.device().index());
    detector::kernel("copy_ (zdev to host)", accesses_of({{&self, false}}), stream);
    if (!non_blocking) detector::host_sync_stream(stream, detector::kToHost);
  }
  to.copy_(from);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    resize_(dst, c10::fromIntArrayRefSlow(self.sizes()), std::nullopt);
  }
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  const c10::Stream stream = current_stream(self.device().index());
  detector::kernel("item (zdev to host)", accesses_of({{&self, false}}), stream);
  detector::host_sync_stream(stream, detector::kToHost);
  return host_alias(self).item();
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == c10::DeviceType::PrivateUse1,
              "zdev: record_stream needs a zdev stream, got a ", stream.device_type(), " stream");
  if (const Block* block = block_or_null(self)) detector::record_stream(block, stream);
}

// -- the CPU fallback --------------------------------------------------------------------------

// torch.cuda refuses a host tensor mixed with device tensors in one operator (0-dim host
// tensors excepted, as scalars; index lists may be host tensors). The fallback would
// otherwise move everything to the host and compute silently.
void check_devices(const c10::OperatorHandle& op, const std::vector<at::Tensor>& tensors,
                   const std::vector<bool>& in_index_list) {
  std::optional<c10::Device> device;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined() || (t.device().is_cpu() && (t.dim() == 0 || in_index_list[i]))) continue;
    if (!device) {
      device = t.device();
    } else if (*device != t.device()) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                  "devices, ", *device, " and ", t.device(), "! (when checking arguments for ",
                  op_name(op), ")");
    }
  }
}

void collect(const c10::IValue& value, bool write, bool index_list, std::vector<at::Tensor>& out,
             std::vector<bool>& writes, std::vector<bool>& index_lists) {
  auto add = [&](const at::Tensor& t) {
    out.push_back(t);
    writes.push_back(write);
    index_lists.push_back(index_list);
  };
  if (value.isTensor()) {
    add(value.toTensor());
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) add(t);
  } else if (value.isOptionalTensorList()) {
    for (const auto& t : value.toOptionalTensorVector()) {
      if (t.has_value()) add(*t);
    }
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  auto values = torch::jit::last(stack, arguments.size());
  const bool indexing = op.schema().name().rfind("aten::index", 0) == 0 ||
                        op.schema().name() == "aten::_index_put_impl_";
  std::vector<at::Tensor> tensors;
  std::vector<bool> writes, index_lists;
  std::optional<c10::Device> device;
  for (size_t i = 0; i < values.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    const bool list = values[i].isTensorList() || values[i].isOptionalTensorList();
    collect(values[i], alias != nullptr && alias->isWrite(), indexing && list, tensors, writes,
            index_lists);
    if (values[i].isDevice() && values[i].toDevice().is_privateuseone()) device = values[i].toDevice();
  }
  check_devices(op, tensors, index_lists);
  std::vector<detector::Access> accesses;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!on_zdev(tensors[i])) continue;
    if (!device) device = tensors[i].device();  // even an empty tensor (no memory yet)
    if (auto access = access_of(tensors[i], writes[i])) accesses.push_back(*access);
  }
  const c10::Device where = device.value_or(c10::Device(c10::DeviceType::PrivateUse1, current_device()));
  const c10::DeviceGuard guard(where);
  const c10::Stream stream = current_stream(where.index());
  const std::string what = op_name(op);
  const uint64_t tick = detector::kernel(what, accesses, stream);
  FallbackScope scope(stream, tick, what);
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

// -- the operators Python calls ----------------------------------------------------------------

c10::Stream stream_of(int64_t device, int64_t id) {
  return c10::Stream(c10::Stream::UNSAFE,
                     c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)),
                     id);
}

// A collective's own access to a tensor, on its comm stream: checked and recorded like a
// kernel's (gloo moves the bytes on the host, where no kernel sees them).
void comm_access(const at::Tensor& t, int64_t device, int64_t stream, bool write,
                 const std::string& what) {
  TORCH_CHECK(on_zdev(t), "zdev.comm_access: ", what, " is not a zdev tensor (it is on ",
              t.device(), ")");
  detector::kernel(what, accesses_of({{&t, write}}), stream_of(device, stream));
}

// The bytes of a device tensor, as a new contiguous host tensor, moved by the comm stream
// (no host synchronisation: the comm backend's access is recorded by comm_access).
at::Tensor comm_stage_out(const at::Tensor& t) {
  TORCH_CHECK(on_zdev(t), "zdev.comm_stage_out: expects a zdev tensor, got one on ", t.device());
  return host_alias(t).clone(at::MemoryFormat::Contiguous);
}

void comm_stage_in(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(on_zdev(dst) && src.device().is_cpu(),
              "zdev.comm_stage_in: expects a zdev destination and a host source");
  host_alias(dst).copy_(src);
}

// A raw host access to device memory, on purpose: a test that device memory faults.
int64_t poke(const at::Tensor& t) {
  TORCH_CHECK(on_zdev(t) && t.numel() > 0, "zdev.poke: expects a non-empty zdev tensor");
  return *static_cast<volatile const unsigned char*>(t.data_ptr());
}

void register_device_hooks() { register_hooks(); }

void stream_label(int64_t device, int64_t stream, const std::string& label) {
  detector::label_stream(stream_of(device, stream), label);
}

int64_t allocated(int64_t device) {
  return memory_allocated(static_cast<c10::DeviceIndex>(device));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", unfold);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY(zdev, m) {
  m.def("register_hooks() -> ()", register_device_hooks);
  m.def("detector_set_enabled(bool on) -> ()", [](bool on) { detector::set_enabled(on); });
  m.def("detector_enabled() -> bool", [] { return detector::enabled(); });
  m.def("detector_raise_pending() -> ()", [] { detector::raise_pending(); });
  m.def("detector_take_pending() -> str[]", [] { return detector::take_pending(); });
  m.def("host_sync_counts() -> int[]", [] { return detector::host_sync_counts(); });
  m.def("device_count() -> int", [] { return static_cast<int64_t>(kDeviceCount); });
  m.def("memory_allocated(int device) -> int", allocated);
  m.def("stream_label(int device, int stream, str label) -> ()", stream_label);
  m.def("comm_access(Tensor t, int device, int stream, bool write, str what) -> ()", comm_access);
  m.def("comm_stage_out(Tensor t) -> Tensor", comm_stage_out);
  m.def("comm_stage_in(Tensor(a!) dst, Tensor src) -> ()", comm_stage_in);
  m.def("poke(Tensor t) -> int", poke);
}

}  // namespace zdev
