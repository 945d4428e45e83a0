"""Optimizer offload: each sub-group's fp32 masters and optimizer state off the device.

Note (how a step runs with ``offload_optimizer: nvme``):
    Every offloaded sub-group has one swap file (this rank's, this run's) holding its
    record: the fp32 master (where it is a separate copy: bf16/fp16 parameters) and each
    per-element state tensor of the wrapped optimizer, back to back. Between steps the
    masters' storages are empty and the state entries are empty placeholders, so host
    memory holds none of it. ``step()`` walks the sub-groups in order: the reads of the
    next ones are queued on the I/O threads while the current one steps, and the
    previous ones' writes run behind; at most ``buffer_count`` sub-groups' worth of
    page-aligned buffers (``OffloadStore.budget_bytes()``) are in flight, and all
    writes are complete when ``step()`` returns. The first records' reads, up to half
    that budget, start when the step's backward is half done (a listener on the model's
    step), so they overlap the rest of the backward instead of opening the walk with a
    wait, and land after the activations' peak. A
    record is read straight into its buffer and the tensors the wrapped optimizer knows
    (its parameters, its state) are re-pointed at it, so identity and per-parameter
    semantics are kept for any torch-style optimizer.

    Faults are agreed before anything steps and again before anything is written back
    (a one-element all-reduce each): if any rank's file is gone, truncated, short or
    unwritable, or its walk failed otherwise (no memory for a buffer, the wrapped
    optimizer's step raising), every rank raises :class:`OffloadError` with that rank's
    message.

    Edits to a parameter made while its master is on disk (loading, ``gathered_parameters``)
    reach the shard only; when the master is read back, elements whose shard no longer
    equals the master's rounding take the shard's value.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zero3.core.engine import (
    AlignedBuffer,
    IOPool,
    ShardedModelState,
    ShardedParam,
    SwapError,
    SwapFile,
    check_free_space,
    make_swap_dir,
    raise_if_any_rank_failed,
    round_up,
)

#: The optimizer's step of one batch of its own sub-groups (a class this module reads only
#: through the SubGroup protocol, so the callback takes them as they come).
StepBatch = Callable[[list[Any]], None]

if TYPE_CHECKING:
    from zero3.core import OffloadOptimizerConfig
    from zero3.optim._optim_checkpoint import SubGroup

__all__ = [
    "ALIGN",
    "OffloadError",
    "OffloadStats",
    "OffloadStore",
    "Segment",
    "Slot",
    "offloaded_count",
    "owners_of",
]

_log = logging.getLogger("zero3.optim")
ALIGN = 64  # bytes between state segments: any dtype's view is aligned


class OffloadError(RuntimeError):
    """Offloaded optimizer state could not be stored or read back (raised on every rank)."""


@dataclasses.dataclass
class OffloadStats:
    """Where the last offloaded step's time went and what moved (this rank).

    Attributes:
        io_wait_s: Seconds ``step()`` waited for reads and writes.
        step_s: Seconds of the whole offloaded step walk (stepping + waiting; with
            ``cpu`` on an accelerator, the host-side step with its copies).
        read_bytes: Bytes read from swap files.
        read_ahead_bytes: Of those, bytes whose read started during the backward (at
            its half).
        written_bytes: Bytes written to swap files.
        peak_in_flight_bytes: Most bytes of record buffers held at once by the walk
            (reads, writes and the records stepping): at most
            ``OffloadStore.budget_bytes()``, or, where the records of the batch
            stepping fill that alone, those plus the one record being read.
        copy_wait_s: With the model on an accelerator: seconds the host waited for
            gradient shards to reach it and for upload buffers to be free again.
        to_host_bytes: Gradient bytes copied device→host (model on an accelerator).
        to_device_bytes: Stepped shard bytes copied host→device (likewise).
    """

    io_wait_s: float = 0.0
    step_s: float = 0.0
    read_bytes: int = 0
    read_ahead_bytes: int = 0
    written_bytes: int = 0
    peak_in_flight_bytes: int = 0
    copy_wait_s: float = 0.0
    to_host_bytes: int = 0
    to_device_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Segment:
    owner: int  # position among the sub-group's optimizer tensors; -1: the master
    key: str
    dtype: torch.dtype
    numel: int
    offset: int


@dataclasses.dataclass(eq=False)
class Slot:
    sg: SubGroup
    index: int
    file: SwapFile
    swap_master: bool
    layout: tuple[Segment, ...] = ()
    nbytes: int = 0
    reserved: int = 0
    on_disk: bool = False
    resident: bool = True
    buffer: AlignedBuffer | None = None


#: Failures of one rank's walk that every rank raises (an I/O error, or no host memory
#: for a record's buffer): the others must not step on, or wait in the next collective.
_AGREED = (SwapError, MemoryError)


@functools.cache
def _say_once(message: str) -> None:
    _log.info(message)


def _state_of(shard: torch.Tensor) -> tuple[int, int]:
    """A shard's storage and in-place version: equal while nothing wrote to it."""
    return shard.data_ptr(), shard._version


def offloaded_count(config: OffloadOptimizerConfig, subgroups: int) -> int:
    """How many of the first sub-groups ``ratio`` offloads (DeepSpeed's partial offload)."""
    return math.ceil(config.ratio * subgroups - 1e-9) if config.enabled else 0


def owners_of(sg: SubGroup, flat: bool) -> list[torch.Tensor]:
    return [sg.master] if flat and sg.master is not None else list(sg.views)


def _per_element(owner: torch.Tensor, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == owner.shape


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


def refuse_global_state(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose state spans parameters (they cannot step per sub-group)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "offload_optimizer: LBFGS keeps one history across all parameters and "
            "re-evaluates the closure inside step(), so it cannot step one offloaded "
            "sub-group at a time; use a per-parameter optimizer (AdamW, SGD, Adagrad...) "
            'or set offload_optimizer {"device": "none"}'
        )


class OffloadStore:
    """The offloaded sub-groups of one PartitionedOptimizer and their swap files.

    Made by the optimizer (``PartitionedOptimizer.offload``), not by users: read its
    ``stats`` (I/O of the last step) and ``files``, or ``close()`` it to remove the swap
    files before the optimizer is garbage-collected.
    """

    def __init__(
        self,
        zstate: ShardedModelState,
        optimizer: torch.optim.Optimizer,
        subgroups: Sequence[SubGroup],
        flat: bool,
    ) -> None:
        config = zstate.config
        self.config: OffloadOptimizerConfig = config.offload_optimizer
        self._zstate = zstate
        self._optimizer = optimizer
        self._flat = flat
        self.stats = OffloadStats()
        self.kind = self.config.device
        refuse_global_state(optimizer)
        self._offloaded = list(subgroups[: offloaded_count(self.config, len(subgroups))])
        self._slots: dict[int, Slot] = {}
        self._dir: Path | None = None
        self._pool: IOPool | None = None
        # Reads started during the backward, by slot index (taken by the next walk).
        self._ahead: dict[int, Future[AlignedBuffer]] = {}
        device = subgroups[0].params[0].device if subgroups else torch.device("cpu")
        #: Whether the shards are on an accelerator: the offloaded sub-groups' masters are
        #: host copies and the optimizer steps them there (``HostStepper`` moves the data).
        self.host_stepped = device.type != "cpu" and bool(self._offloaded)
        self._pin = self.config.pin_memory and device.type != "cpu"
        # Shards as the last step left them, (data pointer, version) by parameter index,
        # and the ones unchanged when the current walk began: a master read back needs
        # no comparison with an unchanged shard.
        self._versions: dict[int, tuple[int, int]] = {}
        self._clean: set[int] = set()
        if self.config.pin_memory and device.type == "cpu":
            _say_once(
                "zero3: offload_optimizer.pin_memory is a no-op without an accelerator "
                "(host memory needs no page-locking to be read by the CPU)"
            )
        if self.kind == "cpu":
            if device.type == "cpu":
                _say_once(
                    "zero3: offload_optimizer cpu on a CPU run: the masters and optimizer "
                    "state are in host memory already, nothing moves"
                )
            return
        error: BaseException | None = None
        try:
            self._open_files(config.aio.thread_count, config.aio.use_direct_io,
                             config.aio.block_size)  # fmt: skip
            self._swap_out_masters()
        except (SwapError, OSError) as exc:
            error = exc
        self.agree(error)
        zstate.step.on_backward(self.read_ahead)

    # -- files ----------------------------------------------------------------------------

    def _open_files(self, threads: int, direct: bool, block_size: int) -> None:
        assert self.config.nvme_path is not None
        rank = self._zstate.comm.rank
        self._dir, _ = make_swap_dir(Path(self.config.nvme_path), "optim", rank)
        self._pool = IOPool(threads, name=f"zero3-io-r{rank}")
        estimate = sum(self._estimate(sg) for sg in self._offloaded)
        check_free_space(self._dir, estimate, f"rank {rank}'s offloaded optimizer state")
        for i, sg in enumerate(self._offloaded):
            file = SwapFile(self._dir / f"subgroup{i:05d}.swp", direct=direct,
                            block_size=block_size)  # fmt: skip
            swap_master = sg.master is not None and not any(sg.aliased)
            self._slots[id(sg)] = Slot(sg, i, file, swap_master)
        # Swap files go when the optimizer does, or at exit (also after an error).
        weakref.finalize(
            self, _cleanup, self._dir, self._pool, [s.file for s in self._slots.values()]
        )

    def _estimate(self, sg: SubGroup) -> int:
        """Swap bytes of a sub-group: its master plus two fp32 moments (Adam's)."""
        master = sg.numel * 4 if sg.master is not None and not any(sg.aliased) else 0
        state = sum(v.numel() for v in owners_of(sg, self._flat)) * 4 * 2
        return round_up(master + state + ALIGN * 8)

    @property
    def files(self) -> list[Path]:
        """This rank's swap files (``nvme``)."""
        return [s.file.path for s in self._slots.values()]

    @property
    def directory(self) -> Path | None:
        """This rank's swap directory (``nvme``)."""
        return self._dir

    @property
    def direct_io(self) -> bool:
        """Whether every swap file is read and written with ``O_DIRECT``."""
        return all(s.file.direct for s in self._slots.values())

    @property
    def nvme(self) -> bool:
        """Whether state moves to swap files (``device: nvme`` with something offloaded)."""
        return bool(self._slots)

    def offloaded_bytes(self) -> int:
        """Bytes of this rank's state held in swap files after the last write."""
        return sum(s.nbytes for s in self._slots.values() if s.on_disk)

    def offloaded_split(self) -> tuple[int, int, int]:
        """What is now only in swap files: (master bytes, optimizer-state bytes, elements
        whose master is out), for ``memory_stats``.
        """
        master = state = numel = 0
        for slot in self._slots.values():
            if slot.on_disk and not slot.resident:
                for seg in slot.layout:
                    nbytes = seg.numel * seg.dtype.itemsize
                    if seg.owner < 0:
                        master += nbytes
                    else:
                        state += nbytes
                if slot.swap_master:  # its views (one per parameter shard) are empty now
                    numel += sum(sp.local_numel for sp in slot.sg.params)
        return master, state, numel

    def read_ahead(self) -> None:
        """Start reading the first offloaded records the next step walks, as many as
        fit in half of :meth:`budget_bytes`, and at least one (the model's step calls
        this when a backward is half done).
        """
        if self._pool is None or self._ahead:
            return
        # Half the walk's budget: these buffers are held through the backward's end,
        # where the gradients peak, and the walk needs only its first records ready; the
        # other half is for the reads it queues as it starts. The first record is read
        # even if it alone is larger, so the walk does not open with a wait.
        budget, queued = self.budget_bytes() // 2, 0
        for slot in self._slots.values():
            if not slot.resident and slot.on_disk:
                if queued and queued + slot.nbytes > budget:
                    break
                queued += slot.nbytes
                self._ahead[slot.index] = self._pool.submit(
                    functools.partial(self.read_record, slot)
                )

    def budget_bytes(self) -> int:
        """Bytes of record buffers a walk keeps in flight (reads, writes and the records
        stepping): ``buffer_count`` records of a full sub-group (``sub_group_size``
        elements). A parameter larger than a sub-group makes a larger record, which then
        takes the room of several: counting records instead let a model whose largest
        tensors exceed ``sub_group_size`` (alone, every embedding does) hold
        ``buffer_count`` of its largest records at once, as much as the state moved out.
        """
        records = [s for s in self._slots.values() if s.nbytes and s.sg.numel]
        if not records:
            return 0
        largest = max(records, key=lambda s: s.nbytes)  # the least padded per element
        full = min(self._zstate.config.sub_group_size * largest.nbytes / largest.sg.numel,
                   largest.nbytes)  # fmt: skip
        return int(self.config.buffer_count * full)

    def settle_ahead(self) -> None:
        """Wait for reads started ahead and drop them: the caller reads or writes the
        files itself (and meets any error there).
        """
        ahead, self._ahead = self._ahead, {}
        for future in ahead.values():
            with contextlib.suppress(*_AGREED):
                future.result()

    def close(self) -> None:
        """Remove the swap files and stop the I/O threads."""
        self.settle_ahead()
        _cleanup(self._dir, self._pool, [s.file for s in self._slots.values()])
        self._slots.clear()

    # -- layout, install, pack ------------------------------------------------------------

    def layout_of(self, slot: Slot) -> tuple[tuple[Segment, ...], int]:
        sg, segs, cursor = slot.sg, [], 0
        if slot.swap_master:
            assert sg.master is not None
            segs.append(Segment(-1, "", torch.float32, sg.numel, 0))
            cursor = sg.numel * 4
        for k, owner in enumerate(owners_of(sg, self._flat)):
            for key, value in self._optimizer.state.get(owner, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and not _per_element(owner, value)
                ):
                    raise ValueError(
                        f"offload_optimizer: {type(self._optimizer).__name__} keeps state "
                        f"{key!r} of shape {tuple(value.shape)} for a tensor of shape "
                        f"{tuple(owner.shape)}: only per-element state (shaped like its "
                        "parameter) and scalars can be offloaded per sub-group"
                    )
                if _per_element(owner, value):
                    cursor = round_up(cursor, ALIGN)
                    segs.append(Segment(k, key, value.dtype, value.numel(), cursor))
                    cursor += value.numel() * value.element_size()
        return tuple(segs), round_up(cursor)

    def _install(self, slot: Slot, buf: AlignedBuffer) -> None:
        """Point the masters and state of ``slot`` at ``buf`` (just read)."""
        sg, owners = slot.sg, owners_of(slot.sg, self._flat)
        for seg in slot.layout:
            region = buf.tensor[seg.offset : seg.offset + seg.numel * seg.dtype.itemsize]
            values = region.view(seg.dtype)
            if seg.owner < 0:
                self._install_master(sg, values)
            else:
                self._optimizer.state[owners[seg.owner]][seg.key] = values
        slot.buffer, slot.resident = buf, True

    def _install_master(self, sg: SubGroup, values: torch.Tensor) -> None:
        assert sg.master is not None
        sg.master.set_(values)  # type: ignore[call-overload]
        for sp, offset, view in zip(sg.params, sg.offsets, sg.views, strict=True):
            n = sp.local_numel
            view.set_(values[offset : offset + n])  # type: ignore[call-overload]
            sp.master = view
            # An edit made while the master was out reached the shard only: take it. An
            # offloaded shard says whether it was edited; another one is compared only
            # if it changed since the last step wrote it.
            if sp.home is not None and not self._zstate.take_shard_edit(sp):
                continue
            if sp.home is None and sp.index in self._clean:
                continue
            shard = sp.shard[:n].to(view.device)  # a device shard: read to the host
            edited = shard != view.to(shard.dtype)
            if bool(edited.any()):
                view[edited] = shard[edited].to(torch.float32)

    def _pack(self, slot: Slot) -> AlignedBuffer:
        """Gather ``slot``'s masters and state into one buffer and empty the tensors the
        optimizer holds; returns the buffer to write.
        """
        sg, owners = slot.sg, owners_of(slot.sg, self._flat)
        layout, nbytes = self.layout_of(slot)
        old = slot.buffer
        buf = (
            old
            if old is not None and layout == slot.layout
            else AlignedBuffer(nbytes, pin=self._pin)
        )
        for seg in layout:
            src = sg.master if seg.owner < 0 else self._optimizer.state[owners[seg.owner]][seg.key]
            assert src is not None
            dst = buf.tensor[seg.offset : seg.offset + seg.numel * seg.dtype.itemsize]
            if src.data_ptr() != dst.data_ptr():
                dst.view(seg.dtype).copy_(src)
        slot.layout, slot.nbytes = layout, nbytes
        self.release(slot)
        return buf

    def release(self, slot: Slot) -> None:
        """Drop the optimizer's references to ``slot``'s masters and state."""
        sg, owners = slot.sg, owners_of(slot.sg, self._flat)
        for seg in slot.layout:
            if seg.owner >= 0:
                state = self._optimizer.state[owners[seg.owner]]
                state[seg.key] = _empty_like(state[seg.key])
        if slot.swap_master:
            assert sg.master is not None
            for sp, view in zip(sg.params, sg.views, strict=True):
                sp.master = None
                view.set_(_empty_like(view))  # type: ignore[call-overload]
            sg.master.set_(_empty_like(sg.master))  # type: ignore[call-overload]
        slot.buffer, slot.resident = None, False

    def mark_written(self, params: Sequence[ShardedParam]) -> None:
        """The step wrote these parameters' shards from their masters (as they are now)."""
        for sp in params:
            if sp.home is None:  # an offloaded shard says itself whether it was edited
                self._versions[sp.index] = _state_of(sp.held_shard)

    def _note_clean(self) -> None:
        """Which offloaded masters' shards are still as the last step wrote them."""
        self._clean = {
            sp.index
            for slot in self._slots.values()
            for sp in slot.sg.params
            if sp.home is None and self._versions.get(sp.index) == _state_of(sp.held_shard)
        }

    def _commit_shards(self, slot: Slot) -> None:
        """Stepped masters into the shards before the masters leave (commit_step then
        finds no master to copy for them).
        """
        if slot.swap_master:
            for sp, view in zip(slot.sg.params, slot.sg.views, strict=True):
                sp.write_local(view, masters=False, stepped=True)

    # -- moving ---------------------------------------------------------------------------

    def write_record(self, slot: Slot, buf: AlignedBuffer) -> None:
        if slot.nbytes > slot.reserved:
            slot.file.reserve(slot.nbytes)
            slot.reserved = slot.nbytes
        slot.file.write(buf, slot.nbytes)

    def read_record(self, slot: Slot) -> AlignedBuffer:
        buf = AlignedBuffer(slot.nbytes, pin=self._pin)
        slot.file.read(buf, slot.nbytes)
        return buf

    def _swap_out_masters(self) -> None:
        """At construction: masters go to their files at once (nothing held)."""
        for slot in self._slots.values():
            slot.layout, slot.nbytes = self.layout_of(slot)
            if slot.nbytes == 0:
                self.release(slot)
                continue
            buf = self._pack(slot)
            self.write_record(slot, buf)
            slot.on_disk = True

    def bring_all_in(self) -> None:
        """Read every offloaded sub-group back (checkpoints, ``state_dict``); they stay
        in memory until the next step writes them out again.
        """
        self.settle_ahead()
        self._note_clean()
        error: BaseException | None = None
        try:
            for slot in self._slots.values():
                if not slot.resident and slot.on_disk:
                    slot.file.check(slot.nbytes)
                    self._install(slot, self.read_record(slot))
                elif not slot.resident:
                    slot.resident = True
        except _AGREED as exc:
            error = exc
        self.agree(error)

    def write_all_out(self) -> None:
        """Write every resident offloaded sub-group to its file (after loading state)."""
        self.settle_ahead()
        error: BaseException | None = None
        try:
            for slot in self._slots.values():
                if slot.resident:
                    self._commit_shards(slot)
                    buf = self._pack(slot)
                    if slot.nbytes:
                        self.write_record(slot, buf)
                        slot.on_disk = True
        except _AGREED as exc:
            error = exc
        self.agree(error)

    # -- the step walk --------------------------------------------------------------------

    def run(self, batches: Sequence[Sequence[SubGroup]], step: StepBatch) -> None:
        """Step ``batches`` (lists of sub-groups) in order with ``step``, swapping the
        offloaded ones in ahead and out behind; all writes done on return.
        """
        start = time.perf_counter()
        self._note_clean()  # before the walk's own writes change any shard
        error: BaseException | None = None
        try:
            for slot in self._slots.values():
                if not slot.resident and slot.on_disk:
                    slot.file.check(slot.nbytes)
        except _AGREED as exc:
            error = exc
        self.agree(error)  # before anything steps
        walk = _Walk(self, batches)
        try:
            walk.run(step)
        except Exception as exc:  # agreed below, then raised on every rank
            # Not only I/O: the wrapped optimizer's step failing on one rank (torch out of
            # host memory raises a plain RuntimeError) must not leave the others waiting
            # in the agreement below.
            error = exc if isinstance(exc, _AGREED) else _failed_step(exc)
        try:
            walk.drain()
        except _AGREED as exc:
            error = error or exc
        self.stats.step_s = time.perf_counter() - start
        self.agree(error)  # before anything is written back into the model

    def slot(self, sg: SubGroup) -> Slot | None:
        """The swap slot of an offloaded sub-group (None: stays in memory)."""
        return self._slots.get(id(sg))

    def slots(self) -> list[Slot]:
        """The swap slots of the offloaded sub-groups, in order."""
        return list(self._slots.values())

    @property
    def flat(self) -> bool:
        """Whether the wrapped optimizer sees one tensor per sub-group."""
        return self._flat

    # -- agreeing on faults ---------------------------------------------------------------

    def agree(self, error: BaseException | None) -> None:
        """Every rank raises the same OffloadError if any rank failed (a collective)."""
        zstate = self._zstate
        raise_if_any_rank_failed(
            zstate.all_reduce, zstate.comm.rank, zstate.grad_comm.device(), error,
            lambda message: OffloadError(f"optimizer offload failed on {message}"),
        )  # fmt: skip


class _Walk:
    """One step's pass over the sub-groups: read-ahead and write-behind in a bounded
    number of buffers.
    """

    def __init__(self, store: OffloadStore, batches: Sequence[Sequence[SubGroup]]) -> None:
        self.store = store
        self.batches = [list(b) for b in batches]
        self.order = [s for b in self.batches for sg in b if (s := store.slot(sg)) is not None]
        # In bytes. A read is queued when its record fits under the limit with the bytes
        # in flight, or when no I/O is in flight at all: the records of a batch being
        # stepped may fill the limit alone, and the walk must go on.
        self.limit = store.budget_bytes()
        # The reads the backward started (the first records of this same order).
        self.reads: dict[int, Future[AlignedBuffer]] = store._ahead
        store._ahead = {}
        self.writes: collections.deque[tuple[Future[None], int]] = collections.deque()
        self.reading = 0  # bytes of the reads in flight
        self.stepping = 0  # bytes of the records swapped in for the batch stepping
        self.next = 0  # the next position in ``order`` whose read may be queued
        for position, slot in enumerate(self.order):
            if slot.index in self.reads:  # a prefix of the eligible slots: queue after it
                store.stats.read_bytes += slot.nbytes
                store.stats.read_ahead_bytes += slot.nbytes
                self.reading += slot.nbytes
                self.next = position + 1

    def _wait(self, future: Future[Any]) -> Any:
        begin = time.perf_counter()
        try:
            return future.result()
        finally:
            self.store.stats.io_wait_s += time.perf_counter() - begin

    def _used(self) -> int:
        used = self.reading + sum(n for _, n in self.writes) + self.stepping
        stats = self.store.stats
        stats.peak_in_flight_bytes = max(stats.peak_in_flight_bytes, used)
        return used

    def _upcoming(self) -> Slot | None:
        """The next record the walk has to read (None: all are queued or resident)."""
        while self.next < len(self.order):
            slot = self.order[self.next]
            if not slot.resident and slot.on_disk and slot.index not in self.reads:
                return slot
            self.next += 1
        return None

    def _fits(self, slot: Slot) -> bool:
        return self._used() + slot.nbytes <= self.limit or not (self.reading or self.writes)

    def _reap(self, *, block: bool) -> None:
        """Take finished writes; ``block``: wait for writes until the next read fits."""
        while self.writes and (
            self.writes[0][0].done()
            or (block and (slot := self._upcoming()) is not None and not self._fits(slot))
        ):
            self._wait(self.writes.popleft()[0])

    def _fill(self) -> None:
        pool = self.store._pool
        assert pool is not None
        while (slot := self._upcoming()) is not None and self._fits(slot):
            self.next += 1
            self.reads[slot.index] = pool.submit(functools.partial(self.store.read_record, slot))
            self.reading += slot.nbytes
            self.store.stats.read_bytes += slot.nbytes

    def _swap_in(self, slot: Slot) -> int:
        """Make ``slot``'s record resident; returns the bytes it counts while stepping."""
        while slot.index not in self.reads and not slot.resident and slot.on_disk:
            self._reap(block=True)
            self._fill()
        future = self.reads.pop(slot.index, None)
        if future is not None:
            self.reading -= slot.nbytes
            self.store._install(slot, self._wait(future))
        slot.resident = True
        self.stepping += slot.nbytes
        self._used()  # counts the peak
        return slot.nbytes

    def run(self, step: StepBatch) -> None:
        store, pool = self.store, self.store._pool
        assert pool is not None
        self._fill()
        for batch in self.batches:
            slots = [s for sg in batch if (s := store.slot(sg)) is not None]
            counted = [self._swap_in(slot) for slot in slots]
            step(batch)
            for slot, nbytes in zip(slots, counted, strict=True):
                if not store.host_stepped:  # else the step has queued the shards' uploads
                    store._commit_shards(slot)
                buf = store._pack(slot)  # the record may have grown (state made by the step)
                self.stepping -= nbytes
                if slot.nbytes:
                    write = pool.submit(functools.partial(store.write_record, slot, buf))
                    self.writes.append((write, slot.nbytes))
                    store.stats.written_bytes += slot.nbytes
                    slot.on_disk = True
            self._reap(block=False)
            self._fill()

    def drain(self) -> None:
        """Wait for every read and write still in flight (re-raising the first error)."""
        first: BaseException | None = None
        futures: list[Future[Any]] = [*self.reads.values(), *(w for w, _ in self.writes)]
        for future in futures:
            try:
                self._wait(future)
            except BaseException as exc:
                first = first or exc
        self.reads.clear()
        self.writes.clear()
        self.reading = 0
        if first is not None:
            raise first


def _failed_step(exc: Exception) -> Exception:
    """The error agreed for a failure of the walk other than I/O or a record buffer: it
    names the exception's type (its text alone may not) and chains to it.
    """
    error = RuntimeError(f"{type(exc).__name__} while stepping offloaded sub-groups: {exc}")
    error.__cause__ = exc
    return error


def _cleanup(directory: Path | None, pool: IOPool | None, files: list[SwapFile]) -> None:
    if pool is not None:
        pool.close()
    for f in files:
        f.close(unlink=True)
    if directory is not None:
        with contextlib.suppress(OSError):
            directory.rmdir()
