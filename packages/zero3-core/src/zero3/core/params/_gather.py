"""Coalesced parameter gathers that carry a fingerprint of what each rank fetches.

A fetch packs its parameters' shards into one byte buffer (so dtypes share the
collective); the last 16 bytes of each rank's chunk say what the rank fetches (module,
parameter set, size). After the gather every rank sees every rank's, so ranks that
paired gathers for different modules fail together with no extra collective.
docs/architecture.rst, "One coalesced, fingerprinted gather per fetch".
"""

from __future__ import annotations

import array
import dataclasses
import zlib
from collections.abc import Callable, Sequence

import torch

from zero3.comm import CommBackend, Stream, Work
from zero3.core.diag._guard import FingerprintMismatchError
from zero3.core.params._params import (
    ParamOffloadError,
    ParamStatus,
    ShardedParam,
    ShardReadError,
    fill_full,
    free_full,
)
from zero3.core.params._pool import BufferPool

__all__ = [
    "FINGERPRINT_BYTES",
    "GatherHandle",
    "GatherLayout",
    "cut_at_modules",
    "verify_fingerprints",
]

FINGERPRINT_BYTES = 16
_ALIGN = 16
_MAGIC = 0x5A335A33  # "Z3Z3"
_READ_FAILED = 0x5A334552  # "Z3ER": the rank could not read an offloaded shard back


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclasses.dataclass(frozen=True)
class GatherLayout:
    """Byte layout of one rank's chunk for a set of parameters (cached per set)."""

    params: tuple[ShardedParam, ...]
    offsets: tuple[int, ...]
    chunk_bytes: int
    param_hash: int
    _on_device: dict[tuple[int, torch.device], torch.Tensor] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def build(cls, params: Sequence[ShardedParam]) -> GatherLayout:
        """Lay out ``params`` (in the given order) in a chunk with a trailing fingerprint."""
        offsets, cursor = [], 0
        for sp in params:
            offsets.append(cursor)
            cursor = _align(cursor + sp.shard_numel * sp.itemsize)
        indices = [sp.index for sp in params]
        return cls(
            params=tuple(params),
            offsets=tuple(offsets),
            chunk_bytes=cursor + FINGERPRINT_BYTES,
            param_hash=zlib.crc32(array.array("q", indices).tobytes()) & 0x7FFFFFFF,
        )

    def read_failed_print(self, module_index: int, param_index: int) -> torch.Tensor:
        """The fingerprint of a chunk this rank could not fill: an offloaded shard
        (``param_index``) failed to read back.
        """
        words = [_READ_FAILED, module_index, param_index, self.chunk_bytes & 0x7FFFFFFF]
        return torch.tensor(words, dtype=torch.int32).view(torch.uint8).to(self.params[0].device)

    @property
    def payload_bytes(self) -> int:
        """Real parameter bytes the gather delivers."""
        return sum(sp.numel * sp.itemsize for sp in self.params)

    def fingerprint(self, module_index: int) -> torch.Tensor:
        """The 16 fingerprint bytes for a gather requested by ``module_index``."""
        words = [_MAGIC, module_index, self.param_hash, self.chunk_bytes & 0x7FFFFFFF]
        return torch.tensor(words, dtype=torch.int32).view(torch.uint8)

    def fingerprint_on(self, module_index: int, device: torch.device) -> torch.Tensor:
        """:meth:`fingerprint` on ``device``, made once per module (read-only): copying
        it from the host at every gather would be a blocking copy on an accelerator.
        """
        key = (module_index, device)
        cached = self._on_device.get(key)
        if cached is None:
            with torch.inference_mode(False):
                cached = self.fingerprint(module_index).to(device)
            self._on_device[key] = cached
        return cached


class GatherHandle:
    """One coalesced gather in flight: issue on construction, :meth:`finish` to use it.

    Args:
        comm: The backend gathers go through.
        layout: Which parameters, where in the chunk.
        module_index: Index of the module the fetch is for (goes into the fingerprint).
        describe: Maps a module index to its qualified name (for error messages).
        stream: Stream to issue the gather on.
        pool: Where the send and receive buffers come from and go back to.
        kind: ``"gather"`` (on demand), ``"prefetch"`` (ahead of use) or ``"refresh"``
            (after an optimizer step); labels the tracer's events.
        step: The step it belongs to (for messages).
        issued_us: When it was issued (tracer clock; 0 when not tracing).
        verify: When the fingerprints are checked: ``"now"`` (on finish: one host
            synchronisation per gather), ``"later"`` (kept in :attr:`prints` for one
            batched check, :func:`verify_fingerprints`) or ``"headers"`` (not at all:
            every rank announced this gather in an identical header beforehand, or
            there is no other rank).
    """

    def __init__(
        self,
        comm: CommBackend,
        layout: GatherLayout,
        module_index: int,
        describe: Callable[[int], str],
        stream: Stream | None,
        pool: BufferPool,
        *,
        kind: str = "gather",
        step: int = 0,
        issued_us: float = 0.0,
        verify: str = "now",
    ) -> None:
        self.layout = layout
        self.module_index = module_index
        self.kind = kind
        self.step = step
        self.issued_us = issued_us
        self.verify = verify
        #: The fingerprints as received (``verify="later"``), for :func:`verify_fingerprints`.
        self.prints: torch.Tensor | None = None
        self._describe = describe
        self._world = comm.world_size
        device = layout.params[0].device
        self._pool = pool
        self._finished = False
        #: This rank's failure to read an offloaded shard back (it sends zeros and an
        #: "I/O failed" fingerprint instead, so every rank raises at finish).
        self.read_error: ShardReadError | None = None
        self._recv: torch.Tensor | None = None
        self._work: Work | None = None
        self._failed = -1  # the parameter whose shard could not be read (a world of one)
        if self._world == 1:
            self._fill_alone()
            return
        self._recv = pool.take(layout.chunk_bytes * self._world, device)
        # Pack straight into this rank's own chunk of the receive buffer and gather in
        # place: no separate send buffer, one copy less.
        send = self._recv.view(self._world, layout.chunk_bytes)[comm.rank]
        failed, fallible = -1, False
        for sp, offset in zip(layout.params, layout.offsets, strict=True):
            nbytes = sp.shard_numel * sp.itemsize
            home = sp.home
            try:
                # An offloaded shard comes from its home: a copy read ahead onto the
                # device where there is one (this stream waits for it), else the shard.
                shard = sp.shard if home is None else home.for_gather(sp)
            except ShardReadError as exc:
                self.read_error, failed = self.read_error or exc, sp.index
                send[offset : offset + nbytes].zero_()
            else:
                send[offset : offset + nbytes].copy_(shard.view(torch.uint8))
                if home is not None:
                    home.drop(sp)  # packed: the gathered copy is what is used now
            fallible = fallible or (home is not None and home.reads_can_fail)
            sp.set_status(ParamStatus.INFLIGHT)
        if self.read_error is not None:
            send[-FINGERPRINT_BYTES:].copy_(layout.read_failed_print(module_index, failed))
            self.verify = "now"  # a rank that could not read its shard stops every rank here
        else:
            send[-FINGERPRINT_BYTES:].copy_(layout.fingerprint_on(module_index, device))
            if fallible:
                self.verify = "now"  # a peer that could not read its shard stops this rank
        if stream is not None:
            stream.wait_stream(comm.current_stream())  # the packing above ran there
        self._work = comm.all_gather(self._recv, send, stream=stream)

    def _fill_alone(self) -> None:
        """A world of one: each shard is its whole parameter, so the parameters are
        filled from their shards now, on this stream; :meth:`finish` makes them
        available. No receive buffer, no copy-out, no fingerprint (no other rank).
        """
        self.verify = "headers"
        try:
            for sp in self.layout.params:
                home = sp.home
                try:
                    shard = sp.shard if home is None else home.for_gather(sp)
                except ShardReadError as exc:
                    self.read_error, self._failed = exc, sp.index
                    break

                def fill(flat: torch.Tensor, shard: torch.Tensor = shard) -> None:
                    flat.copy_(shard[: flat.numel()])

                sp.set_status(ParamStatus.AVAILABLE)  # its own class, to be filled
                fill_full(sp.param, fill, self._pool)
                if home is not None:
                    home.drop(sp)
                sp.set_status(ParamStatus.INFLIGHT)  # available once finished
        except BaseException:
            _release_all(self)  # nothing half-filled is left behind (out of memory)
            raise

    def received_prints(self) -> torch.Tensor:
        """The fingerprint bytes of every rank's chunk as received (before finish)."""
        assert self._recv is not None
        return self._recv.view(self._world, self.layout.chunk_bytes)[:, -FINGERPRINT_BYTES:]

    def is_completed(self) -> bool:
        """True once the data has arrived (never blocks)."""
        return self._work is None or self._work.is_completed()

    @property
    def finished(self) -> bool:
        """True once :meth:`finish` has run."""
        return self._finished

    def finish(self, stream: Stream | None = None) -> None:
        """Wait for the data, check fingerprints, and fill the parameters' storages (in
        a world of one they were filled when the handle was made: make them available).
        """
        if self._finished:
            return
        self._finished = True
        if self._world == 1:  # filled when the handle was made
            if self.read_error is not None:
                row = [_READ_FAILED, self.module_index, self._failed, 0]
                _raise_read_failures(self, [row], self._describe)
            for sp in self.layout.params:
                sp.set_status(ParamStatus.AVAILABLE)
            return
        assert self._recv is not None and self._work is not None
        self._work.wait(stream)
        recv = self._recv.view(self._world, self.layout.chunk_bytes)
        if self.verify == "now":
            verify_fingerprints([self], self._describe)
        elif self.verify == "later":
            self.prints = recv[:, -FINGERPRINT_BYTES:].clone()
        for sp, offset in zip(self.layout.params, self.layout.offsets, strict=True):
            sp.set_status(ParamStatus.AVAILABLE)  # first: it gives the parameter its class back
            _copy_out(sp, recv, offset, self._pool)
        # On devices the buffer goes back only after the consumer stream used it; on
        # CPU the copies above have run, so it is free now.
        self._pool.give(self._recv)
        self._recv, self._work = None, None


def verify_fingerprints(handles: Sequence[GatherHandle], describe: Callable[[int], str]) -> None:
    """Check the fingerprints of finished (or finishing) gathers with one host sync.

    Raises:
        FingerprintMismatchError: Some rank gathered something else; the parameters of
            that gather are released (nothing half-gathered is left behind).
    """
    prints = [h.prints if h.prints is not None else h.received_prints() for h in handles]
    if not prints:
        return
    got = torch.stack([p.contiguous().view(torch.int32) for p in prints]).cpu()
    for handle, rows in zip(handles, got, strict=True):
        mine = handle.layout.fingerprint(handle.module_index).view(torch.int32)
        if bool((rows == mine).all()):
            continue
        _raise_read_failures(handle, rows.tolist(), describe)
        lines = []
        for rank, words in enumerate(rows.tolist()):
            if words[0] != _MAGIC:
                text = "issued a different collective or size (no zero3 fingerprint)"
            else:
                text = (
                    f"module {describe(words[1])!r} (parameter set #{words[2]:08x}, "
                    f"{words[3]} bytes per rank)"
                )
            lines.append(f"  rank {rank}: {text}")
        _release_all(handle)
        raise FingerprintMismatchError(
            "zero3: ranks gathered different parameters in the same collective:\n"
            + "\n".join(lines)
            + "\nRanks ran different modules (data-dependent control flow, e.g. MoE "
            "routing). Mark the module that routes as a leaf (zero3.hooks."
            "set_leaf_modules(model, Cls) or Zero3Config(leaf_modules=(Cls,))) so its "
            "whole subtree is gathered on every rank."
        )


def _release_all(handle: GatherHandle) -> None:
    for sp in handle.layout.params:  # leave nothing half-gathered behind
        if sp.status is not ParamStatus.NOT_AVAILABLE:
            free_full(sp.param)
        sp.set_status(ParamStatus.NOT_AVAILABLE)


def _raise_read_failures(
    handle: GatherHandle, rows: list[list[int]], describe: Callable[[int], str]
) -> None:
    """Raise on every rank if some rank could not read an offloaded shard back."""
    failed = [(rank, words[2]) for rank, words in enumerate(rows) if words[0] == _READ_FAILED]
    if not failed:
        return
    names = {sp.index: sp.name for sp in handle.layout.params}
    what = ", ".join(f"rank {rank} ({names.get(index, '?')!r})" for rank, index in failed)
    _release_all(handle)
    own = f" This rank's error: {handle.read_error}" if handle.read_error is not None else ""
    raise ParamOffloadError(
        f"zero3: offload_param: {what} could not read its parameter shard back from its "
        f"swap file for the gather of module {describe(handle.module_index)!r} (step "
        f"{handle.step}); every rank stops at this gather, nothing was computed with the "
        f"missing values.{own} The failing rank's error names the file or the buffer: "
        "check the disk under offload_param.nvme_path (a removed, truncated or unreadable "
        "swap file) or that rank's free host memory (no room for the read buffer)."
    ) from handle.read_error


def _copy_out(sp: ShardedParam, recv: torch.Tensor, offset: int, pool: BufferPool) -> None:
    """Copy every rank's shard of ``sp`` from the gathered bytes into its full storage."""
    param, s, n = sp.param, sp.shard_numel, sp.numel
    elem = sp.itemsize
    shards = recv[:, offset : offset + s * elem].view(param.dtype) if n else recv[:, :0]
    rows, rem = divmod(n, s) if s else (0, 0)

    def fill(flat: torch.Tensor) -> None:
        if rows:
            flat[: rows * s].view(rows, s).copy_(shards[:rows])
        if rem:
            flat[rows * s :].copy_(shards[rows, :rem])

    fill_full(param, fill, pool)


def cut_at_modules(
    chosen: Sequence[tuple[ShardedParam, int]], limit: int | None
) -> list[tuple[int, list[ShardedParam]]]:
    """Cut a prefetch (``(param, trace position)`` in trace order) into gathers of at
    most ``limit`` elements (None: one gather), at module boundaries only; each with its
    first trace position.

    Note (overlap chunks):
        One gather for the whole prefetch would make the next module wait for all of it
        (at the start of a step, for the whole model). Cut at module boundaries, each
        module waits only for the chunk holding its parameters while the later chunks
        are still on the wire.
    """
    pieces: list[tuple[int, list[ShardedParam]]] = []
    size, last_position = 0, -1
    for sp, position in chosen:
        boundary = position != last_position
        if not pieces or (boundary and limit is not None and size + sp.numel > limit):
            pieces.append((position, []))
            size = 0
        pieces[-1][1].append(sp)
        size += sp.numel
        last_position = position
    return pieces
