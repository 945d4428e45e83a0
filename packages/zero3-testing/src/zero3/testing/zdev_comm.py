"""The ``zdev`` comm backend: collectives on zdev tensors, staged through gloo on the host.

A plugin like any other (the ``zero3.comm`` entry point of zero3-testing): it registers
:class:`ZdevBackend` under ``"zdev"``, and ``Zero3Config(backend="zdev")`` finds it. This
module must stay importable without the device loaded (the registry imports it in every
process that looks a backend up); the backend only runs once ``zero3.testing.device``
has been imported.

Note (how a collective runs, modelled on torch's ProcessGroupNCCL):
    Each backend has its own comm stream. Issuing a collective on stream ``S`` makes the
    comm stream wait for ``S``, then the comm stream reads the inputs (their bytes are
    staged into host buffers) and writes the outputs: both accesses are recorded in the
    race detector as the comm stream's, at issue time, which is when a real device could
    start writing, and an event marks the collective's end there. gloo then runs on its
    own thread. ``Work.wait(consumer)`` waits for gloo on the host (the simulation's only
    blocking point; not a host synchronisation of the device), lands the bytes in the
    outputs, and makes the consumer stream wait for the collective's event. So reading an
    output before ``wait``, or on a stream that did not wait, is a race the detector
    reports; and the work keeps its tensors alive until it is waited for, as
    ProcessGroupNCCL does.
    A CPU tensor is refused by the same check NCCL and HCCL use
    (:meth:`~zero3.comm.CommBackend._check_device`), plus the device index: a tensor on
    another zdev device is refused too, as NCCL refuses one on another GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zero3.comm import (
    DEFAULT_TIMEOUT_S,
    BackendRegistry,
    BackendUnavailableError,
    Capabilities,
    CommBackend,
    GlooBackend,
    ReduceOp,
    Stream,
    TorchDeviceStream,
    TorchDistBackend,
    Work,
    hookimpl,
    local_device_index,
)

__all__ = ["ZdevBackend", "ZdevWork", "zero3_comm_register_backends"]

DEVICE_TYPE = "zdev"


def _zdev() -> Any:
    """``torch.zdev`` (registered by ``zero3.testing.device``)."""
    return torch.get_device_module(DEVICE_TYPE)


def _device_loaded() -> bool:
    return hasattr(torch, DEVICE_TYPE) and torch._C._get_privateuse1_backend_name() == DEVICE_TYPE


def _record(tensor: torch.Tensor, stream: Stream, *, write: bool, what: str) -> None:
    assert isinstance(stream, TorchDeviceStream)
    native = stream.native
    torch.ops.zdev.comm_access(tensor, native.device_index, native.stream_id, write, what)


@dataclasses.dataclass
class _Staged:
    """One device output and the host buffer gloo fills for it."""

    device: torch.Tensor
    host: torch.Tensor


class ZdevWork(Work):
    """A collective on the comm stream (see the module note)."""

    def __init__(
        self,
        backend: ZdevBackend,
        host_work: Work,
        staged: list[_Staged],
        keep: tuple[torch.Tensor, ...],
    ) -> None:
        self._backend = backend
        self._host_work = host_work
        self._staged = staged
        self._keep: tuple[torch.Tensor, ...] = keep  # alive until waited for
        # The end of this collective on the comm stream (its accesses are recorded).
        self._event = backend.comm_stream.record_event()
        self._completed = False
        self._waited = False

    def complete(self) -> None:
        """Wait for gloo and land the results in the outputs (idempotent).

        The bytes are moved without a new access: the outputs' write was recorded when
        the collective was issued, and :attr:`_event` marks it.
        """
        if self._completed:
            return
        self._host_work.wait()
        for staged in self._staged:
            torch.ops.zdev.comm_stage_in(staged.device, staged.host)
        self._completed = True
        self._backend.forget(self)

    def wait(self, stream: Stream | None = None) -> None:
        self.complete()  # it may have completed early (a later collective touched its output)
        if not self._waited:
            consumer = stream if stream is not None else self._backend.current_stream()
            consumer.wait_event(self._event)
            self._waited = True
            self._staged, self._keep = [], ()

    def is_completed(self) -> bool:
        return self._completed or self._host_work.is_completed()

    def outputs(self) -> list[torch.Tensor]:
        """The device tensors this collective writes."""
        return [staged.device for staged in self._staged]


class ZdevBackend(CommBackend):
    """Collectives on zdev tensors through gloo on the host (a development-only backend).

    Args:
        group: A process group for the host transport (default: the default group,
            created from the launcher's environment if none exists).
        device: This rank's zdev device. Default: ``zdev:LOCAL_RANK``, as NCCL picks
            ``cuda:LOCAL_RANK``; it becomes the current device.
        timeout_s: Collective timeout.
        host: The gloo backend to stage through (used by :meth:`duplicate`).
        **kwargs: ``init_method``, ``rank``, ``world_size`` for the gloo backend.
    """

    name = "zdev"
    device_type = DEVICE_TYPE
    capabilities = Capabilities()  # as NCCL: native reduce-scatter, every float and int dtype

    def __init__(
        self,
        group: torch.distributed.ProcessGroup | None = None,
        *,
        device: int | torch.device | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        host: TorchDistBackend | None = None,
        **kwargs: Any,
    ) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"the zdev backend cannot run here: {reason}")
        if isinstance(device, torch.device):
            device = device.index
        if device is None:
            device = local_device_index(_zdev().device_count(), self.name)
        self._index = _zdev().current_device() if device is None else int(device)
        _zdev().set_device(self._index)
        self._host = host or GlooBackend(group, timeout_s=timeout_s, **kwargs)
        super().__init__(self._host.rank, self._host.world_size, timeout_s=timeout_s)
        with _zdev().device(self._index):
            self.comm_stream = Stream.for_device(DEVICE_TYPE, new=True)
        assert isinstance(self.comm_stream, TorchDeviceStream)
        torch.ops.zdev.stream_label(
            self._index, self.comm_stream.native.stream_id, f"comm stream of zdev rank {self.rank}"
        )
        self._pending: list[ZdevWork] = []

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not _device_loaded():
            return (
                "the zdev test device is not loaded in this process; import "
                "zero3.testing.device first (a simulated accelerator for zero3's tests)"
            )
        return GlooBackend.unavailable_reason()

    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, self._index)

    def duplicate(self) -> ZdevBackend:
        return ZdevBackend(
            device=self._index, timeout_s=self.timeout_s, host=self._host.duplicate()
        )

    def host_channel(self) -> CommBackend | None:
        return self._host.host_channel()

    def close(self) -> None:
        self._pending.clear()
        self._host.close()

    def forget(self, work: ZdevWork) -> None:
        """Drop a completed work from the pending list."""
        if work in self._pending:
            self._pending.remove(work)

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        super()._check_device(tensor, what)
        if tensor.device.index != self._index:
            raise ValueError(
                f"{self.name}.{what}: tensor is on {tensor.device} but this rank's backend "
                f"serves {self.device()}; move the tensor to {self.device()}"
            )

    # -- the primitives ---------------------------------------------------------------------

    def _start(
        self,
        what: str,
        inputs: tuple[torch.Tensor, ...],
        outputs: tuple[torch.Tensor, ...],
        stream: Stream | None,
    ) -> tuple[list[torch.Tensor], list[_Staged]]:
        """Order the comm stream after ``stream``, record and stage the accesses."""
        self._complete_writers_of(inputs + outputs)
        self.comm_stream.wait_stream(stream if stream is not None else self.current_stream())
        label = f"zdev.{what} (rank {self.rank})"
        for tensor in inputs:
            _record(tensor, self.comm_stream, write=False, what=f"{label} reading its input")
        staged_in = [torch.ops.zdev.comm_stage_out(t) for t in inputs]
        for tensor in outputs:
            _record(tensor, self.comm_stream, write=True, what=f"{label} writing its output")
        staged_out = [_Staged(t, torch.empty(t.shape, dtype=t.dtype)) for t in outputs]
        return staged_in, staged_out

    def _complete_writers_of(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """A pending collective writing what this one touches completes first: one comm
        stream runs collectives in issue order, and results land at completion here.
        """
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        for work in list(self._pending):
            if any(t.untyped_storage().data_ptr() in storages for t in work.outputs()):
                work.complete()

    def _finish(
        self, host_work: Work, staged: list[_Staged], keep: tuple[torch.Tensor, ...]
    ) -> Work:
        work = ZdevWork(self, host_work, staged, keep)
        self._pending.append(work)
        return work

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        (host_in,), (out,) = self._start("all_gather", (input,), (output,), stream)
        return self._finish(self._host.all_gather(out.host, host_in), [out], (output, input))

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        (host_in,), (out,) = self._start("reduce_scatter", (input,), (output,), stream)
        host_work = self._host.reduce_scatter(out.host, host_in, op=op)
        return self._finish(host_work, [out], (output, input))

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: Stream | None) -> Work:
        (host,), (out,) = self._start("all_reduce", (tensor,), (tensor,), stream)
        out.host.copy_(host)
        return self._finish(self._host.all_reduce(out.host, op=op), [out], (tensor,))

    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        reads = (tensor,) if self.rank == src else ()
        staged_in, (out,) = self._start("broadcast", reads, (tensor,), stream)
        if staged_in:
            out.host.copy_(staged_in[0])
        return self._finish(self._host.broadcast(out.host, src), [out], (tensor,))

    def _barrier(self) -> Work:
        return self._host.barrier()


@hookimpl
def zero3_comm_register_backends(registry: BackendRegistry) -> None:
    """Register the ``zdev`` backend (usable once ``zero3.testing.device`` is imported)."""
    registry.register("zdev", ZdevBackend)
