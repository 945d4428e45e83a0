"""HostSyncCounter: counts the points where the host would wait for a device (a test instrument).

Note:
    The kinds counted (``read``, ``to-host``, ``to-device``, ``shape``, ``wait``) are the
    points where torch makes an accelerator's host wait; with a tracker only device memory
    counts, and on a real (or the simulated ``zdev``) device :class:`RealDevice` tells it
    by each tensor's own device. The list, as torch makes them: docs/testing.rst,
    :ref:`testing-host-syncs`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from zero3.testing._tracker import (
    VALUE_READS,
    Residence,
    caller_site,
    in_transport,
    placement_of_to,
    residence_of_device,
    run_backward_under,
)

__all__ = ["SYNC_KINDS", "DeviceMemory", "HostSync", "HostSyncCounter", "RealDevice"]

#: Every kind of synchronization the counter tells apart.
SYNC_KINDS = ("read", "to-host", "to-device", "shape", "wait")

_READS = VALUE_READS
_SHAPES = frozenset(
    {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "masked_scatter"}
)
_CANDIDATES = (
    _READS
    | _SHAPES
    | {
        "cpu",
        "to",
        "cuda",
        "npu",
        "copy_",
        "__setitem__",
        "__getitem__",
        "tensor",
        "as_tensor",
        "asarray",
        "where",
        "repeat_interleave",
    }
)
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward)


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One point where the host would wait for the device.

    Attributes:
        kind: One of :data:`SYNC_KINDS`.
        op: The torch function (``item``, ``cpu``, ``copy_``...) or the waited object.
        site: ``path:line (function)`` of the code that called it.
    """

    kind: str
    op: str
    site: str


class DeviceMemory(Protocol):
    """What the counter asks about memory: a :class:`~zero3.testing.DeviceTracker`
    (simulated placement on the host) or :class:`RealDevice` (tensors' own devices).
    """

    def is_device(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` is (or would be) device memory."""

    def add_listener(self, listener: Callable[[str, str], None]) -> None:
        """Report host waits on streams, events or works to ``listener(kind, what)``."""

    def remove_listener(self, listener: Callable[[str, str], None]) -> None:
        """Stop reporting to ``listener``."""


class RealDevice:
    """Device memory as torch places it: any tensor not on the host (``cpu``) or meta.

    For runs on a real accelerator or the simulated ``zdev`` device. It reports no host
    waits of its own (streams and events are torch's): the zdev device counts those
    itself (:func:`zero3.testing.device.detector.host_syncs`).
    """

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type not in ("cpu", "meta")

    def add_listener(self, listener: Callable[[str, str], None]) -> None:
        """Nothing to report (see the class note)."""

    def remove_listener(self, listener: Callable[[str, str], None]) -> None:
        """Nothing to report (see the class note)."""


def _real_residence(device: object) -> Residence:
    """Where a ``device=`` argument puts a tensor on a real device (None: the default)."""
    if device is None:
        device = torch.get_default_device()
    if isinstance(device, int):
        return Residence.DEVICE
    return Residence.HOST if torch.device(device).type in ("cpu", "meta") else Residence.DEVICE  # type: ignore[arg-type]


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _indices(index: Any) -> Iterable[Any]:
    return index if isinstance(index, tuple) else (index,)


class HostSyncCounter(TorchFunctionMode):
    """Counts host synchronizations, per step (see the module note for what counts).

    Args:
        tracker: A :class:`~zero3.testing.DeviceTracker` telling device from host memory
            and reporting stream waits (enter the tracker first), or a
            :class:`RealDevice` on a device where tensors really live apart.

    Use::

        counter = HostSyncCounter(tracker)
        with tracker, counter:
            for batch in data:
                with counter.step():
                    loss = model(batch); loss.backward(); opt.step()
        counter.counts()        # synchronizations per step

    Attributes:
        syncs: Every synchronization seen while active, in order.
        steps: Those of each :meth:`step` block.
    """

    def __init__(self, tracker: DeviceMemory | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self._residence_of: Callable[[object], Residence] = (
            _real_residence if isinstance(tracker, RealDevice) else residence_of_device
        )
        self.syncs: list[HostSync] = []
        self.steps: list[list[HostSync]] = []
        self._current: list[HostSync] | None = None

    def __enter__(self) -> HostSyncCounter:
        if self.tracker is not None:
            self.tracker.add_listener(self._note)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        if self.tracker is not None:
            self.tracker.remove_listener(self._note)

    @contextlib.contextmanager
    def step(self) -> Iterator[list[HostSync]]:
        """Collect the synchronizations of one step (a new entry of :attr:`steps`)."""
        current: list[HostSync] = []
        self.steps.append(current)
        self._current = current
        try:
            yield current
        finally:
            self._current = None

    def counts(self, kinds: Iterable[str] = SYNC_KINDS) -> list[int]:
        """Synchronizations of the given kinds in each step."""
        wanted = set(kinds)
        return [sum(1 for s in step if s.kind in wanted) for step in self.steps]

    @staticmethod
    def describe(syncs: Iterable[HostSync]) -> str:
        """One line per (kind, op, site) with its count, most frequent first."""
        tally = collections.Counter((s.kind, s.op, s.site) for s in syncs)
        lines = [
            f"{n:4d} x {kind:9s} {op:12s} at {site}" for (kind, op, site), n in tally.most_common()
        ]
        return "\n".join(lines) or "(none)"

    # -- the mode ------------------------------------------------------------------------------

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if in_transport():
            return func(*args, **kwargs)
        if func in _BACKWARD:
            return run_backward_under(self, func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in _CANDIDATES:
            with torch._C.DisableTorchFunctionSubclass():
                kind = self._classify(name, args, kwargs)
            if kind is not None:
                self._note(kind, name)
        return func(*args, **kwargs)

    def _note(self, kind: str, op: str) -> None:
        sync = HostSync(kind, op, caller_site())
        self.syncs.append(sync)
        if self._current is not None:
            self._current.append(sync)

    def _device(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return False
        return True if self.tracker is None else self.tracker.is_device(tensor)

    def _residence(self, tensor: torch.Tensor) -> Residence:
        return Residence.DEVICE if self._device(tensor) else Residence.HOST

    def _classify(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        first = args[0] if args else None
        non_blocking = bool(kwargs.get("non_blocking", False))
        if name in _READS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            return "read" if any(self._device(t) for t in tensors) else None
        if name in _SHAPES or (name == "where" and len(args) == 1):
            return "shape" if self._device(first) else None
        if name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            needs = "output_size" not in kwargs and isinstance(repeats, torch.Tensor)
            return "shape" if needs and self._device(repeats) else None
        if name == "cpu":
            return "to-host" if self._device(first) else None
        if name in ("cuda", "npu"):
            return "to-device" if self.tracker is not None and not self._device(first) else None
        if name == "to" and isinstance(first, torch.Tensor):
            return self._transfer(
                first,
                placement_of_to(args, kwargs, self._residence, self._residence_of),
                non_blocking,
            )
        if name == "copy_" and isinstance(first, torch.Tensor) and len(args) > 1:
            source = args[1]
            if not isinstance(source, torch.Tensor):
                return None
            asynchronous = non_blocking or (len(args) > 2 and bool(args[2]))
            return self._transfer(source, self._residence(first), asynchronous)
        if name in ("__setitem__", "__getitem__") and isinstance(first, torch.Tensor):
            return self._indexing(name, first, args)
        if name in ("tensor", "as_tensor", "asarray") and self.tracker is not None:
            data = first
            target = self._residence_of(kwargs.get("device"))
            if target is Residence.DEVICE and not (
                isinstance(data, torch.Tensor) and self._device(data)
            ):
                return "to-device"
        return None

    def _transfer(
        self, source: torch.Tensor, target: Residence | None, non_blocking: bool
    ) -> str | None:
        if target is None or non_blocking:
            return None
        here = self._residence(source)
        if here is Residence.DEVICE and target is Residence.HOST:
            return "to-host"
        if here is Residence.HOST and target is Residence.DEVICE and self.tracker is not None:
            return "to-device"
        return None

    def _indexing(self, name: str, target: torch.Tensor, args: Sequence[Any]) -> str | None:
        index = args[1] if len(args) > 1 else None
        if any(_is_mask(i) and self._device(i) for i in _indices(index)):
            return "shape"
        if name == "__setitem__" and len(args) > 2 and isinstance(args[2], torch.Tensor):
            return self._transfer(args[2], self._residence(target), False)
        return None
