"""GradReducer: buckets in, gradient shards out.

The reducer owns the bucket plan, the launch order, the gradient-partition buffer (one per
reduce dtype; the first backward of a window writes it, later ones add, so accumulation
costs no memory; it exists from the window's first reduction to its end, as plain
PyTorch's gradients live from backward to ``zero_grad``), the in-flight queue and the
fingerprint check; how a bucket is reduced is a :class:`~zero3.core.engine.ReducePath`.
Its half of the epilogue flushes, waits, and exchanges one flag per parameter for "got a
gradient on some rank" (the optimizer skips the rest, as plain PyTorch does) and "arrived
after its bucket left" (reentrant checkpointing; one more reduction every rank joins).
docs/architecture.rst, "The epilogue, per graph task".
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from zero3.comm import CommBackend, ReduceOp
from zero3.core.config._config import Zero3Config
from zero3.core.config._window import MAX_CHUNK_NUMEL
from zero3.core.diag._guard import FingerprintMismatchError
from zero3.core.diag._stats import StatsBook
from zero3.core.diag._tracer import Tracer
from zero3.core.grads._buckets import (
    FINGERPRINT_SLOTS,
    GradBucket,
    fingerprint_bits,
    padded_flat,
    plan_buckets,
)
from zero3.core.grads._reduce_paths import ReducePath, Reduction, choose_path
from zero3.core.params._params import ShardedParam
from zero3.core.params._pool import BufferPool

__all__ = ["MAX_INFLIGHT_REDUCTIONS", "GradReducer", "LateGradients"]

#: Reductions allowed in flight before the oldest is waited for.
MAX_INFLIGHT_REDUCTIONS = 4
#: Fingerprint key of the late-gradient reduction.
LATE_KEY = 0xFFFF


class _Inflight(NamedTuple):
    reduction: Reduction
    issued_us: float


class GradPartition:
    """This rank's gradient shards for the window: one flat buffer per reduce dtype,
    one region per bucket (see the module Note).
    """

    def __init__(self, buckets: Sequence[GradBucket]) -> None:
        self._buckets = list(buckets)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def region(self, bucket: GradBucket, device: torch.device) -> torch.Tensor:
        """The bucket's region (``bucket.stride`` elements, fingerprint slots last)."""
        buf = self._buffers.get(bucket.dtype)
        if buf is None:
            # Not zeroed: every bucket is reduced in every backward (missing gradients as
            # zeros), and the window's first backward overwrites its region. A fresh
            # host buffer's pages are then touched only as the reductions land, while
            # the activations they replace are freed (no jump at the backward's start).
            numel = sum(b.stride for b in self._buckets if b.dtype == bucket.dtype)
            buf = torch.empty(numel, dtype=bucket.dtype, device=device)
            self._buffers[bucket.dtype] = buf
        return buf[bucket.partition_offset : bucket.partition_offset + bucket.stride]

    def release(self) -> None:
        """Let the buffers go (the window is over: nothing reads its gradients)."""
        self._buffers.clear()

    def slot(self, bucket: GradBucket, position: int, device: torch.device) -> torch.Tensor:
        """Member ``position``'s padded shard inside the bucket's region."""
        offset = bucket.offsets[position]
        return self.region(bucket, device)[offset : offset + bucket.params[position].shard_numel]

    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers (for memory accounting)."""
        return list(self._buffers.values())


class WholeGradients:
    """A world of one: each gradient is its own shard, kept as autograd produced it.

    The hook has taken the gradient off the parameter, so zero3 owns the tensor and
    keeps it for the window (as plain PyTorch keeps ``param.grad``); copying it into a
    partition buffer would add a pass over every gradient byte to each backward.
    """

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}

    def add(self, sp: ShardedParam, grad: torch.Tensor, dtype: torch.dtype) -> None:
        """Keep (first arrival of the window) or add a parameter's gradient."""
        kept = self.kept.get(sp.index)
        if kept is None:
            self.kept[sp.index] = grad.detach().reshape(-1).to(dtype)
        else:
            kept.add_(grad.reshape(-1))


class LateGradients:
    """Gradients that arrived after their bucket had left (reentrant checkpointing).

    They are summed per parameter and, if the flags show that any rank has one, go
    through one extra coalesced reduce-scatter per dtype that every rank joins.
    """

    def __init__(self, comm: CommBackend) -> None:
        self.comm = comm
        self.grads: dict[int, torch.Tensor] = {}

    def add(self, sp: ShardedParam, grad: torch.Tensor, dtype: torch.dtype) -> None:
        """Keep (or add to) a late gradient."""
        late = self.grads.get(sp.index)
        cast = grad.to(dtype)
        self.grads[sp.index] = cast if late is None else late.add_(cast)

    def reduce(
        self, members: Sequence[ShardedParam], dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Reduce the late gradients of ``members`` (zeros where this rank has none).

        Returns each member's reduced shard and the fingerprint elements.
        """
        device = members[0].device
        outputs = [torch.empty(sp.shard_numel, dtype=dtype, device=device) for sp in members]
        inputs = [padded_flat(sp, self.grads.get(sp.index), dtype, device) for sp in members]
        outputs.append(torch.empty(FINGERPRINT_SLOTS, dtype=dtype, device=device))
        inputs.append(fingerprint_bits(LATE_KEY, dtype, device).repeat(self.comm.world_size))
        self.comm.reduce_scatter_coalesced(outputs, inputs, op=ReduceOp.AVG).wait()
        return outputs[:-1], outputs[-1]


class GradReducer:
    """Reduces trainable parameters' gradients into this rank's gradient shards.

    Args:
        comm: Backend for gradient collectives (a duplicate of the parameter backend,
            so gathers and reductions form two independent collective sequences).
        config: The model's configuration.
        params: Trainable sharded parameters in registration order.
        leaf_of: Parameter index → index of the leaf module that owns it.
        stats: Where counters go.
        pool: Reusable bucket buffers.
        defer_launches: Gradients share the parameter backend (it cannot duplicate
            itself): buckets then launch only in the epilogue, where both collective
            sequences are in the same order on every rank.
        chunk_numel: Elements per overlapped reduction (the gather window's
            ``chunk_numel``; default: ``config.overlap_chunk_size``, or the largest
            auto chunk when that is auto).

    Attributes:
        path: The reduction strategy (:class:`~zero3.core.engine.ReducePath`).
        buckets: The bucket plan, in launch order.

    Re-planning (:meth:`replan`, :meth:`replace_params`, :meth:`use_path`) is for
    between accumulation windows; the model's training step checks that before calling.
    """

    def __init__(
        self,
        comm: CommBackend,
        config: Zero3Config,
        params: Sequence[ShardedParam],
        leaf_of: Mapping[int, int],
        stats: StatsBook,
        pool: BufferPool,
        *,
        defer_launches: bool = False,
        chunk_numel: int | None = None,
    ) -> None:
        self.comm = comm
        self.config = config
        self.chunk_numel = chunk_numel or config.overlap_chunk_size or MAX_CHUNK_NUMEL
        self.stats = stats
        self.pool = pool
        self.params = list(params)
        self.defer_launches = defer_launches
        self._position = {sp.index: k for k, sp in enumerate(self.params)}
        # Reductions run on their own stream so backward compute goes on; on CPU
        # streams are no-ops and the backend's own thread provides the overlap.
        self.reduce_stream = comm.new_stream() if config.overlap_comm else comm.current_stream()
        self.path: ReducePath = choose_path(
            comm,
            self.reduce_stream,
            pool,
            all_reduce=config.grad_reduce_op == "all_reduce",
            contiguous=config.contiguous_gradients,
        )
        self.tracer: Tracer | None = None
        #: The largest full gradient autograd handed over (before its reduction).
        self.peak_grad_bytes = 0
        #: Most bytes this rank's gradient shards held at once (at a backward's end; the
        #: buffer is freed between windows, so memory_stats after a step shows none).
        self.peak_shard_bytes = 0
        self._accumulate = False  # this backward adds to the window's gradient shards
        self._in_epilogue = False
        self._inflight: collections.deque[_Inflight] = collections.deque()
        self._fingerprints: list[tuple[int, torch.Tensor]] = []
        self._whole = WholeGradients()
        self._late = LateGradients(comm)
        self.replan(leaf_of)

    # -- plan ------------------------------------------------------------------------------

    def replan(self, leaf_of: Mapping[int, int]) -> None:
        """Rebuild the buckets (leaf markings or dtypes changed); only between windows."""
        self.buckets = plan_buckets(
            self.params,
            self.bucket_numel(self.config, self.chunk_numel),
            self.config.reduce_dtype,
            leaf_of,
        )
        self._bucket_of: dict[int, tuple[GradBucket, int]] = {}
        for bucket in self.buckets:
            for k, sp in enumerate(bucket.params):
                self._bucket_of[sp.index] = (bucket, k)
        self._partition = GradPartition(self.buckets)
        self._whole = WholeGradients()
        self._window_flags = torch.zeros(len(self.params), dtype=torch.bool)
        # Got a gradient since gradients were last cleared (zero_grad): where plain
        # PyTorch would hold one in param.grad (the optimizer step does not clear it).
        self._uncleared = torch.zeros(len(self.params), dtype=torch.bool)
        self._reset_backward()

    def replace_params(self, params: Sequence[ShardedParam], leaf_of: Mapping[int, int]) -> None:
        """Reduce gradients of ``params`` from now on (parameters were frozen or
        unfrozen); only between windows.
        """
        self.params = list(params)
        self._position = {sp.index: k for k, sp in enumerate(self.params)}
        self.replan(leaf_of)

    def use_path(self, path: ReducePath) -> None:
        """Replace the reduction strategy (between windows); for custom strategies."""
        if bool(self._window_flags.any()):
            raise RuntimeError("zero3: change the reduction strategy between windows")
        self.path = path

    @staticmethod
    def bucket_numel(config: Zero3Config, chunk_numel: int) -> int:
        """Elements per planned bucket: ``reduce_bucket_size``, in overlap chunks.

        Note (overlap chunks):
            ``reduce_bucket_size`` bounds how many gradient elements one reduction may
            buffer. Used as the launch unit as well (DeepSpeed's way), its default of
            5e8 puts a whole mid-sized model in one bucket that can only leave when
            backward is over, so none of the reduction overlaps compute. With
            ``overlap_comm`` a bucket is therefore cut into chunks of at most
            ``chunk_numel`` elements (``overlap_chunk_size``), each reduced as soon as its members
            arrived (in index order): the same bytes, a few more collectives, and the
            wire busy while backward still runs.
        """
        if config.overlap_comm:
            return min(config.reduce_bucket_size, chunk_numel)
        return config.reduce_bucket_size

    def _reset_backward(self) -> None:
        self._arrived = torch.zeros(len(self.params), dtype=torch.uint8)
        self._late.grads.clear()
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.reset()

    # -- the window's gradient shards ----------------------------------------------------

    def grad_shard(self, sp: ShardedParam) -> torch.Tensor | None:
        """This rank's padded gradient shard of ``sp`` for the current window, or None
        if no rank produced a gradient for it.
        """
        position = self._position.get(sp.index)
        if position is None or not bool(self._window_flags[position]):
            return None
        if self.comm.world_size == 1:
            return self._whole.kept[sp.index]
        bucket, k = self._bucket_of[sp.index]
        return self._partition.slot(bucket, k, sp.device)

    def holds_grad(self, sp: ShardedParam) -> bool:
        """Whether plain PyTorch would hold a gradient of ``sp`` in ``param.grad`` now: a
        backward produced one on some rank since gradients were last cleared.
        """
        position = self._position.get(sp.index)
        return position is not None and bool(self._uncleared[position])

    def grad_buffers(self) -> list[torch.Tensor]:
        """The tensors holding this rank's gradient shards (for memory accounting)."""
        return [*self._partition.buffers(), *self._whole.kept.values()]

    def begin_backward(self, *, accumulate: bool) -> None:
        """A backward starts; ``accumulate``: it adds to gradient shards an earlier
        backward of the same window wrote (else it writes them).
        """
        self._accumulate = accumulate

    def end_window(self, *, clear: bool = False) -> None:
        """End the accumulation window (optimizer step or ``zero_grad``); ``clear``:
        gradients were cleared (``zero_grad``), so none is held any more.
        """
        self._window_flags.zero_()
        if clear:
            self._uncleared.zero_()
        self._whole.kept.clear()
        # The shards are unreadable now (no window flag): between windows the memory is
        # not zero3's to keep (it would sit under the next forward's activations).
        self._partition.release()

    # -- arrivals -------------------------------------------------------------------------

    def on_grad(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        """Take a parameter's full gradient (the post-accumulate-grad hook calls this)."""
        position = self._position.get(sp.index)
        if position is None:
            return  # not trainable at setup (frozen): not part of any bucket
        self._arrived[position] = 1
        self.peak_grad_bytes = max(self.peak_grad_bytes, grad.numel() * grad.element_size())
        bucket, k = self._bucket_of[sp.index]
        if self.comm.world_size == 1:
            self._whole.add(sp, grad, bucket.dtype)
            return
        if bucket.launched:
            self._late.add(sp, grad, bucket.dtype)
            return
        repeat = sp.index in bucket.arrived
        bucket.arrived.add(sp.index)
        self.path.take(bucket, k, grad, repeat)
        if len(bucket.arrived) == len(bucket.params):
            bucket.ready = True
            self._launch_ready()

    def leaf_done(self, leaf_index: int) -> None:
        """A leaf's backward finished: its buckets go now, missing members as zeros."""
        for bucket in self.buckets:
            if bucket.leaf == leaf_index and not bucket.launched:
                bucket.ready = True
        self._launch_ready()

    def _launch_ready(self) -> None:
        if self.comm.world_size == 1 or (self.defer_launches and not self._in_epilogue):
            return
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            bucket = self.buckets[self._next_launch]
            self._next_launch += 1
            bucket.launched = True
            region = self._partition.region(bucket, bucket.params[0].device)
            self._track(self.path.launch(bucket, region, accumulate=self._accumulate))

    # -- in flight ------------------------------------------------------------------------

    def _track(self, reduction: Reduction) -> None:
        self._count(reduction)
        issued = self.tracer.now_us() if self.tracer is not None else 0.0
        self._inflight.append(_Inflight(reduction, issued))
        limit = MAX_INFLIGHT_REDUCTIONS if self.config.overlap_comm else 0
        while len(self._inflight) > limit:
            self._finish_oldest()

    def _count(self, r: Reduction) -> None:
        stats = self.stats.current
        elem = torch.empty((), dtype=r.dtype).element_size()
        fingerprint = self.comm.world_size * FINGERPRINT_SLOTS
        stats.reduce_collectives += 1
        stats.reduce_payload_bytes += r.factor * r.payload_numel * elem
        stats.reduce_fingerprint_bytes += r.factor * fingerprint * elem
        padding = r.buffer_numel - r.payload_numel - fingerprint
        stats.reduce_padding_bytes += r.factor * padding * elem

    def _finish_oldest(self) -> None:
        entry = self._inflight.popleft()
        reduction = entry.reduction
        tracer = self.tracer
        waited = tracer.now_us() if tracer is not None else 0.0
        reduction.work.wait(self.comm.current_stream())
        self._fingerprints.append((reduction.key, reduction.finish()))
        if tracer is not None:
            end = tracer.now_us()
            name = f"reduce bucket {reduction.key}"
            tracer.complete(name, "reduce", entry.issued_us, end, lane="reduce")
            tracer.complete(f"wait {name}", "wait", waited, end)

    def _finish_all(self) -> None:
        while self._inflight:
            self._finish_oldest()

    def _check_fingerprints(self) -> None:
        """Every reduction's fingerprint bits must have come back exactly 0 or 1.

        One host synchronisation per backward, whatever the number of buckets.
        """
        if not self._fingerprints:
            return
        keys = [key for key, _ in self._fingerprints]
        got = torch.stack([t.float() for _, t in self._fingerprints])
        self._fingerprints = []
        expected = torch.stack([fingerprint_bits(k, torch.float32, got.device) for k in keys])
        bad = (got != expected).any(dim=1).cpu()
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0])
            raise FingerprintMismatchError(
                f"zero3: ranks reduced different gradient buckets together (this rank's "
                f"reduction #{first}, bucket key {keys[first]}, came back mixed). The ranks' "
                "bucket plans differ: every rank must shard identically built models with the "
                "same trainable parameters and leaf modules."
            )

    # -- epilogue -------------------------------------------------------------------------

    def end_backward(self) -> None:
        """The epilogue: flush, wait, exchange got-gradient flags, late path, reset."""
        for bucket in self.buckets[self._next_launch :]:
            bucket.ready = True
        self._in_epilogue = True
        try:
            self._launch_ready()
        finally:
            self._in_epilogue = False
        self._finish_all()
        self._check_fingerprints()
        got, late = self._exchange_flags()
        if bool(late.any()):
            self._reduce_late(late)
        self._window_flags |= got
        self._uncleared |= got
        held = sum(t.numel() * t.element_size() for t in self.grad_buffers())
        self.peak_shard_bytes = max(self.peak_shard_bytes, held)
        self._reset_backward()

    def _exchange_flags(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Which parameters got a gradient, and which a late one, on any rank.

        The flags travel on the gradient backend's device (a device backend refuses
        host tensors); the result comes back to the host once, for both uses.
        """
        n = len(self.params)
        flags = torch.zeros(2 * n, dtype=torch.uint8)
        flags[:n] = self._arrived
        for index in self._late.grads:
            flags[n + self._position[index]] = 1
        if n and self.comm.world_size > 1:
            on_device = flags.to(self.comm.device())
            self.comm.all_reduce(on_device, op=ReduceOp.MAX).wait()
            flags = on_device.cpu()
            self.stats.current.grad_flag_bytes += flags.numel()
        return flags[:n].bool(), flags[n:].bool()

    def _reduce_late(self, late: torch.Tensor) -> None:
        """One extra reduction per dtype for gradients that arrived after their bucket."""
        members = [self.params[int(k)] for k in torch.nonzero(late).flatten()]
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in members:
            by_dtype.setdefault(self._bucket_of[sp.index][0].dtype, []).append(sp)
        for dtype, group in by_dtype.items():
            shards, fingerprint = self._late.reduce(group, dtype)
            self._fingerprints.append((LATE_KEY, fingerprint))
            self.stats.current.late_reductions += 1
            for sp, shard in zip(group, shards, strict=True):
                bucket, k = self._bucket_of[sp.index]
                self._partition.slot(bucket, k, shard.device).add_(shard)
        self._check_fingerprints()
