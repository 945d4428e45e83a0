"""Reduction strategies that exist only to test the engine's safeguards."""

from __future__ import annotations

import zlib

import torch

from zero3.comm import CommBackend, ReduceOp, Stream
from zero3.core.engine import BufferPool, GradBucket, ReducePath, Reduction

__all__ = ["ArrivalOrderPath"]


class ArrivalOrderPath(ReducePath):
    """DeepSpeed's bucket rule: a bucket carries the gradients that arrived, in the
    order they arrived, and nothing for members that got none.

    Under data-dependent routing two ranks then pack *different* parameters into
    same-sized collectives. zero3's own buckets have members fixed at setup; this path
    exists so tests can show that the reduction fingerprints catch the mix-up (the key
    is a checksum of the packed parameter indices, so it differs between such ranks).
    """

    def __init__(self, comm: CommBackend, stream: Stream, pool: BufferPool) -> None:
        super().__init__(comm, stream, pool, pack_on_arrival=False)

    def launch(self, bucket: GradBucket, region: torch.Tensor, accumulate: bool) -> Reduction:
        """Pack the arrived gradients in arrival order into a bucket-sized buffer (the
        rest zeros), reduce it, then move each result into its member's slot.
        """
        by_index = {sp.index: (k, sp) for k, sp in enumerate(bucket.params)}
        arrived = [by_index[index] for index in bucket.grads]
        world, device = self.comm.world_size, region.device
        indices = torch.tensor([sp.index for _, sp in arrived], dtype=torch.int64)
        key = zlib.crc32(indices.numpy().tobytes()) & 0xFFFF
        # Same size on every rank (the bucket's), whatever arrived: what differs between
        # ranks is which parameters sit where, which only the fingerprint can tell.
        flat = torch.zeros(world, bucket.stride, dtype=bucket.dtype, device=device)
        cursor = 0
        for _, sp in arrived:
            grad = self.padded(sp, bucket.grads[sp.index], bucket.dtype, device)
            flat[:, cursor : cursor + sp.shard_numel] = grad.view(world, -1)
            cursor += sp.shard_numel
        flat[:, bucket.region_numel :] = self.fingerprint(key, bucket.dtype, device)
        target = torch.empty(bucket.stride, dtype=bucket.dtype, device=device)
        bucket.grads = {}
        stream = self._issue_after_compute()
        work = self.comm.reduce_scatter(target, flat.view(-1), op=ReduceOp.AVG, stream=stream)
        payload = sum(sp.numel for _, sp in arrived)

        def finish() -> torch.Tensor:
            if not accumulate:
                region[: bucket.region_numel].zero_()
            at = 0
            for k, sp in arrived:
                offset = bucket.offsets[k]
                region[offset : offset + sp.shard_numel].add_(target[at : at + sp.shard_numel])
                at += sp.shard_numel
            return target[bucket.region_numel :]

        return Reduction(work, finish, key, payload, flat.numel(), bucket.dtype)
