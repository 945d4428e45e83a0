"""Host shards copied onto the device ahead of their gathers (parameter offload with the
model on an accelerator), shared by both shard homes: ``HostShards`` (``offload_param:
cpu``, the shard itself in host memory) and ``ParamSwap`` (``nvme``, a shard read back
from its swap file into a host buffer).

Note (the life of a copy):
    A gather packs each shard into its send chunk on the compute stream; a copy from the
    host there is a blocking copy (on CUDA a host synchronisation per gather, which waits
    for everything queued before it). So a home hands :class:`DeviceCopies` the host
    tensor of a shard its next gathers need, and the copy is queued host→device with
    ``non_blocking`` on an upload stream of its own, an event recorded after it. The
    gather that packs the shard makes the compute stream wait for that event (the host
    does not wait) and packs from the copy.

    Device memory: a copy is allocated on the upload stream; the gather that takes it
    marks it as used by the compute stream (``record_stream``), so the caching allocator
    hands its block out again only after the packing ran. A copy let go unused was only
    used by the upload stream, whose pool may take it back at once. A home keeps at most
    one window of copies (:func:`take_window`: the coordinator's limit, one prefetch's
    shard elements or one fetch unit's where a prefetch is smaller, one shard always),
    so read-ahead adds at most that to what the gather window keeps on the device.

    Host memory: the host tensor is the source of an asynchronous copy, so it is not
    reused or freed before the copy's event has happened: every source is kept (with its
    event) until the event is found done, and a home that writes a source in place first
    waits for the copies still reading it (:meth:`DeviceCopies.wait_reads_of`). The host
    never waits for a copy otherwise.

    Outdated copies: a copy remembers its source and the source's version counter, and
    is used only while it is :meth:`current <_DeviceCopy.current>`. A home lets the copy
    of a shard it writes go at once; an in-place edit is caught by the version counter.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from zero3.comm import Event, Stream, TorchDeviceStream
from zero3.core.params._params import ShardedParam, ShardHome

__all__ = ["DeviceCopies", "DeviceCopyStats", "take_window"]


@dataclasses.dataclass
class DeviceCopyStats:
    """What the gathers of offloaded shards found on the device (this rank, since the
    model was sharded).

    Attributes:
        ahead: Shards packed from a copy queued before their gather asked for it (the
            compute stream waited for the copy, the host did not).
        at_gather: Shards whose copy their gather queued itself (``nvme``: the shard's
            read was not in when the copies were last queued; the gather waited for the
            read if it was still in flight, never for the copy).
        on_demand: Shards packed from host memory by a blocking copy (``cpu``: not read
            ahead, or written since their copy; ``nvme``: read back outside the gather
            path, so perhaps edited in place).
        ahead_bytes: Bytes copied host→device ahead of their gathers.
        unused_bytes: Of those, bytes let go unused (the shard was written since, or
            the trace moved past it).
    """

    ahead: int = 0
    at_gather: int = 0
    on_demand: int = 0
    ahead_bytes: int = 0
    unused_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class _DeviceCopy:
    """A host tensor of a shard, copied onto the device."""

    tensor: torch.Tensor  # on the device, allocated on the upload stream
    source: torch.Tensor  # the host tensor it was copied from
    version: int  # the source's version counter at the copy
    done: Event  # recorded on the upload stream after the copy

    def current(self, sp: ShardedParam) -> bool:
        """Whether the copy still holds ``sp``'s values: its source is unwritten and is
        the shard held now, or nothing is held (the shard is out in its file, which a
        write reaches only through its home, and the home lets this copy go then).
        """
        if self.source._version != self.version:
            return False
        return sp.held_shard is self.source or not sp.resident

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def take_window(
    upcoming: Iterator[ShardedParam], home: ShardHome, limit_numel: int
) -> tuple[dict[int, ShardedParam], ShardedParam | None]:
    """The first shards of ``upcoming`` (in gather order) that ``home`` keeps, until
    ``limit_numel`` shard elements (one shard always), by parameter index; and the
    shard past them that ended the window (taken from ``upcoming``), if any.
    """
    window: dict[int, ShardedParam] = {}
    room = limit_numel
    for sp in upcoming:
        if sp.home is not home or sp.index in window:
            continue
        if sp.shard_numel > room and window:
            return window, sp
        window[sp.index] = sp
        room -= sp.shard_numel
    return window, None


class DeviceCopies:
    """A home's copies of host shards on the device, by parameter index (see the module
    Note): queued on an upload stream of their own, taken by the gathers that pack them.
    """

    def __init__(self) -> None:
        self.stats = DeviceCopyStats()
        self._copies: dict[int, _DeviceCopy] = {}  # by parameter index, in trace order
        self._upload: Stream | None = None  # made at the first copy
        # Every source with the event after its copy, oldest first (one stream: they
        # happen in this order); dropped once its event is found done.
        self._in_use: collections.deque[tuple[Event, torch.Tensor]] = collections.deque()

    def has(self, sp: ShardedParam) -> bool:
        """Whether a current copy of ``sp``'s shard is on the device or on its way (an
        outdated one is let go).
        """
        entry = self._copies.get(sp.index)
        if entry is not None and not entry.current(sp):
            self.let_go(sp.index)
            return False
        return entry is not None

    def keep_only(self, indices: Iterable[int]) -> None:
        """Let every copy go but those of the parameters ``indices`` (the trace moved
        past them, or they are whole now).
        """
        keep = set(indices)
        for index in [i for i in self._copies if i not in keep]:
            self.let_go(index)

    def copy_window(
        self,
        window: dict[int, ShardedParam],
        values_of: Callable[[ShardedParam], torch.Tensor | None],
    ) -> None:
        """Keep copies of ``window``'s shards only (:func:`take_window`), and queue one
        for each shard of it that has no current copy yet and whose host values
        ``values_of`` gives now (None: not in memory yet), for the gathers that will
        take them.
        """
        self.keep_only(window)  # the trace moved past the others (or they are whole)
        todo = []
        for sp in window.values():
            if self.has(sp):
                continue
            values = values_of(sp)
            if values is not None:
                todo.append((sp, values))
        if not todo:
            return
        for (sp, _), entry in zip(todo, self._queue(todo), strict=True):
            self._copies[sp.index] = entry
            self.stats.ahead_bytes += entry.nbytes

    def take(self, sp: ShardedParam) -> torch.Tensor | None:
        """``sp``'s copy for the gather packing it on the current stream, which waits for
        it; None where there is no current one (an outdated one is let go).
        """
        entry = self._copies.pop(sp.index, None)
        if entry is None:
            return None
        if not entry.current(sp):
            self.stats.unused_bytes += entry.nbytes
            return None
        self.stats.ahead += 1
        return self._hand_over(sp, entry)

    def copy_now(self, sp: ShardedParam, source: torch.Tensor) -> torch.Tensor:
        """A copy of ``source`` (``sp``'s values) for the gather packing it now: queued on
        the upload stream like the others, and the current stream waits for it.
        """
        (entry,) = self._queue([(sp, source)])
        self.stats.at_gather += 1
        return self._hand_over(sp, entry)

    def let_go(self, index: int) -> None:
        """Drop the copy of parameter ``index``'s shard, if any (its source stays kept
        until the copy is over).
        """
        entry = self._copies.pop(index, None)
        if entry is not None:
            self.stats.unused_bytes += entry.nbytes

    def wait_reads_of(self, source: torch.Tensor) -> None:
        """Block the host until no queued copy reads ``source`` any more (it is about to
        be written in place). Copies queued long ago are over: this rarely waits.
        """
        for done, tensor in self._in_use:
            if tensor is source and not done.query():
                done.synchronize()

    def clear(self) -> None:
        """Let every copy go and wait until none reads its source (the model is unsharded:
        the sources may go with the home).
        """
        for index in list(self._copies):
            self.let_go(index)
        for done, _ in self._in_use:
            if not done.query():
                done.synchronize()
        self._in_use.clear()

    # -- internals ------------------------------------------------------------------------------

    def _queue(self, shards: Sequence[tuple[ShardedParam, torch.Tensor]]) -> list[_DeviceCopy]:
        """Queue host→device copies on the upload stream, an event after each."""
        self._forget_finished()
        device = shards[0][0].device
        if self._upload is None:
            self._upload = Stream.for_device(device.type, new=True)
        upload = self._upload
        entries = []
        # Allocated on the upload stream (see the Note); a normal tensor even under
        # inference_mode, since a training step's gather may take it.
        with upload.use(), torch.inference_mode(False):
            for _, source in shards:
                copy = torch.empty(source.shape, dtype=source.dtype, device=device)
                copy.copy_(source, non_blocking=True)
                entry = _DeviceCopy(copy, source, source._version, upload.record_event())
                self._in_use.append((entry.done, source))
                entries.append(entry)
        return entries

    def _hand_over(self, sp: ShardedParam, entry: _DeviceCopy) -> torch.Tensor:
        """Order the current stream after ``entry``'s copy and give the copy to it."""
        stream = Stream.for_device(sp.device.type)
        stream.wait_event(entry.done)
        # The block goes back to the upload stream's pool when the copy dies: not for
        # reuse before the packing queued on this stream has run.
        if isinstance(stream, TorchDeviceStream):
            entry.tensor.record_stream(stream.native)
        self._forget_finished()
        return entry.tensor

    def _forget_finished(self) -> None:
        """Stop keeping the sources whose copies are over (the host does not wait)."""
        while self._in_use and self._in_use[0][0].query():
            self._in_use.popleft()
