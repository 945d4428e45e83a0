"""DeviceTracker: a CPU stand-in for an accelerator's memory and streams (a test instrument).

Note:
    On a CPU-only machine device and host memory are the same, so the tracker labels each
    tensor with where it *would* live on an accelerator (by torch's rules for factories,
    ``device=`` objects and strings, and ops), orders reads against writes with one vector
    clock per :class:`RecordingStream`, and runs backward itself so that autograd's hooks
    are seen. The rules: docs/testing.rst, :ref:`testing-device-memory`,
    :ref:`testing-streams`, :ref:`testing-seeing-backward`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from zero3.comm import Event, Stream

__all__ = [
    "HOST_MEMORY",
    "MIXED_DEVICES",
    "STREAM_ORDER",
    "VALUE_READS",
    "DeviceTracker",
    "RecordingEvent",
    "RecordingStream",
    "Residence",
    "Violation",
    "caller_site",
    "in_transport",
    "residence_of_device",
    "run_backward_under",
]

#: Violation kinds.
HOST_MEMORY = "host-memory"
STREAM_ORDER = "stream-order"
MIXED_DEVICES = "mixed-devices"

# Nesting depth of transport code (a checked backend's own implementation): both
# instruments let it through unobserved. A list, so the modules share one counter.
_TRANSPORT = [0]

# Ops that move data between host and device memory legitimately (a copy), or only read
# metadata; everything else mixing the two fails on an accelerator.
_TRANSFERS = frozenset(
    {
        "copy_",
        "to",
        "cpu",
        "cuda",
        "npu",
        "type",
        "__setitem__",
        "__getitem__",
        "index_put_",
        "set_",
        "tensor",
        "as_tensor",
        "asarray",
        "new_tensor",
    }
)
# In-place ops that overwrite their target without reading it.
_WRITE_ONLY = frozenset(
    {"copy_", "zero_", "fill_", "set_", "normal_", "uniform_", "random_", "__setitem__"}
)
#: Ops returning no tensor that still read tensor data (the rest, ``numel()`` or
#: ``size()``, read metadata only). On a device each is a host synchronization.
VALUE_READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "__array__",
        "__format__",
        "__repr__",
        "__str__",
        "__contains__",
        "equal",
        "allclose",
        "is_nonzero",
    }
)
_NOT_INPLACE_DUNDERS = frozenset(
    {"__index__", "__int__", "__init__", "__iter__", "__invert__", "__instancecheck__"}
)

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIP_FILES = ("contextlib.py", "functools.py")


class Residence(enum.Enum):
    """Where a tensor would live on an accelerator machine."""

    DEVICE = "device"
    HOST = "host"


@dataclasses.dataclass(frozen=True)
class Violation:
    """Something a device run would reject or get wrong.

    Attributes:
        kind: :data:`HOST_MEMORY`, :data:`STREAM_ORDER` or :data:`MIXED_DEVICES`.
        message: What happened, where, and what to do instead.
    """

    kind: str
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


@contextlib.contextmanager
def _transport() -> Iterator[None]:
    _TRANSPORT[0] += 1
    try:
        yield
    finally:
        _TRANSPORT[0] -= 1


def in_transport() -> bool:
    """True while a checked backend's own implementation runs (nothing is observed)."""
    return _TRANSPORT[0] > 0


def caller_site() -> str:
    """``path:line (function)`` of the innermost frame outside torch and these instruments."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (
            path.startswith(_TORCH_DIR)
            or path.startswith(_HERE)
            or path.endswith(_SKIP_FILES)
            or path.startswith("<")
        ):
            marker = path.rfind(f"{os.sep}zero3{os.sep}")
            short = path[marker + 1 :] if marker >= 0 else os.path.basename(path)
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def residence_of_device(device: object) -> Residence:
    """Where a ``device=`` argument puts a new tensor (see the module note).

    ``None`` means torch's default device, the host unless ``torch.set_default_device``
    chose otherwise; a string naming ``cpu`` is the host; a ``torch.device`` object (from
    ``comm.device()`` or a tensor's ``.device``) or an accelerator index is the device.
    """
    if device is None:
        return Residence.HOST if torch.get_default_device().type == "cpu" else Residence.DEVICE
    if isinstance(device, str):
        return Residence.HOST if device.split(":")[0] == "cpu" else Residence.DEVICE
    return Residence.DEVICE


# -- running backward with a mode on the stack ---------------------------------------------------

_BACKWARD_SIGNATURES = {
    torch.Tensor.backward: inspect.signature(torch.Tensor.backward),
    torch.autograd.backward: inspect.signature(torch.autograd.backward),
}


def _engine_backward() -> Callable[..., Any]:
    try:
        from torch.autograd.graph import _engine_run_backward

        return _engine_run_backward
    except ImportError:  # torch before 2.3
        from torch.autograd.variable import Variable

        return Variable._execution_engine.run_backward


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(value)


def run_backward_under(
    mode: TorchFunctionMode,
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """Run ``Tensor.backward`` / ``torch.autograd.backward`` with ``mode`` active inside.

    Called from a mode's handler (where the mode is off the stack): see the module note.
    """
    bound = _BACKWARD_SIGNATURES[func].bind(*args, **kwargs)
    bound.apply_defaults()
    params = bound.arguments
    if func is torch.Tensor.backward:
        tensors: tuple[torch.Tensor, ...] = (params["self"],)
        grads: tuple[Any, ...] = (params["gradient"],)
    else:
        tensors = _as_tuple(params["tensors"])
        given = params["grad_tensors"] if params["grad_tensors"] is not None else None
        grads = _as_tuple(given) or (None,) * len(tensors)
    filled = []
    for tensor, grad in zip(tensors, grads, strict=True):
        if grad is None:
            if tensor.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            grad = torch.ones_like(tensor, memory_format=torch.preserve_format)
        filled.append(grad)
    create_graph = bool(params["create_graph"])
    retain = create_graph if params["retain_graph"] is None else bool(params["retain_graph"])
    inputs = _as_tuple(params["inputs"])
    with mode:
        _engine_backward()(
            tensors,
            tuple(filled),
            retain,
            create_graph,
            inputs,
            allow_unreachable=True,
            accumulate_grad=True,
        )


# -- streams ---------------------------------------------------------------------------------


class RecordingEvent(Event):
    """A point on a :class:`RecordingStream`: the clock of that stream when recorded."""

    def __init__(self, tracker: DeviceTracker, clock: dict[int, int], what: str) -> None:
        super().__init__(None)
        self._tracker = tracker
        self.clock = clock
        self._what = what

    def synchronize(self) -> None:
        self._tracker.host_wait(self.clock, f"event on {self._what}.synchronize()")

    def query(self) -> bool:
        return True


class RecordingStream(Stream):
    """A device stream modelled on CPU: records order, runs nothing (see the module note).

    Attributes:
        name: A label used in messages (``"compute"``, ``"checking-1"``...).
        index: Its position in the tracker's list of streams.
        seq: Number of ops issued on it so far.
        clock: For each other stream index, the last of its ops this stream waited for.
    """

    device_type = "cpu"

    def __init__(self, tracker: DeviceTracker, index: int, name: str) -> None:
        self._tracker = tracker
        self.index = index
        self.name = name
        self.seq = 0
        self.clock: dict[int, int] = {}

    def snapshot(self) -> dict[int, int]:
        """Its clock including its own position (what a waiter becomes ordered after)."""
        clock = dict(self.clock)
        clock[self.index] = self.seq
        return clock

    def merge(self, clock: Mapping[int, int]) -> None:
        """Become ordered after every op ``clock`` covers."""
        for stream, seq in clock.items():
            if stream != self.index and seq > self.clock.get(stream, 0):
                self.clock[stream] = seq

    def wait_stream(self, other: Stream) -> None:
        if isinstance(other, RecordingStream):
            self.merge(other.snapshot())

    def wait_event(self, event: Event) -> None:
        if isinstance(event, RecordingEvent):
            self.merge(event.clock)

    def record_event(self) -> Event:
        return RecordingEvent(self._tracker, self.snapshot(), self.name)

    def synchronize(self) -> None:
        self._tracker.host_wait(self.snapshot(), f"stream {self.name!r}.synchronize()")

    @contextlib.contextmanager
    def use(self) -> Iterator[Stream]:
        self._tracker._stack.append(self)
        try:
            yield self
        finally:
            self._tracker._stack.pop()

    def native_id(self) -> object:
        return ("recording", id(self._tracker), self.index)

    def __repr__(self) -> str:
        return f"RecordingStream({self.name!r}, ops={self.seq})"


# -- memory records ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Write:
    lo: int
    hi: int
    stream: int
    seq: int
    op: str
    site: str


class _Memory:
    """One allocation as the tracker sees it (shared by its views)."""

    __slots__ = ("residence", "site", "writes")

    def __init__(self, residence: Residence, site: str) -> None:
        self.residence = residence
        self.site = site
        self.writes: list[_Write] = []

    def write(self, entry: _Write) -> None:
        # A write hides every earlier one it covers; the list stays as long as the number
        # of separately written regions (buckets, gather chunks), not the number of ops.
        self.writes = [w for w in self.writes if not (entry.lo <= w.lo and w.hi <= entry.hi)]
        self.writes.append(entry)


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte range of its storage a tensor covers (None when empty)."""
    if t.numel() == 0:
        return None
    elem = t.element_size()
    lo = t.storage_offset() * elem
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return int(lo), int(lo + (span + 1) * elem)


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _flatten(value: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, list | tuple) and depth < 2:
        for item in value:
            _flatten(item, out, depth + 1)


def _inplace_targets(
    name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[torch.Tensor]:
    targets: list[torch.Tensor] = []
    if "out" in kwargs:
        _flatten(kwargs["out"], targets)
    dunder = name.startswith("__") and name.endswith("__")
    inplace = (name.endswith("_") and not dunder) or name == "__setitem__"
    inplace = inplace or (dunder and name.startswith("__i") and name not in _NOT_INPLACE_DUNDERS)
    if inplace and args:
        _flatten(args[0], targets)
    return targets


class DeviceTracker(TorchFunctionMode):
    """Tracks where tensors would live on an accelerator and which stream wrote them.

    Use it as a context manager around the code to check (sharding included, so the
    engine's own allocations are seen), together with a
    :class:`~zero3.testing.CheckingBackend` whose streams it provides::

        tracker = DeviceTracker()
        comm = CheckingBackend(GlooBackend(), tracker, mirror="nccl", strict=False)
        with tracker:
            model = shard_module(model, config, comm=comm)
            ...
        assert not tracker.violations, tracker.report()

    Args:
        device_type: The accelerator being stood in for (used in messages).

    Attributes:
        violations: Everything found so far (op-level findings and those of the
            checking backends reporting here).
        compute: The default (compute) stream.
    """

    def __init__(self, device_type: str = "cuda") -> None:
        super().__init__()
        self.device_type = device_type
        self.violations: list[Violation] = []
        self._memory: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._streams: list[RecordingStream] = []
        self._host_clock: dict[int, int] = {}
        self._listeners: list[Callable[[str, str], None]] = []
        self.compute = self.new_stream("compute")
        self._stack: list[RecordingStream] = [self.compute]

    # -- public queries -----------------------------------------------------------------

    def residence(self, tensor: torch.Tensor) -> Residence:
        """Where ``tensor`` would live (device memory when the tracker never saw it made)."""
        memory = self._memory.get(tensor)
        return Residence.DEVICE if memory is None else memory.residence

    def is_device(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` would be device memory."""
        return self.residence(tensor) is Residence.DEVICE

    def made_at(self, tensor: torch.Tensor) -> str:
        """Where a host tensor was allocated (``""`` for device memory or unknown)."""
        memory = self._memory.get(tensor)
        return "" if memory is None else memory.site

    def current_stream(self) -> RecordingStream:
        """The stream ops are issued on now."""
        return self._stack[-1]

    @property
    def streams(self) -> tuple[RecordingStream, ...]:
        """Every stream made so far, the compute stream first."""
        return tuple(self._streams)

    def new_stream(self, name: str) -> RecordingStream:
        """A new side stream."""
        stream = RecordingStream(self, len(self._streams), name)
        self._streams.append(stream)
        return stream

    def transport(self) -> contextlib.AbstractContextManager[None]:
        """Run a checked backend's own implementation unobserved (the real transport is
        not the engine: its host-side copies do not exist on a device backend).
        """
        return _transport()

    def report(self) -> str:
        """Every violation, one per line (for assertion messages)."""
        return "\n".join(str(v) for v in self.violations) or "no violations"

    def add_listener(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(kind, what)`` at every host wait on a stream, event or work."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[str, str], None]) -> None:
        """Stop calling ``listener``."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    # -- ordering primitives (used by the checking backend) -------------------------------

    def issue(self, stream: RecordingStream) -> int:
        """Count one op on ``stream``; return its sequence number."""
        stream.seq += 1
        return stream.seq

    def host_wait(self, clock: Mapping[int, int], what: str) -> None:
        """The host blocked until ``clock``'s ops finished: a host synchronization."""
        for stream, seq in clock.items():
            self._host_clock[stream] = max(self._host_clock.get(stream, 0), seq)
        for listener in list(self._listeners):
            listener("wait", what)

    def record_write(
        self, tensor: torch.Tensor, stream: RecordingStream, seq: int, op: str
    ) -> None:
        """``tensor``'s bytes were written by op ``seq`` of ``stream``."""
        memory = self._record(tensor)
        if memory.residence is Residence.DEVICE:
            self._write(memory, tensor, stream, seq, op)

    def last_write(self, tensor: torch.Tensor) -> tuple[str, int, str, str] | None:
        """(stream name, op number, op, site) of the latest write overlapping ``tensor``."""
        memory = self._memory.get(tensor)
        span = _extent(tensor)
        if memory is None or span is None:
            return None
        hits = [w for w in memory.writes if w.lo < span[1] and span[0] < w.hi]
        if not hits:
            return None
        w = hits[-1]
        return self._streams[w.stream].name, w.seq, w.op, w.site

    def check_read(
        self, tensor: torch.Tensor, stream: RecordingStream, what: str | Callable[[], str]
    ) -> Violation | None:
        """Check that a read of ``tensor`` on ``stream`` comes after its last writes.

        ``what`` names the reader in the message (a callable is only called on a finding).
        """
        memory = self._memory.get(tensor)
        if memory is None or memory.residence is Residence.HOST or not memory.writes:
            return None
        span = _extent(tensor)
        if span is None:
            return None
        for w in memory.writes:
            if not (w.lo < span[1] and span[0] < w.hi) or w.stream == stream.index:
                continue
            if stream.clock.get(w.stream, 0) >= w.seq or self._host_clock.get(w.stream, 0) >= w.seq:
                continue
            writer = self._streams[w.stream]
            known = stream.clock.get(w.stream, 0)
            reader = what() if callable(what) else what
            return Violation(
                STREAM_ORDER,
                f"{reader}: a {tensor.dtype} tensor of shape {tuple(tensor.shape)} was last "
                f"written on stream {writer.name!r} by op #{w.seq} ({w.op} at {w.site}) and "
                f"is read on stream {stream.name!r}, which has waited for {writer.name!r} "
                f"only up to op #{known}: on a device the read may see the bytes before they "
                f"are written. Make {stream.name!r} wait for {writer.name!r} after the write "
                "(wait_stream, or Work.wait on it), or do the write on "
                f"{stream.name!r}.",
            )
        return None

    def report_violation(self, violation: Violation) -> None:
        """Add a finding (the checking backends report theirs here too)."""
        self.violations.append(violation)

    # -- the mode ---------------------------------------------------------------------------

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _TRANSPORT[0]:
            return func(*args, **kwargs)
        if func in _BACKWARD_SIGNATURES:
            return run_backward_under(self, func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                with torch._C.DisableTorchFunctionSubclass():
                    self._adopt(result, args[0])
            return result
        with torch._C.DisableTorchFunctionSubclass():
            inputs: list[torch.Tensor] = []
            _flatten(list(args), inputs)
            _flatten([v for k, v in kwargs.items() if k != "out"], inputs)
            targets = _inplace_targets(name, args, kwargs)
        result = func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if inputs and self._reads_data(name, inputs, targets, result):
                self._check_op(name, inputs, targets)
            return self._after(name, args, kwargs, inputs, targets, result)

    def _reads_data(
        self, name: str, inputs: list[torch.Tensor], targets: list[torch.Tensor], result: Any
    ) -> bool:
        """Whether the op read tensor data (views and metadata queries do not)."""
        if targets:
            return True
        outs: list[torch.Tensor] = []
        _flatten(result, outs)
        if not outs:
            return name in VALUE_READS  # numel(), size()... read metadata only
        ptrs = {_storage_ptr(t) for t in inputs}
        return not all(
            any(out is t for t in inputs) or (_storage_ptr(out) in ptrs and _storage_ptr(out))
            for out in outs
        )

    def _check_op(self, name: str, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        stream = self.current_stream()
        # A target that is only overwritten is not read (``copy_``, ``zero_``...).
        write_only = {id(t) for t in targets} if name in _WRITE_ONLY else set()
        for t in inputs:
            if id(t) in write_only:
                continue
            found = self.check_read(t, stream, lambda: f"{name} at {caller_site()}")
            if found is not None:
                self.report_violation(found)
        if name in _TRANSFERS:
            return
        host = [t for t in (*inputs, *targets) if t.dim() > 0 and not self.is_device(t)]
        if host and any(self.is_device(t) for t in (*inputs, *targets)):
            made = ", ".join(
                f"{t.dtype} {tuple(t.shape)} made at {self.made_at(t) or '?'}" for t in host
            )
            self.report_violation(
                Violation(
                    MIXED_DEVICES,
                    f"{name} at {caller_site()} mixes device tensors with host tensors "
                    f"({made}); on {self.device_type} this raises 'Expected all tensors to be "
                    "on the same device'. Allocate them on the device (comm.device()).",
                )
            )

    def _after(
        self,
        name: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        inputs: list[torch.Tensor],
        targets: list[torch.Tensor],
        result: Any,
    ) -> Any:
        stream = self.current_stream()
        placed = self._placement(name, args, kwargs)
        if placed is not None and args and isinstance(args[0], torch.Tensor):
            source = args[0]
            if isinstance(result, torch.Tensor) and placed is not self.residence(source):
                if result is source:
                    result = source.clone()  # a transfer makes a new tensor on a device
                self._fresh(result, placed, stream, name)
                return result
        seq = None
        for t in targets:
            memory = self._record(t)
            if memory.residence is Residence.DEVICE:
                seq = seq if seq is not None else self.issue(stream)
                self._write(memory, t, stream, seq, name)
        outs: list[torch.Tensor] = []
        _flatten(result, outs)
        for out in outs:
            if any(out is t for t in inputs) or out in self._memory:
                continue
            ptr = _storage_ptr(out)
            base = next((t for t in inputs if ptr and _storage_ptr(t) == ptr), None)
            if base is not None:
                self._memory[out] = self._record(base)
                continue
            self._fresh(out, self._fresh_residence(name, kwargs, inputs), stream, name)
        return result

    # -- bookkeeping -------------------------------------------------------------------------

    def _record(self, tensor: torch.Tensor) -> _Memory:
        memory = self._memory.get(tensor)
        if memory is None:
            memory = _Memory(Residence.DEVICE, "")
            self._memory[tensor] = memory
        return memory  # type: ignore[no-any-return]

    def _adopt(self, result: torch.Tensor, owner: torch.Tensor) -> None:
        if result in self._memory:
            return
        ptr = _storage_ptr(result)
        if ptr and ptr == _storage_ptr(owner):
            self._memory[result] = self._record(owner)
        else:
            self._memory[result] = _Memory(self.residence(owner), self.made_at(owner))

    def _fresh(
        self, tensor: torch.Tensor, residence: Residence, stream: RecordingStream, op: str
    ) -> None:
        site = caller_site() if residence is Residence.HOST else ""
        memory = _Memory(residence, site)
        self._memory[tensor] = memory
        if residence is Residence.DEVICE:
            self._write(memory, tensor, stream, self.issue(stream), op)

    def _write(
        self, memory: _Memory, tensor: torch.Tensor, stream: RecordingStream, seq: int, op: str
    ) -> None:
        span = _extent(tensor)
        if span is not None:
            memory.write(_Write(span[0], span[1], stream.index, seq, op, caller_site()))

    def _fresh_residence(
        self, name: str, kwargs: Mapping[str, Any], inputs: list[torch.Tensor]
    ) -> Residence:
        if "device" in kwargs:
            return residence_of_device(kwargs["device"])
        if inputs:
            return Residence.DEVICE if any(self.is_device(t) for t in inputs) else Residence.HOST
        return residence_of_device(None)  # a factory without device=: the default device

    def _placement(
        self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Residence | None:
        """Where a transfer op (``to``, ``cpu``, ``cuda``) puts its result, or None."""
        if name == "cpu" or name == "numpy":
            return Residence.HOST
        if name in ("cuda", "npu"):
            return Residence.DEVICE
        if name != "to":
            return None
        return placement_of_to(args, kwargs, self.residence)


def placement_of_to(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    residence: Callable[[torch.Tensor], Residence],
    of_device: Callable[[object], Residence] = residence_of_device,
) -> Residence | None:
    """Where ``Tensor.to(*args[1:], **kwargs)`` puts the result (None: where it is);
    ``of_device`` reads a device argument (default: this module's simulated placement).
    """
    if "device" in kwargs and kwargs["device"] is not None:
        return of_device(kwargs["device"])
    for arg in args[1:]:
        if isinstance(arg, torch.Tensor):
            return residence(arg)
        if isinstance(arg, str | torch.device | int) and not isinstance(arg, bool):
            return of_device(arg)
    return None
