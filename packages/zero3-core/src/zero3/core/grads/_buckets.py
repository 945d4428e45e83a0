"""Gradient buckets: membership fixed at setup, rank-major flat buffers.

Membership and launch order come from a deterministic parameter order, never from the
order gradients arrive (it differs between ranks under data-dependent routing), so every
rank issues the same reductions; a member without a gradient here reduces as zeros. Each
rank region ends with the bucket key's bits as 0.0/1.0: averaged over ranks they stay
exact only if every rank reduced the same bucket. docs/architecture.rst, "The gradient
lifecycle" (fixed buckets, rank-major layout, fingerprints inside reductions).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch

from zero3.core.params._params import ShardedParam
from zero3.core.params._pool import BufferPool

__all__ = ["FINGERPRINT_SLOTS", "GradBucket", "fingerprint_bits", "padded_flat", "plan_buckets"]

#: Elements at the end of every rank region that carry the bucket key's bits.
FINGERPRINT_SLOTS = 16


def fingerprint_bits(
    key: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The 16 bits of ``key`` as 0.0/1.0 values (exact in every floating dtype).

    Cached per (key, dtype, device) and read-only: on an accelerator, building it
    from Python values is a blocking host-to-device copy, which every bucket of every
    backward would otherwise pay.
    """
    return _fingerprint_bits(key, dtype, torch.device(device))


@functools.lru_cache(maxsize=4096)
def _fingerprint_bits(key: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    bits = [(key >> i) & 1 for i in range(FINGERPRINT_SLOTS)]
    with torch.inference_mode(False):
        return torch.tensor(bits, dtype=dtype, device=device)


def padded_flat(
    sp: ShardedParam, grad: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``grad`` flattened and zero-padded to ``sp.padded_numel`` elements, in ``dtype``
    (all zeros when ``grad`` is None: a member that got no gradient reduces as zeros).
    """
    out = torch.zeros(sp.padded_numel, dtype=dtype, device=device)
    if grad is not None:
        out[: sp.numel].copy_(grad.reshape(-1))
    return out


@dataclasses.dataclass(eq=False)
class GradBucket:
    """A fixed group of parameters whose gradients are reduced in one collective.

    Attributes:
        index: Launch order (buckets launch strictly in index order).
        dtype: dtype gradients are reduced and accumulated in.
        params: Members, in layout order.
        offsets: Each member's offset (elements) inside one rank region.
        region_numel: Gradient elements of one rank region (``S``); the region is
            followed by :data:`~zero3.core.grads._buckets.FINGERPRINT_SLOTS` fingerprint elements.
        partition_offset: Where the bucket's region lives in the partition buffer of
            its dtype.
        leaf: Index of the leaf module whose subtree owns the members, or None.
        arrived: Indices of the members whose gradient arrived in this backward.
        ready: Every member arrived (or the bucket is flushed); it may launch in turn.
        launched: Its reduction has been issued in this backward.
        flat: The rank-major buffer (contiguous path), allocated on first arrival.
        grads: The members' gradients kept as tensors (discrete path).
    """

    index: int
    dtype: torch.dtype
    params: list[ShardedParam]
    offsets: list[int]
    region_numel: int
    partition_offset: int
    leaf: int | None
    # -- per-backward state -----------------------------------------------------------
    arrived: set[int] = dataclasses.field(default_factory=set)
    ready: bool = False
    launched: bool = False
    flat: torch.Tensor | None = None
    grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    written: set[int] = dataclasses.field(default_factory=set)

    def reset(self) -> None:
        """Forget this backward's arrivals and buffers."""
        self.arrived.clear()
        self.ready = False
        self.launched = False
        self.flat = None
        self.grads.clear()
        self.written.clear()

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self.params[0].world_size

    @property
    def stride(self) -> int:
        """Elements of one rank region, fingerprint included."""
        return self.region_numel + FINGERPRINT_SLOTS

    def new_flat(self, device: torch.device, pool: BufferPool | None = None) -> torch.Tensor:
        """A rank-major buffer with this bucket's fingerprint in every region.

        Its gradient slots hold stale bytes (a pooled buffer) until :meth:`write` fills
        a member's slot or :meth:`seal` zeroes the slots nobody wrote: zeroing the
        whole buffer up front would rewrite every byte twice.
        """
        numel = self.world_size * self.stride
        if pool is None:
            flat = torch.empty(numel, dtype=self.dtype, device=device)
        else:
            elem = torch.empty((), dtype=self.dtype).element_size()
            flat = pool.take(numel * elem, device, kind="bucket").view(self.dtype)
        tails = flat.view(self.world_size, self.stride)[:, self.region_numel :]
        tails.copy_(fingerprint_bits(self.index, self.dtype, device).expand_as(tails))
        return flat

    @property
    def payload_numel(self) -> int:
        """Real gradient elements reduced by this bucket."""
        return sum(sp.numel for sp in self.params)

    def slot(self, position: int) -> torch.Tensor:
        """A member's padded gradient inside the flat buffer, as an ``(N, s)`` view."""
        assert self.flat is not None
        sp = self.params[position]
        region = self.flat.view(self.world_size, self.stride)
        offset = self.offsets[position]
        return region[:, offset : offset + sp.shard_numel]

    def write(
        self, position: int, grad: torch.Tensor, accumulate: bool, pool: BufferPool | None = None
    ) -> None:
        """Copy (or add) a member's full gradient into its rank-major slot."""
        if self.flat is None:
            # Zeros: padding and members without a gradient must reduce as zeros.
            self.flat = self.new_flat(grad.device, pool)
        sp = self.params[position]
        slot, flat_grad = self.slot(position), grad.reshape(-1)
        rows, rem = divmod(sp.numel, sp.shard_numel) if sp.shard_numel else (0, 0)
        head = flat_grad[: rows * sp.shard_numel].view(rows, sp.shard_numel)
        if accumulate and position in self.written:
            slot[:rows].add_(head)
            if rem:
                slot[rows, :rem].add_(flat_grad[rows * sp.shard_numel :])
            return
        slot[:rows].copy_(head)
        if rem:
            slot[rows, :rem].copy_(flat_grad[rows * sp.shard_numel :])
            slot[rows, rem:].zero_()  # padding reduces as zeros
        slot[rows + (1 if rem else 0) :].zero_()
        self.written.add(position)

    def seal(self) -> torch.Tensor:
        """The flat buffer ready to reduce: slots nobody wrote become zeros."""
        assert self.flat is not None
        for position in range(len(self.params)):
            if position not in self.written:
                self.slot(position).zero_()
        return self.flat


def plan_buckets(
    params: Sequence[ShardedParam],
    bucket_numel: int,
    reduce_dtype: torch.dtype | None,
    leaf_of: Mapping[int, int],
) -> list[GradBucket]:
    """Group trainable parameters into buckets in reverse registration order.

    A bucket holds at most ``bucket_numel`` padded elements (a larger parameter gets a
    bucket of its own), one dtype, and either no leaf's parameters or one leaf's only
    (a leaf's buckets are launched when its backward is done, members without a
    gradient, such as experts no token was routed to, as zeros; a bucket that also held
    parameters from outside the leaf could not leave then).
    """
    buckets: list[GradBucket] = []
    offsets_by_dtype: dict[torch.dtype, int] = {}
    current: list[ShardedParam] = []
    key: tuple[torch.dtype, int | None] | None = None

    def close() -> None:
        if not current:
            return
        dtype, leaf = key  # type: ignore[misc]
        offsets, cursor = [], 0
        for sp in current:
            offsets.append(cursor)
            cursor += sp.shard_numel
        start = offsets_by_dtype.get(dtype, 0)
        offsets_by_dtype[dtype] = start + cursor + FINGERPRINT_SLOTS
        buckets.append(GradBucket(len(buckets), dtype, list(current), offsets, cursor, start, leaf))
        current.clear()

    size = 0
    for sp in reversed(list(params)):
        sp_key = (reduce_dtype or sp.dtype, leaf_of.get(sp.index))
        if current and (sp_key != key or size + sp.padded_numel > bucket_numel):
            close()
            size = 0
        key = sp_key
        current.append(sp)
        size += sp.padded_numel
    close()
    return buckets
