"""Reduction strategies: how a bucket's gradients become this rank's gradient shards.

The reducer decides *when* a bucket leaves; a :class:`ReducePath` decides *how*: where a
member's gradient waits (:meth:`ReducePath.take`) and which collective turns the bucket
into this rank's shard (:meth:`ReducePath.launch`). :class:`ReduceScatterPath` reduces the
rank-major buffer with the backend's reduce-scatter, :class:`AllReducePath` all-reduces it
and slices (twice the bytes: backends without a reduce-scatter), :class:`DiscretePath`
keeps a list (``contiguous_gradients=False``). Every strategy packs on the compute stream
*before* the reduce stream waits for it: on a device the collective would otherwise read a
buffer whose packing has not run.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

import torch

from zero3.comm import CommBackend, ReduceOp, Stream, Work
from zero3.core.grads._buckets import GradBucket, fingerprint_bits, padded_flat
from zero3.core.params._params import ShardedParam
from zero3.core.params._pool import BufferPool

__all__ = [
    "AllReducePath",
    "DiscretePath",
    "ReducePath",
    "ReduceScatterPath",
    "Reduction",
    "choose_path",
]


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A reduction in flight.

    Attributes:
        work: The collective; the reducer waits for it on the compute stream.
        finish: Called after the wait: moves the result into this rank's region and
            returns the 16 fingerprint elements as they came back.
        key: The fingerprint key the reduction carried (every rank must have used the
            same one).
        payload_numel: Real gradient elements reduced.
        buffer_numel: Elements of the buffer handed to the collective.
        dtype: Its dtype.
        factor: Bytes moved per buffer byte relative to a reduce-scatter (2 for an
            all-reduce).
    """

    work: Work
    finish: Callable[[], torch.Tensor]
    key: int
    payload_numel: int
    buffer_numel: int
    dtype: torch.dtype
    factor: int = 1


class ReducePath(abc.ABC):
    """How gradients wait for their bucket and which collective reduces it.

    Args:
        comm: The gradient backend.
        stream: The stream collectives are issued on (the reduce stream).
        pool: Reusable buffers.
        pack_on_arrival: Write each gradient into the bucket's rank-major flat buffer
            as it arrives (``contiguous_gradients``) instead of keeping it as a tensor.
    """

    def __init__(
        self, comm: CommBackend, stream: Stream, pool: BufferPool, *, pack_on_arrival: bool
    ) -> None:
        self.comm = comm
        self.stream = stream
        self.pool = pool
        self.pack_on_arrival = pack_on_arrival

    def take(self, bucket: GradBucket, position: int, grad: torch.Tensor, repeat: bool) -> None:
        """Keep member ``position``'s gradient until the bucket leaves.

        ``repeat`` is True when the member already got a gradient in this backward (a
        parameter used twice in a reentrant-checkpointed region): the two are summed.
        """
        if self.pack_on_arrival:
            bucket.write(position, grad, accumulate=repeat, pool=self.pool)
            return
        sp = bucket.params[position]
        prior = bucket.grads.get(sp.index)
        cast = grad.to(bucket.dtype)
        bucket.grads[sp.index] = cast if prior is None else prior.add_(cast)

    def packed(self, bucket: GradBucket, device: torch.device) -> torch.Tensor:
        """The bucket's rank-major flat buffer with every kept gradient in place and
        zeros where no gradient arrived (members written on arrival are already there).
        """
        for position, sp in enumerate(bucket.params):
            grad = bucket.grads.get(sp.index)
            if grad is not None:
                bucket.write(position, grad, accumulate=False, pool=self.pool)
        if bucket.flat is None:
            bucket.flat = bucket.new_flat(device, self.pool)
        flat = bucket.seal()
        bucket.flat, bucket.grads = None, {}
        return flat

    @staticmethod
    def fingerprint(key: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The fingerprint elements a reduction keyed ``key`` carries in every rank
        region (the reducer checks they come back unchanged).
        """
        return fingerprint_bits(key, dtype, device)

    @staticmethod
    def padded(
        sp: ShardedParam, grad: torch.Tensor | None, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``grad`` flat and zero-padded to ``sp.padded_numel`` (zeros for None)."""
        return padded_flat(sp, grad, dtype, device)

    def _issue_after_compute(self) -> Stream:
        """Order the reduce stream after everything the compute stream has queued."""
        self.stream.wait_stream(self.comm.current_stream())
        return self.stream

    @abc.abstractmethod
    def launch(self, bucket: GradBucket, region: torch.Tensor, accumulate: bool) -> Reduction:
        """Issue the bucket's collective.

        Args:
            bucket: The bucket (its gradients were given to :meth:`take`).
            region: This rank's slice of the gradient-partition buffer for the bucket
                (:attr:`GradBucket.stride` elements, the last 16 for the fingerprint).
            accumulate: Add the result to ``region`` (later micro-steps of a window)
                instead of overwriting it.
        """


class ReduceScatterPath(ReducePath):
    """Rank-major flat buffer, native reduce-scatter: each rank receives its shard."""

    def launch(self, bucket: GradBucket, region: torch.Tensor, accumulate: bool) -> Reduction:
        """Reduce-scatter the bucket straight into ``region`` (via scratch to accumulate)."""
        flat = self.packed(bucket, region.device)
        size = bucket.region_numel
        target = torch.empty_like(region) if accumulate else region
        stream = self._issue_after_compute()
        work = self.comm.reduce_scatter(target, flat, op=ReduceOp.AVG, stream=stream)

        def finish() -> torch.Tensor:
            if accumulate:
                region[:size].add_(target[:size])
            self.pool.give(flat)
            return target[size:]

        return Reduction(
            work, finish, bucket.index, bucket.payload_numel, flat.numel(), bucket.dtype
        )


class AllReducePath(ReducePath):
    """Rank-major flat buffer all-reduced, this rank's region sliced out (2x the bytes)."""

    def launch(self, bucket: GradBucket, region: torch.Tensor, accumulate: bool) -> Reduction:
        """All-reduce the whole bucket, then copy (or add) region ``rank`` out of it."""
        flat = self.packed(bucket, region.device)
        size = bucket.region_numel
        rank, world = self.comm.rank, self.comm.world_size
        stream = self._issue_after_compute()
        work = self.comm.all_reduce(flat, op=ReduceOp.AVG, stream=stream)

        def finish() -> torch.Tensor:
            mine = flat.view(world, -1)[rank]
            if accumulate:
                region[:size].add_(mine[:size])
            else:
                region.copy_(mine)
            fingerprint = mine[size:].clone()
            self.pool.give(flat)
            return fingerprint

        return Reduction(
            work, finish, bucket.index, bucket.payload_numel, flat.numel(), bucket.dtype, 2
        )


class DiscretePath(ReducePath):
    """Gradients kept as tensors, reduced by one coalesced list reduce-scatter."""

    def __init__(self, comm: CommBackend, stream: Stream, pool: BufferPool) -> None:
        super().__init__(comm, stream, pool, pack_on_arrival=False)

    def launch(self, bucket: GradBucket, region: torch.Tensor, accumulate: bool) -> Reduction:
        """Reduce-scatter each member's padded gradient into its place in ``region``."""
        target = torch.empty_like(region) if accumulate else region
        outputs, inputs = [], []
        for position, sp in enumerate(bucket.params):
            offset = bucket.offsets[position]
            outputs.append(target[offset : offset + sp.shard_numel])
            grad = bucket.grads.get(sp.index)
            inputs.append(self.padded(sp, grad, bucket.dtype, region.device))
        size = bucket.region_numel
        outputs.append(target[size:])
        bits = self.fingerprint(bucket.index, bucket.dtype, region.device)
        inputs.append(bits.repeat(bucket.world_size))
        bucket.grads = {}
        # The coalesced collective packs its inputs on the stream it is issued on, so
        # the padded inputs above (written on the compute stream) are ordered first.
        stream = self._issue_after_compute()
        work = self.comm.reduce_scatter_coalesced(outputs, inputs, op=ReduceOp.AVG, stream=stream)

        def finish() -> torch.Tensor:
            if accumulate:
                region[:size].add_(target[:size])
            return target[size:]

        buffer_numel = sum(t.numel() for t in inputs)
        return Reduction(
            work, finish, bucket.index, bucket.payload_numel, buffer_numel, bucket.dtype
        )


def choose_path(
    comm: CommBackend, stream: Stream, pool: BufferPool, *, all_reduce: bool, contiguous: bool
) -> ReducePath:
    """The strategy for a backend and configuration (see the module Note)."""
    if all_reduce or not comm.capabilities.native_reduce_scatter:
        return AllReducePath(comm, stream, pool, pack_on_arrival=contiguous)
    if contiguous:
        return ReduceScatterPath(comm, stream, pool, pack_on_arrival=True)
    return DiscretePath(comm, stream, pool)
