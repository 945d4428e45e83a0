"""GradReducer: buckets in, gradient shards out (seed §3, §5, §6).

Note (the gradient-partition buffer and accumulation, §5.3, §6):
    Each rank keeps one flat buffer per reduce dtype holding its shard of every
    trainable parameter's gradient, laid out bucket by bucket. The first backward of
    an accumulation window writes reductions straight into it (``copy_``); later ones
    add (``add_``), so accumulation costs no extra memory. The window ends at the
    optimizer's step or at any ``zero_grad``.

Note (the epilogue, §5.4):
    At the end of every backward the epilogue launches the buckets not yet launched
    (members that got no gradient here reduce as zeros), waits for every reduction,
    and runs one small all-reduce (MAX over uint8 flags) recording which parameters
    got a gradient on any rank — so the optimizer can skip a parameter nobody
    produced a gradient for, as plain PyTorch does — and which had a gradient arrive
    after its bucket had left (reentrant checkpointing runs an inner backward; a
    parameter used inside and outside the region gets two arrivals). Those late
    gradients, if any rank has one, go through one more reduction that every rank
    joins, decided by the flags, so no rank ever waits on another.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from zero3.comm import CommBackend, ReduceOp, Work
from zero3.core._buckets import FINGERPRINT_SLOTS, GradBucket, fingerprint_bits, plan_buckets
from zero3.core._config import Zero3Config
from zero3.core._gather import FingerprintMismatchError
from zero3.core._params import ShardedParam
from zero3.core._pool import BufferPool
from zero3.core._stats import StatsBook
from zero3.core._tracer import Tracer

__all__ = ["MAX_INFLIGHT_REDUCTIONS", "GradReducer"]

#: Reductions allowed in flight before the oldest is waited for.
MAX_INFLIGHT_REDUCTIONS = 4
#: Fingerprint key of the late-gradient reduction.
_LATE_KEY = 0xFFFF

_Finish = Callable[[], None]


class _Inflight(NamedTuple):
    work: Work
    finish: _Finish
    key: int
    issued_us: float


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
    """

    def __init__(
        self,
        comm: CommBackend,
        config: Zero3Config,
        params: Sequence[ShardedParam],
        leaf_of: Mapping[int, int],
        stats: StatsBook,
        pool: BufferPool,
    ) -> None:
        self.comm = comm
        self.config = config
        self.stats = stats
        self.pool = pool
        self.params = list(params)
        self._position = {sp.index: k for k, sp in enumerate(self.params)}
        self.all_reduce_path = (
            config.grad_reduce_op == "all_reduce" or not comm.capabilities.native_reduce_scatter
        )
        #: Private switch. False forms buckets by arrival order (DeepSpeed's way), which
        #: desynchronizes ranks under data-dependent routing. Tests use it to show that.
        self.fixed_buckets = True
        #: Set when gradients share the parameter backend (it cannot duplicate itself):
        #: then buckets launch only in the epilogue, where both sequences are in order.
        self.defer_launches = False
        self._in_epilogue = False
        self.micro_step = 0
        self._inflight: collections.deque[_Inflight] = collections.deque()
        # Reductions run on their own stream (§3.3) so backward compute goes on; on CPU
        # streams are no-ops and gloo's thread provides the overlap.
        self.reduce_stream = comm.new_stream() if config.overlap_comm else comm.current_stream()
        self.tracer: Tracer | None = None
        self._partitions: dict[torch.dtype, torch.Tensor] = {}
        #: A world of one: each parameter's gradient for the window, kept as produced.
        self._alone: dict[int, torch.Tensor] = {}
        self.replan(leaf_of)

    def replan(self, leaf_of: Mapping[int, int]) -> None:
        """Rebuild the buckets (leaf markings changed); only between windows."""
        if self.micro_step:
            raise RuntimeError(
                "zero3: leaf modules changed in the middle of a gradient accumulation "
                "window; change them before backward or after the optimizer step"
            )
        self.buckets = plan_buckets(
            self.params, self.bucket_numel(self.config), self.config.reduce_dtype, leaf_of
        )
        self._bucket_of: dict[int, tuple[GradBucket, int]] = {}
        for bucket in self.buckets:
            for k, sp in enumerate(bucket.params):
                self._bucket_of[sp.index] = (bucket, k)
        self._partitions.clear()
        self._alone.clear()
        n = len(self.params)
        self._window_flags = torch.zeros(n, dtype=torch.bool)
        self._reset_backward()

    @staticmethod
    def bucket_numel(config: Zero3Config) -> int:
        """Elements per planned bucket: ``reduce_bucket_size``, in overlap chunks.

        Note (overlap chunks):
            ``reduce_bucket_size`` bounds how many gradient elements one reduction may
            buffer. Used as the launch unit as well (DeepSpeed's way), its default of
            5e8 puts a whole mid-sized model in one bucket that can only leave when
            backward is over, so none of the reduction overlaps compute. With
            ``overlap_comm`` a bucket is therefore cut into chunks of at most
            ``overlap_chunk_size`` elements, each reduced as soon as its members
            arrived (in index order): the same bytes, a few more collectives, and the
            wire busy while backward still runs.
        """
        if config.overlap_comm:
            return min(config.reduce_bucket_size, config.overlap_chunk_size)
        return config.reduce_bucket_size

    def _reset_backward(self) -> None:
        n = len(self.params)
        self._arrived = torch.zeros(n, dtype=torch.uint8)
        self._late: dict[int, torch.Tensor] = {}
        self._next_launch = 0
        self._dynamic: list[tuple[ShardedParam, torch.Tensor]] = []
        self._fingerprints: list[tuple[int, torch.Tensor]] = []
        for bucket in self.buckets:
            bucket.reset()

    # -- partition buffer ----------------------------------------------------------------

    def _partition(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._partitions.get(dtype)
        if buf is None:
            numel = sum(b.stride for b in self.buckets if b.dtype == dtype)
            buf = torch.zeros(numel, dtype=dtype, device=device)
            self._partitions[dtype] = buf
        return buf

    def grad_shard(self, sp: ShardedParam) -> torch.Tensor | None:
        """This rank's padded gradient shard of ``sp`` for the current window, or None
        if no rank produced a gradient for it.
        """
        position = self._position.get(sp.index)
        if position is None or not bool(self._window_flags[position]):
            return None
        if self.comm.world_size == 1:
            return self._alone[sp.index]
        bucket, k = self._bucket_of[sp.index]
        buf = self._partition(bucket.dtype, sp.shard.device)
        start = bucket.partition_offset + bucket.offsets[k]
        return buf[start : start + sp.shard_numel]

    def grad_buffers(self) -> list[torch.Tensor]:
        """The tensors holding this rank's gradient shards (for memory accounting)."""
        return [*self._partitions.values(), *self._alone.values()]

    def end_window(self) -> None:
        """End the accumulation window (optimizer step or ``zero_grad``)."""
        self.micro_step = 0
        self._window_flags.zero_()
        self._alone.clear()

    # -- arrivals -------------------------------------------------------------------------

    def on_grad(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        """Take a parameter's full gradient (the post-accumulate-grad hook calls this)."""
        position = self._position.get(sp.index)
        if position is None:
            return  # not trainable at setup (frozen): not part of any bucket
        if self.comm.world_size == 1:
            self._accumulate_alone(sp, position, grad)
            return
        self._arrived[position] = 1
        if not self.fixed_buckets:
            self._arrive_dynamic(sp, grad)
            return
        bucket, k = self._bucket_of[sp.index]
        if bucket.launched:
            late = self._late.get(sp.index)
            cast = grad.to(bucket.dtype)
            self._late[sp.index] = cast if late is None else late.add_(cast)
            return
        repeat = sp.index in bucket.arrived
        bucket.arrived.add(sp.index)
        if self.config.contiguous_gradients:
            bucket.write(k, grad, accumulate=repeat, pool=self.pool)
        else:
            prior = bucket.grads.get(sp.index)
            cast = grad.to(bucket.dtype)
            bucket.grads[sp.index] = cast if prior is None else prior.add_(cast)
        if len(bucket.arrived) == len(bucket.params):
            bucket.ready = True
            self._launch_ready()

    def _accumulate_alone(self, sp: ShardedParam, position: int, grad: torch.Tensor) -> None:
        """A world of one: the gradient is its own shard (no collective, no copy).

        The hook has taken the gradient off the parameter, so zero3 owns the tensor and
        keeps it for the window (as plain PyTorch keeps ``param.grad``); copying it into
        a partition buffer would add a pass over every gradient byte to each backward.
        """
        dtype = self._bucket_of[sp.index][0].dtype
        kept = self._alone.get(sp.index)
        if kept is None:
            self._alone[sp.index] = grad.detach().reshape(-1).to(dtype)
        else:
            kept.add_(grad.reshape(-1))
        self._arrived[position] = 1

    def leaf_done(self, leaf_index: int) -> None:
        """A leaf's backward finished: its buckets go now, missing members as zeros (§7)."""
        if not self.fixed_buckets:
            return
        for bucket in self.buckets:
            if bucket.leaf == leaf_index and not bucket.launched:
                bucket.ready = True
        self._launch_ready()

    def _launch_ready(self) -> None:
        if self.comm.world_size == 1 or (self.defer_launches and not self._in_epilogue):
            return
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    # -- collectives ------------------------------------------------------------------------

    def _launch(self, bucket: GradBucket) -> None:
        bucket.launched = True
        device = bucket.params[0].shard.device
        partition = self._partition(bucket.dtype, device)
        region = partition[bucket.partition_offset : bucket.partition_offset + bucket.stride]
        if not self.config.contiguous_gradients:
            if not self.all_reduce_path:
                self._launch_discrete(bucket, region)
                return
            for k, sp in enumerate(bucket.params):  # all-reduce needs the flat layout
                grad = bucket.grads.get(sp.index)
                if grad is not None:
                    bucket.write(k, grad, accumulate=False, pool=self.pool)
        if bucket.flat is None:
            bucket.flat = bucket.new_flat(device, self.pool)
        flat = bucket.seal()
        bucket.flat, bucket.grads = None, {}
        self._reduce_flat(flat, region, bucket.index, bucket.payload_numel)

    def _reduce_flat(
        self, flat: torch.Tensor, region: torch.Tensor, key: int, payload_numel: int
    ) -> None:
        """Reduce a rank-major buffer (regions of ``region.numel()`` elements, the last
        :data:`FINGERPRINT_SLOTS` a fingerprint) into ``region``: copy on micro-step 0,
        else add.
        """
        accumulate = self.micro_step > 0
        rank, world = self.comm.rank, self.comm.world_size
        size = region.numel() - FINGERPRINT_SLOTS
        if self.all_reduce_path:
            self.reduce_stream.wait_stream(self.comm.current_stream())
            work = self.comm.all_reduce(flat, op=ReduceOp.AVG, stream=self.reduce_stream)

            def finish_all_reduce() -> None:
                mine = flat.view(world, -1)[rank]
                region[:size].add_(mine[:size]) if accumulate else region.copy_(mine)
                self._fingerprints.append((key, mine[size:].clone()))
                self.pool.give(flat)

            self._count(payload_numel, flat.numel(), flat.dtype, factor=2)
            self._track(work, finish_all_reduce, key)
            return
        target = torch.empty_like(region) if accumulate else region
        self.reduce_stream.wait_stream(self.comm.current_stream())
        work = self.comm.reduce_scatter(target, flat, op=ReduceOp.AVG, stream=self.reduce_stream)

        def finish_reduce_scatter() -> None:
            if accumulate:
                region[:size].add_(target[:size])
            self._fingerprints.append((key, target[size:]))
            self.pool.give(flat)

        self._count(payload_numel, flat.numel(), flat.dtype, factor=1)
        self._track(work, finish_reduce_scatter, key)

    def _launch_discrete(self, bucket: GradBucket, region: torch.Tensor) -> None:
        """Discrete path: list reduce-scatter over the bucket's gradients."""
        accumulate = self.micro_step > 0
        target = torch.empty_like(region) if accumulate else region
        outputs, inputs = [], []
        for k, sp in enumerate(bucket.params):
            offset = bucket.offsets[k]
            outputs.append(target[offset : offset + sp.shard_numel])
            inputs.append(bucket.padded_grad(k, region.device))
        size = bucket.region_numel
        outputs.append(target[size:])
        bits = fingerprint_bits(bucket.index, bucket.dtype, region.device)
        inputs.append(bits.repeat(bucket.world_size))
        bucket.grads = {}
        self.reduce_stream.wait_stream(self.comm.current_stream())
        work = self.comm.reduce_scatter_coalesced(
            outputs, inputs, op=ReduceOp.AVG, stream=self.reduce_stream
        )

        def finish() -> None:
            if accumulate:
                region[:size].add_(target[:size])
            self._fingerprints.append((bucket.index, target[size:]))

        self._count(bucket.payload_numel, sum(t.numel() for t in inputs), bucket.dtype, 1)
        self._track(work, finish, bucket.index)

    def _count(
        self, payload_numel: int, buffer_numel: int, dtype: torch.dtype, factor: int
    ) -> None:
        stats = self.stats.current
        elem = torch.empty((), dtype=dtype).element_size()
        fingerprint = self.comm.world_size * FINGERPRINT_SLOTS
        stats.reduce_collectives += 1
        stats.reduce_payload_bytes += factor * payload_numel * elem
        stats.reduce_fingerprint_bytes += factor * fingerprint * elem
        stats.reduce_padding_bytes += factor * (buffer_numel - payload_numel - fingerprint) * elem

    def _track(self, work: Work, finish: _Finish, key: int) -> None:
        issued = self.tracer.now_us() if self.tracer is not None else 0.0
        self._inflight.append(_Inflight(work, finish, key, issued))
        limit = MAX_INFLIGHT_REDUCTIONS if self.config.overlap_comm else 0
        while len(self._inflight) > limit:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        entry = self._inflight.popleft()
        tracer = self.tracer
        waited = tracer.now_us() if tracer is not None else 0.0
        entry.work.wait(self.comm.current_stream())
        entry.finish()
        if tracer is not None:
            end = tracer.now_us()
            tracer.complete(
                f"reduce bucket {entry.key}", "reduce", entry.issued_us, end, lane="reduce"
            )
            tracer.complete(f"wait reduce bucket {entry.key}", "wait", waited, end)

    def _check_fingerprints(self) -> None:
        """Every reduction's fingerprint bits must have come back exactly 0 or 1."""
        if not self._fingerprints:
            return
        keys = [key for key, _ in self._fingerprints]
        got = torch.stack([t.float() for _, t in self._fingerprints]).cpu()
        self._fingerprints = []
        expected = torch.stack([fingerprint_bits(k, torch.float32) for k in keys])
        bad = (got != expected).any(dim=1)
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0])
            raise FingerprintMismatchError(
                f"zero3: ranks reduced different gradient buckets together (this rank's "
                f"reduction #{first}, bucket key {keys[first]}, came back mixed). The ranks' "
                "bucket plans differ: every rank must shard identically built models with the "
                "same trainable parameters and leaf modules."
            )

    # -- arrival-order buckets (the private off switch) ------------------------------------

    def _arrive_dynamic(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        self._dynamic.append((sp, grad.reshape(-1)))
        if sum(p.padded_numel for p, _ in self._dynamic) >= self.config.reduce_bucket_size:
            self._flush_dynamic()

    def _flush_dynamic(self) -> None:
        """Reduce the arrival-ordered gradients one parameter at a time."""
        for sp, grad in self._dynamic:
            bucket, k = self._bucket_of[sp.index]
            world, size = sp.world_size, sp.shard_numel
            flat = torch.empty(
                world, size + FINGERPRINT_SLOTS, dtype=bucket.dtype, device=grad.device
            )
            padded = torch.zeros(sp.padded_numel, dtype=bucket.dtype, device=grad.device)
            padded[: sp.numel].copy_(grad)
            flat[:, :size].copy_(padded.view(world, size))
            flat[:, size:] = fingerprint_bits(sp.index, bucket.dtype, grad.device)
            scratch = torch.zeros(size + FINGERPRINT_SLOTS, dtype=bucket.dtype, device=grad.device)
            self._reduce_flat(flat.view(-1), scratch, sp.index, sp.numel)
            self._finish_all()
            partition = self._partition(bucket.dtype, grad.device)
            start = bucket.partition_offset + bucket.offsets[k]
            if self.micro_step:
                partition[start : start + size].add_(scratch[:size])
            else:
                partition[start : start + size].copy_(scratch[:size])
        self._dynamic = []

    def _finish_all(self) -> None:
        while self._inflight:
            self._finish_oldest()

    # -- epilogue -----------------------------------------------------------------------------

    def end_backward(self) -> None:
        """The epilogue: flush, wait, exchange got-gradient flags, late path, reset (§5.4)."""
        if self.fixed_buckets:
            for bucket in self.buckets[self._next_launch :]:
                bucket.ready = True
            self._in_epilogue = True
            try:
                self._launch_ready()
            finally:
                self._in_epilogue = False
        else:
            self._flush_dynamic()
        self._finish_all()
        self._check_fingerprints()
        n = len(self.params)
        flags = torch.zeros(2 * n, dtype=torch.uint8)
        flags[:n] = self._arrived
        for index in self._late:
            flags[n + self._position[index]] = 1
        if n:
            self.comm.all_reduce(flags, op=ReduceOp.MAX).wait()
            self.stats.current.grad_flag_bytes += flags.numel()
        got, late = flags[:n].bool(), flags[n:].bool()
        if bool(late.any()):
            self._reduce_late(late)
        self._window_flags |= got
        self.micro_step += 1
        self._reset_backward()

    def _reduce_late(self, late: torch.Tensor) -> None:
        """One extra reduction for gradients that arrived after their bucket left."""
        members = [self.params[int(k)] for k in torch.nonzero(late).flatten()]
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in members:
            by_dtype.setdefault(self._bucket_of[sp.index][0].dtype, []).append(sp)
        for dtype, group in by_dtype.items():
            device = group[0].shard.device
            outputs = [torch.empty(sp.shard_numel, dtype=dtype, device=device) for sp in group]
            inputs = []
            for sp in group:
                padded = torch.zeros(sp.padded_numel, dtype=dtype, device=device)
                grad = self._late.get(sp.index)
                if grad is not None:
                    padded[: sp.numel].copy_(grad.reshape(-1))
                inputs.append(padded)
            key = _LATE_KEY
            outputs.append(torch.empty(FINGERPRINT_SLOTS, dtype=dtype, device=device))
            inputs.append(fingerprint_bits(key, dtype, device).repeat(self.comm.world_size))
            self.comm.reduce_scatter_coalesced(outputs, inputs, op=ReduceOp.AVG).wait()
            self._fingerprints.append((key, outputs[-1]))
            self.stats.current.late_reductions += 1
            for sp, out in zip(group, outputs, strict=False):
                bucket, k = self._bucket_of[sp.index]
                buf = self._partition(bucket.dtype, device)
                start = bucket.partition_offset + bucket.offsets[k]
                buf[start : start + sp.shard_numel].add_(out)
        self._check_fingerprints()
