"""``iter_full_parameters``: a sharded model's full weights, a bucket at a time.

For inference engines (vLLM's ``load_weights``, SGLang's weight updates), a reference
policy or an exporter that takes tensors one by one: the full model never exists at once
on any rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from zero3.core.engine import STREAMED, ShardedModelState, ShardedParam, sharded_param
from zero3.hooks._unsharded import sharded_root

__all__ = ["DEFAULT_BUCKET_BYTES", "iter_full_parameters"]

#: Bytes of parameters gathered at once by default.
DEFAULT_BUCKET_BYTES = 64 << 20


def iter_full_parameters(
    module: nn.Module,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    rank0_only: bool = False,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full_tensor)`` for every parameter of a sharded model, in
    ``named_parameters()`` order (a tied weight once, under its first name), gathering
    consecutive parameters of at most about ``bucket_bytes`` together.

    Every rank must consume the whole iterator (each bucket is a collective). A rank that
    stops early leaves its peers at the next bucket's gather: its next zero3 collective
    (a forward, say) meets their header and every rank raises an error naming both
    operations; a rank that never issues another one leaves them waiting until the
    timeout, whose error says what they waited for.

    A yielded tensor is a view of the gathered parameter, valid until the iterator
    advances (then its bytes are freed; copy it to keep it). With ``dtype`` it is a cast
    copy instead. At most ``max(bucket_bytes, largest parameter)`` bytes of parameters
    are gathered at once; these gathers count in ``stats(model).memory``.

    Args:
        module: The root module returned by :func:`~zero3.hooks.shard_module`.
        bucket_bytes: Bytes of parameters gathered together (a larger parameter is
            gathered alone).
        rank0_only: Only rank 0 yields; the other ranks take part in the gathers and
            yield nothing.
        dtype: Cast each tensor to this dtype (bf16 for an inference engine, from the
            fp32 parameters of an fp32 model, which are the optimizer's masters).

    Raises:
        ValueError: ``module`` is not a sharded root module, or ``bucket_bytes`` < 1.
    """
    state = sharded_root(module, "zero3.hooks.iter_full_parameters")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(
            f"zero3.hooks.iter_full_parameters: bucket_bytes must be a byte count >= 1, got "
            f"{bucket_bytes!r}"
        )
    named = list(module.named_parameters())
    return _stream(state, named, bucket_bytes, rank0_only and state.comm.rank != 0, dtype)


def _buckets(
    named: list[tuple[str, nn.Parameter]], bucket_bytes: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive parameters, at most ``bucket_bytes`` of gathered ones per bucket."""
    out: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, param in named:
        nbytes = _gathered_bytes(sharded_param(param))
        if out[-1] and nbytes and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, param))
        size += nbytes
    return [bucket for bucket in out if bucket]


def _gathered_bytes(sp: ShardedParam | None) -> int:
    """Bytes a gather of ``sp`` makes whole (0: nothing to gather)."""
    if sp is None or sp.persistent or sp.aliases_param:
        return 0
    return sp.numel * sp.itemsize


def _stream(
    state: ShardedModelState,
    named: list[tuple[str, nn.Parameter]],
    bucket_bytes: int,
    silent: bool,
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in _buckets(named, bucket_bytes):
        gathered = []
        for _, param in bucket:
            sp = sharded_param(param)
            if sp is not None and _gathered_bytes(sp):
                gathered.append(sp)
        state.pin(gathered, STREAMED)
        try:
            if silent:
                continue
            for name, param in bucket:
                tensor = param.detach()
                yield name, tensor if dtype is None else tensor.to(dtype, copy=True)
        finally:
            state.unpin(gathered)
