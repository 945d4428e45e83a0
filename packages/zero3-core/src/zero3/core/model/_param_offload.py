"""Parameter offload (``offload_param: nvme``): parameter shards on disk between uses.

Note (how a shard moves):
    Each rank has one swap file for this run, with a page-aligned region per offloaded
    shard. Between uses a shard's tensor is empty, so host memory holds none of it. A
    gather needs the shard only while it packs it into its send chunk: the coordinator
    reads shards ahead in trace order (at most ``buffer_count`` reads in flight, on
    the I/O threads) and the gather drops the shard as soon as it is packed. An
    optimizer step writes the stepped values straight to the file; the writes are
    complete, and every rank has agreed that they succeeded, when the step's commit
    returns. Any other reader of a shard (a state dict, a merge of in-place edits, a
    checkpoint) reads it on demand (:class:`~zero3.core.params._params.ShardHome`).

    A read that fails inside a gather does not leave the other ranks waiting: the rank
    sends its chunk with an "I/O failed" fingerprint and every rank raises at that
    gather's finish, naming the rank and the parameter (gathers of offloaded shards
    check their fingerprints at once).

    Construction streams: the swap file is laid out from the parameters' sizes before
    any shard exists, and each shard the materializer cuts goes to the file at once
    (:meth:`ParamSwap.store`), so building a model never holds more of its offloaded
    shards in memory than the writes in flight.

    ``max_in_cpu`` keeps the first shards (parameter order) up to that many elements in
    memory for good; DeepSpeed's default (10⁹) keeps every shard of a model with fewer
    elements per rank in memory, which is logged at setup with the count.

    With the model on an accelerator a shard goes on from its host buffer to the device
    ahead of its gather, as ``HostShards``' do (the same
    :class:`~zero3.core.model._device_copies.DeviceCopies`): at each read-ahead the
    shards of the next window (the coordinator's limit) whose reads are in (checked
    with ``Future.done``, never waited for) are copied host→device with ``non_blocking``
    on an upload stream, and the reads of the window after it start, so the file stage
    runs one window ahead of the device's. The gather packs the copy after making the
    compute stream wait for its event; a shard whose read was not in by then is waited
    for, as before, and its copy queued by the gather itself, so no gather copies from
    the host on the compute stream (except a shard read back outside the gather path,
    which may have been edited in place). A read buffer is kept until its copy's event
    has happened. A failed read is never copied: its gather raises as on a CPU run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

from zero3.comm import ReduceOp
from zero3.core.config._offload import AioConfig, OffloadParamConfig
from zero3.core.files._swap import (
    AlignedBuffer,
    IOPool,
    SwapError,
    SwapFile,
    check_free_space,
    make_swap_dir,
    round_up,
)
from zero3.core.model._device_copies import DeviceCopies, DeviceCopyStats, take_window
from zero3.core.params._params import ParamOffloadError, ShardedParam, ShardReadError

__all__ = [
    "ParamSwap",
    "ParamSwapStats",
    "PlannedShard",
    "raise_if_any_rank_failed",
    "say_once",
]

_log = logging.getLogger("zero3.core")
_MAX_MESSAGE = 1024  # bytes of a failing rank's message shared with the others

AllReduce = Callable[[torch.Tensor, ReduceOp], None]
_T = TypeVar("_T")


@functools.cache
def say_once(message: str) -> None:
    """Log ``message`` at INFO once per process."""
    _log.info(message)


def raise_if_any_rank_failed(
    all_reduce: AllReduce,
    rank: int,
    device: torch.device,
    error: BaseException | None,
    make: Callable[[str], BaseException],
) -> None:
    """Every rank raises ``make(message)`` if any rank passes an error (a collective:
    two small all-reduces when one failed, one otherwise). The message is the lowest
    failing rank's, prefixed with its rank by ``make``'s caller.
    """
    flag = torch.tensor([rank + 1.0 if error is not None else 0.0], device=device)
    all_reduce(flag, ReduceOp.MAX)
    failed = int(flag.item()) - 1
    if failed < 0:
        return
    text = str(error).encode()[:_MAX_MESSAGE] if failed == rank else b""
    codes = torch.zeros(_MAX_MESSAGE, dtype=torch.float32, device=device)
    if text:
        codes[: len(text)] = torch.tensor(list(text), dtype=torch.float32)
    all_reduce(codes, ReduceOp.SUM)
    message = bytes(int(c) for c in codes.tolist() if c).decode(errors="replace")
    raise make(f"rank {failed}: {message}") from error


@dataclasses.dataclass
class ParamSwapStats:
    """What parameter offload moved and waited for (this rank, since the last reset).

    Attributes:
        read_bytes: Bytes read from the swap file.
        read_ahead_bytes: Of those, bytes read ahead of the gather that needed them.
        written_bytes: Bytes written (stepped values, edits).
        io_wait_s: Seconds the model waited for a read or a write.
    """

    read_bytes: int = 0
    read_ahead_bytes: int = 0
    written_bytes: int = 0
    io_wait_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class PlannedShard:
    """A parameter shard that may be offloaded, known by its size before it exists.

    Attributes:
        index: The parameter's index (``named_parameters()`` order).
        numel: Its shard's elements (``shard_numel``).
        dtype: The shard's dtype (after any ``param_dtype`` cast).
    """

    index: int
    numel: int
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class _Region:
    offset: int
    numel: int  # the shard's elements (shard_numel)
    nbytes: int  # and its bytes


class ParamSwap:
    """This rank's offloaded parameter shards and their swap file (a ``ShardHome``).

    Made by the model state when ``offload_param.device`` is ``"nvme"``, before the
    parameters are cut: the shards go to the file as they are made (:meth:`store`), and
    each :class:`ShardedParam` is handed over once it exists (:meth:`adopt`).

    Args:
        plan: The shards of the sharded parameters in parameter order (persistent ones
            stay in memory).
        config: The ``offload_param`` section.
        aio: How the file is read and written.
        rank: This rank (names the directory).
        all_reduce: The model's small all-reduce (agreeing on write errors at steps).
        pin: Read shards into page-locked buffers (the model is on an accelerator and
            ``pin_memory`` is set: the copies to the device read them asynchronously).
    """

    #: Set, since a read from the swap file can fail; gathers of its shards then check
    #: their fingerprints at once.
    reads_can_fail = True

    def __init__(
        self,
        plan: Sequence[PlannedShard],
        config: OffloadParamConfig,
        aio: AioConfig,
        rank: int,
        all_reduce: AllReduce,
        *,
        pin: bool = False,
    ) -> None:
        self.config = config
        self._pin = pin
        self.stats = ParamSwapStats()
        self._rank = rank
        self._all_reduce = all_reduce
        self._regions: dict[int, _Region] = {}
        self._reads: dict[int, Future[AlignedBuffer]] = {}
        self._writes: dict[int, Future[None]] = {}
        self._resident: dict[int, tuple[ShardedParam, int]] = {}  # index -> (sp, version)
        self._edited: set[int] = set()
        self._write_error: BaseException | None = None
        #: Shards whose last values found no host memory for their write buffer: the
        #: file holds older bytes, so reading them is an error, never stale values.
        self._unwritten: dict[int, str] = {}
        self._copies = DeviceCopies()  # read ahead onto the device (model on an accelerator)
        #: The offloaded parameters (filled by :meth:`adopt`).
        self.params: list[ShardedParam] = []
        self.kept_numel = 0
        cursor = 0
        for shard in plan:
            if self.kept_numel + shard.numel <= config.max_in_cpu:
                self.kept_numel += shard.numel
                continue
            nbytes = shard.numel * shard.dtype.itemsize
            self._regions[shard.index] = _Region(cursor, shard.numel, nbytes)
            cursor += round_up(nbytes)
        self.file_bytes = cursor
        self._dir, _ = make_swap_dir(Path(str(config.nvme_path)), "params", rank)
        self._pool = IOPool(aio.thread_count, name=f"zero3-param-io-r{rank}")
        # The file goes when this object does, or at exit (also after an error).
        self._files = _Files(self._dir, self._pool)
        weakref.finalize(self, self._files.remove)
        check_free_space(self._dir, cursor, f"rank {rank}'s offloaded parameter shards")
        self._file = SwapFile(self._dir / "params.swp", direct=aio.use_direct_io,
                              block_size=aio.block_size)  # fmt: skip
        self._files.file = self._file
        if cursor:
            self._file.reserve(cursor)

    def offloads(self, index: int) -> bool:
        """Whether parameter ``index``'s shard lives in the file."""
        return index in self._regions

    def store(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """A shard just cut at construction: written to the file if it is offloaded
        (then an empty tensor comes back for the parameter to hold), else ``shard``.
        """
        if index not in self._regions:
            return shard
        self._queue_write(index, shard.dtype, shard)
        return torch.empty(0, dtype=shard.dtype, device=shard.device)

    def adopt(self, sp: ShardedParam) -> None:
        """Take over ``sp``'s shard (one :meth:`offloads` says yes to): a shard it still
        holds in memory (cut without :meth:`store`) is written out now.
        """
        self.params.append(sp)
        if sp._shard.numel():
            self._queue_write(sp.index, sp.param.dtype, sp._shard)
        sp.home = self
        sp.shard = _empty(sp)

    # -- what is where ----------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """This rank's swap file."""
        return self._file.path

    @property
    def direct_io(self) -> bool:
        """Whether the swap file is read and written with ``O_DIRECT``."""
        return self._file.direct

    @property
    def device_stats(self) -> DeviceCopyStats:
        """What the gathers found on the device (the model on an accelerator; zero on a
        CPU run).
        """
        return self._copies.stats

    def _to_device(self) -> bool:
        """Whether the shards go on to an accelerator (the parameters are there)."""
        return bool(self.params) and self.params[0].device.type != "cpu"

    def offloaded_bytes(self) -> int:
        """Bytes of shards that are only in the swap file now."""
        return sum(self._regions[sp.index].nbytes for sp in self.params if not sp.resident)

    def take_edit(self, sp: ShardedParam) -> bool:
        """Whether ``sp``'s shard was set from outside the optimizer since the optimizer
        last asked (a load, ``gathered_parameters``); asking clears it.
        """
        edited = sp.index in self._edited
        self._edited.discard(sp.index)
        return edited

    # -- reading ------------------------------------------------------------------------------

    def _read(self, sp: ShardedParam) -> AlignedBuffer:
        region = self._regions[sp.index]
        buf = AlignedBuffer(region.nbytes, pin=self._pin)
        self._file.read(buf, region.nbytes, offset=region.offset)
        return buf

    def _submit_read(self, sp: ShardedParam) -> Future[AlignedBuffer]:
        lost = self._unwritten.get(sp.index)
        if lost is not None:
            raise SwapError(lost)
        pending = self._writes.pop(sp.index, None)
        if pending is not None:  # read what was written, never the older bytes
            self._wait(pending)  # a failed write raises here: never stale values
        return self._pool.submit(functools.partial(self._read, sp))

    def read_ahead(self, upcoming: Iterable[ShardedParam], limit_numel: int) -> None:
        """Start reading the shards of ``upcoming`` (in the order they will be
        gathered) until ``buffer_count`` reads are in flight, or ``limit_numel`` shard
        elements (the gather window's share: read-ahead buffers obey the window as
        gathered copies do), or ``buffer_count x buffer_size`` (DeepSpeed's bound).
        One shard may always be read ahead.

        With the model on an accelerator the first ``limit_numel`` shard elements (one
        shard always) are copied onto the device where their values are in memory, and
        the reads in flight may reach ``2 x limit_numel`` elements: those of the next
        window too (see the module Note).
        """
        shards = iter(upcoming)
        if not self._to_device():
            self._start_reads(shards, limit_numel)
            return
        window, past = take_window(shards, self, limit_numel)
        self._copies.copy_window(window, self._values_in)
        # The file stage runs a window ahead of the device's: the next window's reads
        # start now, so that the next read-ahead finds them in.
        after = [past] if past is not None else []
        self._start_reads(itertools.chain(window.values(), after, shards), 2 * limit_numel)

    def _start_reads(self, upcoming: Iterator[ShardedParam], limit_numel: int) -> None:
        """Start reading shards of ``upcoming`` not in memory, on the device or on their
        way, within the bounds :meth:`read_ahead` names.
        """
        budget = self.config.buffer_count - len(self._reads)
        bound = min(limit_numel, self.config.buffer_count * self.config.buffer_size)
        room = bound - sum(self._regions[i].numel for i in self._reads)
        for sp in upcoming:
            if budget <= 0:
                break
            if sp.home is not self or sp.resident or sp.index in self._reads:
                continue
            if sp.index in self._writes or sp.index in self._unwritten:
                continue  # bring_in waits for the write (and its error), or raises
            if self._copies.has(sp):
                continue
            if sp.shard_numel > room and self._reads:
                break
            self._reads[sp.index] = self._submit_read(sp)
            self.stats.read_ahead_bytes += self._regions[sp.index].nbytes
            budget -= 1
            room -= sp.shard_numel

    def _values_in(self, sp: ShardedParam) -> torch.Tensor | None:
        """``sp``'s values where they are in memory now: read back by someone, or read
        ahead and in (a read in flight is not waited for; a failed one stays for its
        gather to report); None otherwise.
        """
        if sp.resident:
            return sp.held_shard
        future = self._reads.get(sp.index)
        if future is None or not future.done() or future.exception() is not None:
            return None
        del self._reads[sp.index]
        return self._took_read(sp, future.result())

    def for_gather(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s shard for the gather packing it on the current stream. On a CPU run:
        read back (or taken from its read ahead) into memory. With the model on an
        accelerator: its copy on the device (the stream waits for it), queued now, once
        its read is in, if it was not ahead; a shard read back outside the gather path
        (perhaps edited in place) is packed from memory instead.
        """
        if sp.device.type == "cpu":
            return sp.shard
        copies = self._copies
        shard = copies.take(sp)
        if shard is not None:
            return shard
        if sp.resident:
            copies.stats.on_demand += 1
            return sp.held_shard
        return copies.copy_now(sp, self._read_in(sp))

    def bring_in(self, sp: ShardedParam) -> torch.Tensor:
        """Read ``sp``'s shard back (see the ShardHome protocol)."""
        tensor = self._read_in(sp)
        sp.shard = tensor
        self._resident[sp.index] = (sp, tensor._version)
        return tensor

    def _read_in(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s shard read back into a host buffer (taking a read already under way;
        the host waits for it). Raises :class:`ShardReadError` naming the file, or the
        host buffer that could not be allocated.
        """
        future = self._reads.pop(sp.index, None)
        try:
            if future is None:
                future = self._submit_read(sp)
            buf = self._wait(future)
        except (SwapError, MemoryError) as exc:  # no room for the read buffer: agreed too
            raise ShardReadError(
                f"zero3: offload_param: cannot read the shard of parameter {sp.name!r} back: {exc}"
            ) from exc
        return self._took_read(sp, buf)

    def _took_read(self, sp: ShardedParam, buf: AlignedBuffer) -> torch.Tensor:
        """``sp``'s shard in ``buf``, a read of it that completed (counted)."""
        region = self._regions[sp.index]
        self.stats.read_bytes += region.nbytes
        return buf.tensor[: region.nbytes].view(sp.param.dtype)

    def _wait(self, future: Future[_T]) -> _T:
        begin = time.perf_counter()
        try:
            return future.result()
        finally:
            self.stats.io_wait_s += time.perf_counter() - begin

    # -- dropping and writing -------------------------------------------------------------------

    def drop(self, sp: ShardedParam) -> None:
        """Let a resident shard go, writing it back first if it was edited in place."""
        entry = self._resident.pop(sp.index, None)
        if entry is None:
            return
        tensor = sp._shard
        if tensor._version != entry[1]:
            self._edited.add(sp.index)
            self._queue_write(sp.index, sp.param.dtype, tensor)
        sp.shard = _empty(sp)

    def write(self, sp: ShardedParam, values: torch.Tensor, *, edit: bool) -> None:
        """Write this rank's real elements of ``sp`` (``local_numel`` values) to disk."""
        self._resident.pop(sp.index, None)
        sp.shard = _empty(sp)
        if edit:
            self._edited.add(sp.index)
        self._queue_write(sp.index, sp.param.dtype, values)

    def _buffer_of(self, index: int, dtype: torch.dtype, values: torch.Tensor) -> AlignedBuffer:
        """A page-aligned buffer of parameter ``index``'s region holding ``values`` (the
        first elements, as ``dtype``; the rest, the padding, stays zero).
        """
        region = self._regions[index]
        buf = AlignedBuffer(region.nbytes)
        shard = buf.tensor[: region.nbytes].view(dtype)
        shard[: values.numel()].copy_(values.reshape(-1))
        return buf

    def _queue_write(self, index: int, dtype: torch.dtype, values: torch.Tensor) -> None:
        region = self._regions[index]
        try:
            buf: AlignedBuffer | None = self._buffer_of(index, dtype, values)
        except MemoryError as exc:
            # Raising here would stop this rank alone (mid-step, or in a hook) while its
            # peers wait in a collective: it is a failed write instead, which every rank
            # raises where the step settles its writes.
            buf = None
            name = next((repr(sp.name) for sp in self.params if sp.index == index), f"#{index}")
            lost = (
                f"no host memory for the {region.nbytes}-byte write buffer of parameter "
                f"{name}'s shard, so {self.path} holds older values of it ({exc})"
            )
            self._unwritten[index] = lost
            self._write_error = self._write_error or SwapError(lost)
        self._copies.let_go(index)  # it holds the older values
        stale = self._reads.pop(index, None)
        if stale is not None:  # a read ahead of older bytes: let it finish, drop it
            self._wait_quietly(stale)
        pending = self._writes.pop(index, None)
        if pending is not None:
            self._wait_quietly(pending)
        if buf is None:
            return
        self._unwritten.pop(index, None)
        self._writes[index] = self._pool.submit(functools.partial(self._write, region, buf))
        self.stats.written_bytes += region.nbytes
        # At most buffer_count writes (and their buffers) in flight: an optimizer step
        # (or construction) writes every shard, and all of them at once would be the
        # whole model's shards.
        while len(self._writes) > self.config.buffer_count:
            self._wait_quietly(self._writes.pop(next(iter(self._writes))))

    def _write(self, region: _Region, buf: AlignedBuffer) -> None:
        self._file.write(buf, region.nbytes, offset=region.offset)

    def _wait_quietly(self, future: Future[Any]) -> None:
        try:
            self._wait(future)
        except SwapError as exc:
            self._write_error = self._write_error or exc

    def flush(self) -> BaseException | None:
        """Wait for every queued write; returns the first error (None: all on disk)."""
        writes, self._writes = self._writes, {}
        for future in writes.values():
            self._wait_quietly(future)
        error, self._write_error = self._write_error, None
        return error

    def finish_build(self, all_reduce: AllReduce, device: torch.device) -> None:
        """Wait for construction's writes; every rank raises if any rank's failed (a
        collective on ``all_reduce``). ``stats`` count from here.
        """
        error = self.flush()
        self.stats = ParamSwapStats()
        raise_if_any_rank_failed(all_reduce, self._rank, device, error, _offload_error)

    def settle(self, device: torch.device, *, agree: bool = True) -> None:
        """Drop every resident shard (writing back edited ones) and wait for the writes;
        with ``agree`` (a collective) every rank raises if any rank's writes failed.
        """
        for sp, _ in list(self._resident.values()):
            self.drop(sp)
        error = self.flush()
        if agree:
            raise_if_any_rank_failed(self._all_reduce, self._rank, device, error, _offload_error)
        elif error is not None:
            raise _offload_error(f"rank {self._rank}: {error}") from error

    def close(self) -> None:
        """Remove the swap file and stop the I/O threads (the model is unsharded: every
        shard is read back into memory first).
        """
        self.flush()
        for sp in self.params:
            if sp.home is self:
                values = sp.shard
                sp.home = None
                sp.shard = values.clone()
        self._resident.clear()
        self._copies.clear()
        self._files.remove()


def _empty(sp: ShardedParam) -> torch.Tensor:
    return torch.empty(0, dtype=sp.param.dtype, device=sp.param.device)


def _offload_error(message: str) -> ParamOffloadError:
    return ParamOffloadError(f"zero3: parameter offload failed on {message}")


class _Files:
    """The swap directory, file and I/O threads of one ParamSwap (removed once)."""

    def __init__(self, directory: Path, pool: IOPool) -> None:
        self.directory = directory
        self.pool = pool
        self.file: SwapFile | None = None
        self._removed = False

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        self.pool.close()
        if self.file is not None:
            self.file.close(unlink=True)
        with contextlib.suppress(OSError):
            self.directory.rmdir()
