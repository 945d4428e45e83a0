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
    packs from the device copy, which is let go once packed. The copies are kept by
    :class:`~zero3.core.model._device_copies.DeviceCopies`, as ``ParamSwap``'s are (the
    Note there says how their device and host memory is kept).

    Memory: the copies held at once are bounded by the coordinator's limit (the shard
    elements of one prefetch, or of one fetch unit where a prefetch is smaller; one
    shard always): read-ahead adds at most that to what
    the gather window keeps on the device, and offload changes where shards live, not
    how long gathered copies are kept. A copy the trace has moved past is let go at the
    next read-ahead.

    Writes: the optimizer writes stepped values into the host shards
    (``ShardedParam.write_local``), loads and edit merges write them too, and anyone may
    edit a shard in place (``local_shard``). A device copy remembers the host tensor
    and its version counter at the copy, and one whose host shard was replaced or
    written since is never used: a write lets it go at once (and first waits until no
    copy still reads the host shard it overwrites), an in-place edit is caught when the
    gather takes it. The step's order keeps this cheap: the optimizer writes
    every stepped shard, then ``commit_step`` reads the next step's first shards ahead,
    from the stepped values.

    A shard not read ahead (the first step, which records the trace; a diverged trace; a
    shard written since its copy) is packed from the host by a blocking copy, as before.
    :attr:`HostShards.stats` counts both kinds. Without page-locked memory the copies are
    still correct but not asynchronous for the host (CUDA stages pageable memory through
    a buffer of its own, and the host waits while it does).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zero3.core.model._device_copies import DeviceCopies, DeviceCopyStats, take_window
from zero3.core.params._params import ShardedParam

__all__ = ["HostShards"]


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

    #: Not set, since a copy from host memory does not fail; gathers keep their usual
    #: fingerprint check.
    reads_can_fail = False

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._indices: set[int] = set()
        self._copies = DeviceCopies()
        self._clean: dict[int, tuple[int, int]] = {}  # shard states the optimizer wrote

    @property
    def stats(self) -> DeviceCopyStats:
        """What the gathers of host shards found (``at_gather`` stays 0 here)."""
        return self._copies.stats

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
        window, _ = take_window(iter(upcoming), self, limit_numel)
        self._copies.copy_window(window, lambda sp: sp.held_shard)

    def for_gather(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s shard for the gather packing it on the current stream: its device
        copy if one was read ahead and is current (the stream waits for its event), else
        the host shard (the gather's copy from it blocks).
        """
        shard = self._copies.take(sp)
        if shard is not None:
            return shard
        self._copies.stats.on_demand += 1
        return sp.held_shard

    def write(self, sp: ShardedParam, values: torch.Tensor, *, edit: bool) -> None:
        """Set this rank's real elements of ``sp`` in its host shard (from the device:
        a blocking copy). A copy read ahead before is let go: it holds the old values.
        """
        self._copies.let_go(sp.index)
        shard = sp.held_shard
        self._copies.wait_reads_of(shard)  # the source of a copy is not written under it
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
        self._copies.clear()
