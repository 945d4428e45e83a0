"""One stream abstraction for every device, so core is written once.

Note:
    CPU has no device streams. Host work issued by one Python thread runs in program
    order, and collectives run on the backend's own thread (gloo) or a progress thread
    (MPI); a :class:`Work` handle is the only thing a consumer must wait for. So on CPU
    :class:`HostStream` makes every ordering operation a no-op, and engine code that
    says ``gather_stream.wait_stream(compute)`` costs nothing there while doing the
    right thing on CUDA and NPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Event", "HostStream", "Stream", "TorchDeviceStream"]


class Event:
    """A point on a stream that another stream (or the host) can wait for."""

    def __init__(self, native: Any = None) -> None:
        self.native = native

    def synchronize(self) -> None:
        """Block the host until the event has happened."""
        if self.native is not None:
            self.native.synchronize()

    def query(self) -> bool:
        """Return True if the event has happened."""
        return True if self.native is None else bool(self.native.query())


class Stream:
    """An ordered queue of device work.

    Subclasses wrap a native stream; :meth:`for_device` returns the right one.
    """

    #: The device type whose work the stream orders (``"cpu"`` for the host stream).
    device_type: str = "cpu"

    @staticmethod
    def for_device(device_type: str, *, new: bool = False) -> Stream:
        """Return the current stream of ``device_type`` (or a new one if ``new``).

        Args:
            device_type: ``"cpu"``, ``"cuda"``, ``"npu"`` or any device type torch knows.
            new: Create a fresh side stream instead of returning the current one.
        """
        if device_type == "cpu":
            return HostStream()
        return TorchDeviceStream(device_type, new=new)

    def wait_stream(self, other: Stream) -> None:
        """Make future work on this stream wait for all work queued on ``other``."""

    def wait_event(self, event: Event) -> None:
        """Make future work on this stream wait for ``event``."""

    def record_event(self) -> Event:
        """Record an event at the current end of this stream."""
        return Event()

    def synchronize(self) -> None:
        """Block the host until all work on this stream is done."""

    @contextlib.contextmanager
    def use(self) -> Iterator[Stream]:
        """Context manager making this the current stream of its device."""
        yield self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and self.native_id() == other.native_id()

    def __hash__(self) -> int:
        return hash(self.native_id())

    def native_id(self) -> object:
        """Identity of the underlying native stream (for equality)."""
        return ("host",)


class HostStream(Stream):
    """The CPU stream: work runs in program order, so ordering calls are no-ops."""


class TorchDeviceStream(Stream):
    """A CUDA or NPU stream through torch's device module (``torch.cuda``, ``torch.npu``)."""

    def __init__(self, device_type: str, *, new: bool = False, native: Any = None) -> None:
        self.device_type = device_type
        module = torch.get_device_module(device_type)
        if native is not None:
            self.native = native
        elif new:
            self.native = module.Stream()
        else:
            self.native = module.current_stream()
        self._module = module

    def wait_stream(self, other: Stream) -> None:
        if isinstance(other, TorchDeviceStream) and other.native != self.native:
            self.native.wait_stream(other.native)

    def wait_event(self, event: Event) -> None:
        if event.native is not None:
            self.native.wait_event(event.native)

    def record_event(self) -> Event:
        event = self._module.Event()
        event.record(self.native)
        return Event(event)

    def synchronize(self) -> None:
        self.native.synchronize()

    @contextlib.contextmanager
    def use(self) -> Iterator[Stream]:
        with self._module.stream(self.native):
            yield self

    def native_id(self) -> object:
        return (self.device_type, getattr(self.native, "stream_id", id(self.native)))
