"""Rank 0's values on every rank: the broadcast behind ``sync_module_states`` and the
buffers zero3 keeps equal across ranks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zero3.comm import CommBackend

__all__ = ["broadcast_from_rank0"]

_SYNC_CHUNK = 1 << 26  # elements per coalesced broadcast
_ALONE = 1 << 20  # tensors at least this large are broadcast in place, without a copy


def broadcast_from_rank0(comm: CommBackend, tensors: Iterable[torch.Tensor]) -> None:
    """Make every rank hold rank 0's values.

    Large contiguous tensors go alone and in place; small ones are coalesced per dtype
    (one copy each way) so a model's many biases and norms cost a few collectives.
    """
    by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if not t.numel():
            continue
        if t.numel() >= _ALONE and t.is_contiguous():
            comm.broadcast(t, src=0).wait()
        else:
            by_key.setdefault((t.dtype, t.device), []).append(t)
    for group in by_key.values():
        batches: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in group:
            if batches[-1] and size + t.numel() > _SYNC_CHUNK:
                batches.append([])
                size = 0
            batches[-1].append(t)
            size += t.numel()
        for batch in batches:
            flat = torch.cat([b.reshape(-1) for b in batch])
            comm.broadcast(flat, src=0).wait()
            for b, part in zip(batch, flat.split([b.numel() for b in batch]), strict=True):
                b.copy_(part.view_as(b))
