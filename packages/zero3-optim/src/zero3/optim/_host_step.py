"""Host-side stepping: offloaded sub-groups whose parameter shards are on an accelerator.

Note (one step, over the batches of offloaded sub-groups, in order):
    With ``offload_optimizer`` and the model on an accelerator, the fp32 masters and the
    optimizer state of the offloaded sub-groups live in host memory (or in swap files
    between steps) and the wrapped optimizer steps them there, with torch's CPU kernels.
    The gradient shards go device→host on a copy stream of their own and the stepped
    masters, rounded to the parameters' dtype on the host, go host→device on another:

    * batch ``i + 1``'s gradients are queued before batch ``i`` steps, so their copy
      runs while the CPU steps;
    * batch ``i``'s updated shards are queued when it has stepped, so their copy runs
      while batch ``i + 1`` steps;
    * the compute stream waits for the host→device stream before ``step()`` returns,
      so the next forward's gathers read the new shards.

    Each direction has two staging buffers (page-locked with ``pin_memory``, which a
    non-blocking copy needs to be asynchronous), reused in turn: the host waits for the
    copy that last used one before it writes into it again. The host waits for a
    batch's gradient copy before it steps, never for anything else, so the step costs
    one host synchronisation per batch plus one per reused upload buffer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from zero3.comm import Event, Stream
from zero3.core.engine import ShardedParam
from zero3.optim._offload import OffloadStats

if TYPE_CHECKING:
    from zero3.optim._optim_checkpoint import SubGroup

__all__ = ["HostStepper"]

#: Bytes between two members' regions of a staging buffer (any dtype's view is aligned).
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _wait(event: Event, stats: OffloadStats) -> None:
    begin = time.perf_counter()
    event.synchronize()
    stats.copy_wait_s += time.perf_counter() - begin


class _Staging:
    """One host buffer reused for one copy at a time, and the copy that last used it."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.done: Event | None = None
        self.stats = OffloadStats()  # the step's, set by the stepper

    def take(self, nbytes: int) -> torch.Tensor:
        """The buffer, at least ``nbytes``, once the copy that used it last is over."""
        if self.done is not None:
            _wait(self.done, self.stats)
            self.done = None
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self.buffer

    def carve(self, shapes: Sequence[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
        """One view per ``(numel, dtype)``, each at an aligned offset."""
        sizes = [_aligned(n * dtype.itemsize) for n, dtype in shapes]
        buffer = self.take(sum(sizes))
        views, offset = [], 0
        for (n, dtype), size in zip(shapes, sizes, strict=True):
            views.append(buffer[offset : offset + n * dtype.itemsize].view(dtype))
            offset += size
        return views


class HostStepper:
    """Moves gradient shards to the host and stepped shards back, for the sub-groups an
    optimizer steps on the host while their shards are on ``device``.

    Args:
        device: The accelerator the shards are on.
        pin: Page-lock the staging buffers (``offload_optimizer.pin_memory``).
        grad_of: The gradient shard of a parameter for the window (None: no gradient).
    """

    def __init__(
        self,
        device: torch.device,
        pin: bool,
        grad_of: Callable[[ShardedParam], torch.Tensor | None],
    ) -> None:
        self.device = device
        self._grad_of = grad_of
        self._down = Stream.for_device(device.type, new=True)
        self._up = Stream.for_device(device.type, new=True)
        self._down_staging = [_Staging(pin), _Staging(pin)]
        self._up_staging = [_Staging(pin), _Staging(pin)]
        self._batches: list[list[SubGroup]] = []
        self._position: dict[int, int] = {}  # id(sub-group) -> its batch
        self._queued: dict[int, tuple[Event, list[torch.Tensor | None]]] = {}  # by batch
        self._written: set[int] = set()
        self._uploads = 0
        self.stats = OffloadStats()

    def steps(self, sg: SubGroup) -> bool:
        """Whether ``sg`` is stepped on the host by this stepper (this step)."""
        return id(sg) in self._position

    def begin(self, batches: Sequence[Sequence[SubGroup]], stats: OffloadStats) -> None:
        """Start a step over ``batches`` (each the host sub-groups of one optimizer batch;
        empty ones are skipped): the first batch's gradients go to the host now. The
        step's waits and bytes are added to ``stats``.
        """
        self.stats = stats
        for staging in (*self._down_staging, *self._up_staging):
            staging.stats = stats
        self._batches = [list(b) for b in batches if b]
        self._position = {id(sg): i for i, b in enumerate(self._batches) for sg in b}
        self._queued.clear()
        self._written = set()
        self._uploads = 0
        current = Stream.for_device(self.device.type)
        # Gradients were reduced, and shards last read, by work queued on the compute
        # stream (or waited for by it): both copy streams start after it.
        self._down.wait_stream(current)
        self._up.wait_stream(current)
        if self._batches:
            self._download(0)

    def _download(self, index: int) -> None:
        members = [sp for sg in self._batches[index] for sp in sg.params]
        grads = [self._grad_of(sp) for sp in members]
        pairs = zip(members, grads, strict=True)
        shapes = [(sp.local_numel, g.dtype) for sp, g in pairs if g is not None]
        staging = self._down_staging[index % 2]
        views = iter(staging.carve(shapes))
        host: list[torch.Tensor | None] = []
        with self._down.use():
            for sp, grad in zip(members, grads, strict=True):
                if grad is None:
                    host.append(None)
                    continue
                view = next(views)
                view.copy_(grad[: sp.local_numel], non_blocking=True)
                host.append(view)
                self.stats.to_host_bytes += view.numel() * view.element_size()
        staging.done = self._down.record_event()
        self._queued[index] = (staging.done, host)

    def grads(self, sg: SubGroup) -> list[torch.Tensor | None]:
        """``sg``'s gradient shards on the host (its members' real elements; None where
        no rank produced one), once they are there. The first call of a batch queues the
        next batch's copies first, so they overlap this batch's step.
        """
        index = self._position[id(sg)]
        if index + 1 < len(self._batches) and index + 1 not in self._queued:
            self._download(index + 1)
        done, host = self._queued[index]
        _wait(done, self.stats)
        start = sum(len(s.params) for s in self._batches[index][: self._batches[index].index(sg)])
        return host[start : start + len(sg.params)]

    def upload(self, sg: SubGroup) -> None:
        """Queue ``sg``'s stepped masters, in the parameters' dtypes, into the shards."""
        members = list(sg.params)
        staging = self._up_staging[self._uploads % 2]
        self._uploads += 1
        views = staging.carve([(sp.local_numel, sp.dtype) for sp in members])
        for view, master in zip(views, sg.views, strict=True):
            view.copy_(master)  # the rounding to the parameter's dtype, on the host
        with self._up.use():
            for sp, view in zip(members, views, strict=True):
                if sp.offloaded:  # parameter offload: the shard is on the host or disk
                    sp.write_local(view, masters=False, stepped=True)
                else:
                    sp.shard[: sp.local_numel].copy_(view, non_blocking=True)
                    self.stats.to_device_bytes += view.numel() * view.element_size()
                self._written.add(sp.index)
        staging.done = self._up.record_event()

    def finish(self) -> set[int]:
        """End the step: the compute stream waits for the uploads. Returns the indices of
        the parameters whose shards were written (``commit_step`` copies them no more).
        """
        Stream.for_device(self.device.type).wait_stream(self._up)
        self._batches, self._position = [], {}
        self._queued.clear()
        written, self._written = self._written, set()
        return written
