"""Boxes of a row-major tensor: how a flat element range maps onto tensor slices.

A rank's shard is a flat range of a parameter; checkpoints and weight files store
tensors in their natural shapes. Both the safetensors reads and zero3's DCP state
dicts describe a flat range as the same few boxes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["Box", "flat_boxes", "join_flat"]


#: A box of a tensor: (offsets, sizes), one entry per dimension.
Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[Box]:
    """The boxes making up the flat elements ``[start, stop)`` of a row-major tensor.

    The boxes come in flat order and each is contiguous in it, so box ``k`` is the
    next ``prod(sizes_k)`` elements of the range: at most ``2*(ndim-1)+1`` of them.

    Example::

        >>> flat_boxes(5, 15, (4, 6))   # rows of 6: [5, 6) + [6, 12) + [12, 15)
        [((0, 5), (1, 1)), ((1, 0), (1, 6)), ((2, 0), (1, 3))]
    """
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = shape[1:]
    row = math.prod(inner)
    first, first_col = divmod(start, row)
    last, last_col = divmod(stop, row)
    if first == last:  # inside one row
        return [((first, *o), (1, *s)) for o, s in flat_boxes(first_col, last_col, inner)]
    out: list[Box] = []
    if first_col:  # partial leading row
        out += [((first, *o), (1, *s)) for o, s in flat_boxes(first_col, row, inner)]
        first += 1
    if last > first:  # whole rows
        out.append(((first, *(0,) * len(inner)), (last - first, *inner)))
    if last_col:  # partial trailing row
        out += [((last, *o), (1, *s)) for o, s in flat_boxes(0, last_col, inner)]
    return out


def join_flat(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate flat views, without a copy when they lie back to back in one storage."""
    tensors = [t.reshape(-1) for t in parts]
    if not tensors:
        return torch.empty(0)
    first = tensors[0]
    pos = first.storage_offset()
    same = True
    for t in tensors:
        same = same and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        same = same and t.storage_offset() == pos
        pos += t.numel()
    if same:
        view: torch.Tensor = first.as_strided(
            (pos - first.storage_offset(),), (1,), first.storage_offset()
        )
        return view
    return torch.cat(tensors)
