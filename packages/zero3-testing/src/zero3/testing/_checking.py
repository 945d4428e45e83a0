"""CheckingBackend: a CPU backend that rejects what a device backend would (a test instrument).

Note:
    A :class:`~zero3.comm.CommBackend` subclass with the mirrored backend's capabilities,
    so it runs the device backends' own argument checks; it adds the two a CPU run cannot
    show by itself (host memory handed to a collective, inputs not ordered on the
    collective's stream) and runs the collective on the wrapped CPU backend, so results
    are real. What it mirrors: docs/testing.rst, :ref:`testing-checking-backend`.
"""

from __future__ import annotations

import dataclasses

import torch

from zero3.comm import (
    CommBackend,
    CupyNCCLBackend,
    HCCLBackend,
    HostStream,
    NCCLBackend,
    ReduceOp,
    Stream,
    Work,
)
from zero3.testing._tracker import (
    HOST_MEMORY,
    DeviceTracker,
    RecordingStream,
    Residence,
    Violation,
)

__all__ = [
    "CheckedWork",
    "CheckingBackend",
    "DeviceDisciplineError",
    "StreamOrderError",
    "TensorRecord",
]

_MIRRORS: dict[str, type[CommBackend]] = {
    "nccl": NCCLBackend,
    "cupy-nccl": CupyNCCLBackend,
    "hccl": HCCLBackend,
}


class DeviceDisciplineError(ValueError):
    """A collective got a tensor the mirrored device backend would reject (strict mode).

    A ``ValueError``, as ``CommBackend._check_device`` raises on the real backend.
    """


class StreamOrderError(RuntimeError):
    """A collective read a tensor its stream had not waited for (strict mode)."""


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """One tensor handed to one collective.

    Attributes:
        collective: ``all_gather``, ``reduce_scatter``, ``all_reduce`` or ``broadcast``.
        role: ``input``, ``output`` or ``in-place``.
        dtype: The tensor's dtype.
        numel: Its number of elements.
        device: Its torch device (``cpu`` here).
        residence: Where it would live on the mirrored device.
        made_at: Where a host tensor was allocated (``""`` for device memory).
        stream: The stream the collective was issued on.
        producer: ``"stream#op (op name at site)"`` of the last write to an input, or None
            when the tracker never saw it written.
        ordered: The collective's stream had waited for that write.
    """

    collective: str
    role: str
    dtype: torch.dtype
    numel: int
    device: torch.device
    residence: Residence
    made_at: str
    stream: str
    producer: str | None
    ordered: bool


class CheckedWork(Work):
    """The wrapped backend's work, plus the ordering a device backend's work gives."""

    def __init__(
        self,
        backend: CheckingBackend,
        inner: Work,
        clock: dict[int, int],
        description: str,
    ) -> None:
        self._backend = backend
        self._inner = inner
        self._clock = clock
        self._description = description

    def wait(self, stream: Stream | None = None) -> None:
        tracker = self._backend.tracker
        with tracker.transport():
            self._inner.wait()
        if isinstance(stream, HostStream):
            tracker.host_wait(self._clock, f"{self._description}.wait(HostStream())")
            return
        consumer = stream if isinstance(stream, RecordingStream) else tracker.current_stream()
        consumer.merge(self._clock)

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class CheckingBackend(CommBackend):
    """Runs collectives on a CPU backend, checking each as a device backend would.

    Args:
        inner: A CPU backend that does the real work (``GlooBackend``, ``MPIBackend``,
            ``RecordingBackend``...). The checking backend closes it in :meth:`close`.
        tracker: The :class:`~zero3.testing.DeviceTracker` that knows where tensors live
            and provides the streams; it must be active around the code being checked.
        mirror: The device backend whose rules apply: ``"nccl"``, ``"cupy-nccl"`` or
            ``"hccl"`` (its ``capabilities`` become this backend's).
        strict: Raise at the first violation (:class:`DeviceDisciplineError` for host
            memory, :class:`StreamOrderError` for stream order), as the device would fail
            there; False records it in :attr:`violations` (and the tracker's) and goes on,
            so one run lists every violation.

    Attributes:
        records: Every tensor handed to every collective (:class:`TensorRecord`).
        violations: What this backend found.
    """

    name = "checking"
    device_type = "cpu"

    def __init__(
        self,
        inner: CommBackend,
        tracker: DeviceTracker,
        *,
        mirror: str = "nccl",
        strict: bool = True,
    ) -> None:
        if mirror not in _MIRRORS:
            raise ValueError(
                f"CheckingBackend: mirror must be one of {sorted(_MIRRORS)}, got {mirror!r}"
            )
        if inner.device_type != "cpu":
            raise ValueError(
                "CheckingBackend wraps a CPU backend (gloo, mpi...), got "
                f"{type(inner).__name__} for {inner.device_type} tensors"
            )
        super().__init__(inner.rank, inner.world_size, timeout_s=inner.timeout_s)
        self.inner = inner
        self.tracker = tracker
        self.mirror = mirror
        self.strict = strict
        mirrored = _MIRRORS[mirror]
        self.capabilities = mirrored.capabilities
        self.mirrored_device_type = mirrored.device_type
        self.records: list[TensorRecord] = []
        self.violations: list[Violation] = []

    def __repr__(self) -> str:
        return (
            f"CheckingBackend(mirror={self.mirror!r}, rank={self.rank}, "
            f"world_size={self.world_size}, inner={self.inner!r})"
        )

    # -- identity, streams, lifecycle ----------------------------------------------------------

    def device(self) -> torch.device:
        return torch.device("cpu")

    def current_stream(self) -> Stream:
        return self.tracker.current_stream()

    def new_stream(self) -> Stream:
        return self.tracker.new_stream(f"{self.mirror}-side-{len(self.tracker.streams)}")

    def duplicate(self) -> CheckingBackend:
        """A checking backend over a duplicate of the wrapped backend (same tracker)."""
        with self.tracker.transport():
            inner = self.inner.duplicate()
        return CheckingBackend(inner, self.tracker, mirror=self.mirror, strict=self.strict)

    def host_channel(self) -> CommBackend | None:
        """What a device backend opens beside itself for host messages (a gloo group
        next to NCCL): here a plain duplicate of the wrapped CPU backend, unchecked,
        since host tensors are what it is for.
        """
        with self.tracker.transport():
            return self.inner.duplicate()

    def close(self) -> None:
        self.inner.close()

    # -- checks ------------------------------------------------------------------------------

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        super()._check_device(tensor, what)
        if self.tracker.residence(tensor) is Residence.HOST:
            self._found(
                Violation(
                    HOST_MEMORY,
                    f"{self.mirror}.{what}: a {tensor.dtype} tensor of shape "
                    f"{tuple(tensor.shape)} made at {self.tracker.made_at(tensor) or '?'} "
                    f"lives in host memory, but the {self.mirror!r} backend moves "
                    f"{self.mirrored_device_type} tensors and rejects it "
                    "(CommBackend._check_device raises ValueError there). Allocate it on "
                    "comm.device().",
                ),
                DeviceDisciplineError,
            )

    def _found(self, violation: Violation, error: type[Exception]) -> None:
        self.violations.append(violation)
        self.tracker.report_violation(violation)
        if self.strict:
            raise error(violation.message)

    def _stream(self, stream: Stream | None) -> RecordingStream:
        if isinstance(stream, RecordingStream):
            return stream
        return self.tracker.current_stream()  # None, or a host stream: the current one

    def _record(
        self, collective: str, role: str, tensor: torch.Tensor, stream: RecordingStream
    ) -> None:
        last = self.tracker.last_write(tensor)
        producer = None if last is None else f"{last[0]}#{last[1]} ({last[2]} at {last[3]})"
        found = None
        if role != "output":
            found = self.tracker.check_read(tensor, stream, f"{self.mirror}.{collective} {role}")
        self.records.append(
            TensorRecord(
                collective=collective,
                role=role,
                dtype=tensor.dtype,
                numel=tensor.numel(),
                device=tensor.device,
                residence=self.tracker.residence(tensor),
                made_at=self.tracker.made_at(tensor),
                stream=stream.name,
                producer=producer,
                ordered=found is None,
            )
        )
        if found is not None:
            self._found(found, StreamOrderError)

    def _issued(
        self,
        collective: str,
        stream: RecordingStream,
        inner: Work,
        outputs: tuple[torch.Tensor, ...],
    ) -> Work:
        seq = self.tracker.issue(stream)
        for out in outputs:
            self.tracker.record_write(out, stream, seq, f"{self.mirror}.{collective}")
        description = f"{self.mirror}.{collective} on stream {stream.name!r}"
        return CheckedWork(self, inner, stream.snapshot(), description)

    # -- primitives --------------------------------------------------------------------------

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        s = self._stream(stream)
        self._record("all_gather", "input", input, s)
        self._record("all_gather", "output", output, s)
        with self.tracker.transport():
            work = self.inner.all_gather(output, input)
        return self._issued("all_gather", s, work, (output,))

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        s = self._stream(stream)
        self._record("reduce_scatter", "input", input, s)
        self._record("reduce_scatter", "output", output, s)
        with self.tracker.transport():
            work = self.inner.reduce_scatter(output, input, op=op)
        return self._issued("reduce_scatter", s, work, (output,))

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: Stream | None) -> Work:
        s = self._stream(stream)
        self._record("all_reduce", "in-place", tensor, s)
        with self.tracker.transport():
            work = self.inner.all_reduce(tensor, op=op)
        return self._issued("all_reduce", s, work, (tensor,))

    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        s = self._stream(stream)
        self._record("broadcast", "in-place", tensor, s)
        with self.tracker.transport():
            work = self.inner.broadcast(tensor, src)
        return self._issued("broadcast", s, work, (tensor,))

    def _barrier(self) -> Work:
        s = self.tracker.current_stream()
        with self.tracker.transport():
            work = self.inner.barrier()
        return self._issued("barrier", s, work, ())
