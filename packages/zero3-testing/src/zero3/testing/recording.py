"""An in-memory backend that records every collective (single-process unit tests)."""

from __future__ import annotations

import dataclasses

import torch

from zero3.comm import Capabilities, CommBackend, CompletedWork, ReduceOp, Stream, Work

__all__ = ["Call", "DeferredWork", "RecordingBackend"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded collective."""

    op: str
    numel: int
    dtype: torch.dtype


class DeferredWork(Work):
    """Completes only when waited for (or when the test says so), to observe in-flight work."""

    def __init__(self, backend: RecordingBackend) -> None:
        self._backend = backend
        self._done = False
        backend.pending.append(self)

    def complete(self) -> None:
        """Mark the collective finished (as if the network delivered it)."""
        self._done = True

    def wait(self, stream: Stream | None = None) -> None:
        self._done = True

    def is_completed(self) -> bool:
        return self._done


class RecordingBackend(CommBackend):
    """Runs every collective locally and logs it.

    With ``world_size == 1`` results are exact. With a simulated ``world_size > 1`` in
    one process every "rank" contributes this process's data (a gather tiles the input,
    a reduce-scatter returns chunk ``rank`` of the input): shapes, counts and byte sizes
    are exactly those of a real group, values are not — enough to test scheduling.

    Args:
        world_size: Ranks to simulate.
        rank: This process's simulated rank.
        deferred: Collectives stay in flight (``is_completed()`` False) until waited on.
    """

    name = "recording"
    device_type = "cpu"
    capabilities = Capabilities(native_reduce_scatter=True, async_host=True)

    def __init__(self, world_size: int = 1, rank: int = 0, *, deferred: bool = False) -> None:
        super().__init__(rank, world_size, timeout_s=60.0)
        self.calls: list[Call] = []
        self.deferred = deferred
        self.pending: list[DeferredWork] = []

    def duplicate(self) -> RecordingBackend:
        """A separate recorder (gradient collectives are logged apart)."""
        return RecordingBackend(self.world_size, self.rank, deferred=self.deferred)

    def ops(self) -> list[str]:
        """Recorded op names in order."""
        return [c.op for c in self.calls]

    def clear(self) -> None:
        """Forget the log."""
        self.calls.clear()

    def _done(self, op: str, tensor: torch.Tensor) -> Work:
        self.calls.append(Call(op, tensor.numel(), tensor.dtype))
        return DeferredWork(self) if self.deferred else CompletedWork()

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        output.view(self.world_size, -1).copy_(input.view(1, -1).expand(self.world_size, -1))
        return self._done("all_gather", output)

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        output.copy_(input.view(self.world_size, -1)[self.rank])
        return self._done("reduce_scatter", input)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: Stream | None) -> Work:
        return self._done("all_reduce", tensor)

    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        return self._done("broadcast", tensor)

    def _barrier(self) -> Work:
        self.calls.append(Call("barrier", 0, torch.uint8))
        return CompletedWork()
