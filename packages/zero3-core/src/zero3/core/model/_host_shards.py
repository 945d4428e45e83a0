"""Parameter offload to host memory with the model on an accelerator (``offload_param: cpu``).

Note (how a host shard reaches its gather):
    The shards of the non-persistent parameters live in host memory (page-locked with
    ``pin_memory``); persistent parameters stay on the device. A gather packs each shard
    into its send chunk on the compute stream, and a copy from the host there would be a
    blocking copy: on CUDA a host synchronisation per gather, which waits for all the
    work queued before it. So the coordinator hands this home the parameters its trace
    gathers next (``ParamCoordinator.read_ahead``, the call that reads a swap file
    ahead), and their shards are copied host→device without blocking, on an upload
    stream of their own, an event recorded after each copy. The gather that packs a
    shard makes the compute stream wait for that event (the host does not wait) and
    packs from the device copy, which is let go once packed.

    Memory: a device copy is allocated on the upload stream and, when its gather takes
    it, marked as used by the compute stream (``record_stream``), so the caching
    allocator hands its block out again only after the packing has run. The copies held
    at once are bounded by the coordinator's limit (the shard elements of one prefetch;
    one shard always): read-ahead adds at most that to what the gather window keeps on
    the device, and offload changes where shards live, not how long gathered copies are
    kept. A copy the trace has moved past is let go at the next read-ahead.

    Writes: the optimizer writes stepped values into the host shards
    (``ShardedParam.write_local``), loads and edit merges write them too, and anyone may
    edit a shard in place (``local_shard``). A device copy remembers the host tensor
    and its version counter at the copy, and one whose host shard was replaced or
    written since is never used: a write lets it go at once, an in-place edit is caught
    when the gather takes it. The step's order keeps this cheap: the optimizer writes
    every stepped shard, then ``commit_step`` reads the next step's first shards ahead,
    from the stepped values.

    A shard not read ahead (the first step, which records the trace; a diverged trace; a
    shard written since its copy) is packed from the host by a blocking copy, as before.
    :attr:`HostShards.stats` counts both kinds. Without page-locked memory the copies are
    still correct but not asynchronous for the host (CUDA stages pageable memory through
    a buffer of its own, and the host waits while it does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from zero3.comm import Event, Stream, TorchDeviceStream
from zero3.core.params._params import ShardedParam

__all__ = ["HostShardStats", "HostShards"]


@dataclasses.dataclass
class HostShardStats:
    """What the gathers of host shards found (this rank, since the model was sharded).

    Attributes:
        ahead: Shards packed from a copy read ahead onto the device (the compute stream
            waited for its copy, the host did not).
        on_demand: Shards packed from host memory by a blocking copy (not read ahead,
            or written since their copy).
        ahead_bytes: Bytes copied host→device ahead of their gathers.
        unused_bytes: Of those, bytes let go unused (the shard was written since, or
            the trace moved past it).
    """

    ahead: int = 0
    on_demand: int = 0
    ahead_bytes: int = 0
    unused_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class _DeviceCopy:
    """A host shard copied onto the device ahead of its gather."""

    tensor: torch.Tensor  # on the device, allocated on the upload stream
    source: torch.Tensor  # the host shard it was copied from
    version: int  # the source's version counter at the copy
    done: Event  # recorded on the upload stream after the copy

    def current(self, sp: ShardedParam) -> bool:
        """Whether ``sp``'s host shard is still what was copied (not replaced or written)."""
        return sp.held_shard is self.source and self.source._version == self.version

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def _state(shard: torch.Tensor) -> tuple[int, int]:
    """A shard's storage and in-place version: equal while nothing wrote to it."""
    return shard.data_ptr(), shard._version


class HostShards:
    """``offload_param: cpu`` with the model on an accelerator: this rank's shards of
    the non-persistent parameters in host memory, and their copies read ahead onto the
    device (a ``ShardHome`` whose shards are always resident; see the module Note).

    Args:
        pin: Page-lock the host shards (``offload_param.pin_memory``): a non-blocking
            copy is asynchronous only from page-locked memory.
    """

    #: A copy from host memory does not fail: gathers keep their usual fingerprint check.
    reads_can_fail = False

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.stats = HostShardStats()
        self._indices: set[int] = set()
        self._ahead: dict[int, _DeviceCopy] = {}  # by parameter index, in trace order
        self._upload: Stream | None = None  # made at the first read-ahead
        self._clean: dict[int, tuple[int, int]] = {}  # shard states the optimizer wrote

    # -- construction -----------------------------------------------------------------------

    def plan(self, indices: Iterable[int]) -> None:
        """The parameters (by index) whose shards go to host memory."""
        self._indices = set(indices)

    def store(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """A shard just cut: its host copy if parameter ``index``'s goes there, else
        ``shard``.
        """
        if index not in self._indices or shard.device.type == "cpu":
            return shard
        host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=self.pin)
        host.copy_(shard)
        return host

    def adopt(self, sp: ShardedParam) -> None:
        """Become the home of ``sp`` if its shard goes to host memory (moved there now
        unless :meth:`store` moved it as it was cut).
        """
        if sp.index not in self._indices:
            return
        sp.shard = self.store(sp.index, sp.held_shard)
        sp.home = self

    # -- the ShardHome protocol -----------------------------------------------------------------

    def bring_in(self, sp: ShardedParam) -> torch.Tensor:
        """The host shard (always resident: nothing to read back)."""
        return sp.held_shard

    def drop(self, sp: ShardedParam) -> None:
        """Nothing to let go: the host shard is the shard's home, and a copy read ahead
        stays until its gather takes it or a write outdates it.
        """

    def read_ahead(self, upcoming: Iterable[ShardedParam], limit_numel: int) -> None:
        """Copy the shards of ``upcoming`` (in gather order) onto the device, on the
        upload stream, until ``limit_numel`` shard elements are there or on the way
        (one shard always); copies out of that window are let go.
        """
        window: dict[int, ShardedParam] = {}
        room = limit_numel
        for sp in upcoming:
            if sp.home is not self or sp.index in window:
                continue
            if sp.shard_numel > room and window:
                break
            window[sp.index] = sp
            room -= sp.shard_numel
        for index in [i for i in self._ahead if i not in window]:
            self._let_go(index)  # the trace moved past it (or it was kept whole)
        todo = []
        for sp in window.values():
            entry = self._ahead.get(sp.index)
            if entry is not None and not entry.current(sp):
                self._let_go(sp.index)  # edited in place since: copy it again
                entry = None
            if entry is None:
                todo.append(sp)
        if todo:
            self._copy_ahead(todo)

    def for_gather(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s shard for the gather packing it on the current stream: its device
        copy if one was read ahead and is current (the stream waits for its event), else
        the host shard (the gather's copy from it blocks).
        """
        entry = self._ahead.pop(sp.index, None)
        if entry is not None and entry.current(sp):
            stream = Stream.for_device(sp.device.type)
            stream.wait_event(entry.done)
            # The block goes back to the upload stream's pool when the copy dies: not for
            # reuse before the packing queued on this stream has run.
            if isinstance(stream, TorchDeviceStream):
                entry.tensor.record_stream(stream.native)
            self.stats.ahead += 1
            return entry.tensor
        if entry is not None:
            self.stats.unused_bytes += entry.nbytes
        self.stats.on_demand += 1
        return sp.held_shard

    def write(self, sp: ShardedParam, values: torch.Tensor, *, edit: bool) -> None:
        """Set this rank's real elements of ``sp`` in its host shard (from the device:
        a blocking copy). A copy read ahead before is let go: it holds the old values.
        """
        self._let_go(sp.index)
        shard = sp.held_shard
        with torch.no_grad():
            shard[: values.numel()].copy_(values.reshape(-1))
        if edit:
            self._clean.pop(sp.index, None)
        else:
            self._clean[sp.index] = _state(shard)

    # -- the optimizer's masters and teardown ---------------------------------------------

    def take_edit(self, sp: ShardedParam) -> bool:
        """Whether ``sp``'s shard may have been set from outside the optimizer since the
        optimizer last wrote it or asked (a load, an in-place edit); asking clears it.
        True when unsure: the optimizer then compares the shard with its master.
        """
        now = _state(sp.held_shard)
        edited = self._clean.get(sp.index) != now
        self._clean[sp.index] = now
        return edited

    def clear(self) -> None:
        """Let every copy read ahead go (the model is unsharded)."""
        for index in list(self._ahead):
            self._let_go(index)

    # -- internals ------------------------------------------------------------------------------

    def _copy_ahead(self, params: list[ShardedParam]) -> None:
        """Queue the host→device copies of ``params``' shards on the upload stream."""
        device = params[0].device
        if self._upload is None:
            self._upload = Stream.for_device(device.type, new=True)
        upload = self._upload
        # Allocated on the upload stream (see the Note on memory); a normal tensor even
        # under inference_mode, since a training step's gather may take it.
        with upload.use(), torch.inference_mode(False):
            for sp in params:
                host = sp.held_shard
                copy = torch.empty(host.shape, dtype=host.dtype, device=device)
                copy.copy_(host, non_blocking=True)
                entry = _DeviceCopy(copy, host, host._version, upload.record_event())
                self._ahead[sp.index] = entry
                self.stats.ahead_bytes += entry.nbytes

    def _let_go(self, index: int) -> None:
        """Drop the copy read ahead for parameter ``index``, if any. Only the upload
        stream has used it, so its block may go back to that stream's pool at once.
        """
        entry = self._ahead.pop(index, None)
        if entry is not None:
            self.stats.unused_bytes += entry.nbytes
