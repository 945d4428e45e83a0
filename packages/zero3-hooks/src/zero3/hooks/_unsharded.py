"""``unsharded``: a sharded model whole for a while (rollouts, evaluation, generation).

The temporary counterpart of :func:`zero3.hooks.unshard_module` (which is permanent), as
FSDP2's ``unshard()`` / ``reshard()`` pair and DeepSpeed's ``GatheredParameters`` are.
What a block gathers and why the hooks go with the gathers:
``zero3.core.model._unshard`` (its Notes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zero3.core.engine import ShardedModelState, try_sharded_state
from zero3.hooks._hooks import installed

__all__ = ["unsharded"]


def sharded_root(module: nn.Module, what: str) -> ShardedModelState:
    """The state of a sharded root module; a clear error for anything else."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what} expects an nn.Module, got {type(module).__name__}")
    state = try_sharded_state(module)
    if state is None:
        raise ValueError(
            f"{what}: {type(module).__name__} is not a sharded model: pass the root module "
            "that zero3.hooks.shard_module returned (a submodule or an unsharded model has "
            "nothing to gather)"
        )
    return state


def _check_budget(max_bytes: int | None) -> None:
    if max_bytes is None:
        return
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(
            f"zero3.hooks.unsharded: max_bytes must be None or a byte count >= 0, got {max_bytes!r}"
        )


@contextlib.contextmanager
def unsharded(module: nn.Module, *, max_bytes: int | None = None) -> Iterator[nn.Module]:
    """Keep a sharded model's parameters whole inside the block, and its forward as fast
    as the unsharded model's (docs/generation.rst).

    Every rank must enter the block (a collective). On entry the parameters are gathered
    once: all of them, or with ``max_bytes`` as many as fit in the order forwards use
    them (the rest gathered per use, prefetching within the budget). The forward hooks of
    every module whose parameters are all kept are taken out for the block and put back
    in their places on exit, when the parameters go back to their shards. The block's
    gathers count in ``stats(model).memory``.

    In-place edits of whole parameters inside are merged into the shards on exit, by the
    rule of every edit of a whole parameter (each element takes the value a rank wrote,
    the largest where ranks differ), as ``gathered_parameters`` without
    ``modifier_rank`` does; ``param.data`` writes are not seen. Backward is refused: a
    grad-enabled forward of a model with trainable parameters raises. ``generate`` opens
    a block by itself, bounded by the reuse window, unless it runs inside one.

    Args:
        module: The root module returned by :func:`~zero3.hooks.shard_module`.
        max_bytes: At most this many bytes of parameters kept gathered (None: all). The
            gathered bytes stay within ``max_bytes`` plus the largest parameter, with the
            exceptions the guide names ("The memory budget").

    Yields:
        The module itself.

    Raises:
        ValueError: ``module`` is not a sharded root module, or ``max_bytes`` is not a
            byte count.
        RuntimeError: Nested, inside a step, or with ``unshard_module`` /
            ``set_leaf_modules`` inside; a grad-enabled forward of a trainable model.
    """
    state = sharded_root(module, "zero3.hooks.unsharded")
    _check_budget(max_bytes)
    hooks = installed(module)
    assert hooks is not None
    plan = state.open_unsharded(max_bytes)
    clean = False
    try:
        trainable = any(sp.requires_grad for sp in state.params)
        hooks.suspend(plan.bypass, _refuse_grad(type(module).__name__) if trainable else None)
        yield module
        clean = True
    finally:
        hooks.resume()
        state.close_unsharded(plan, clean=clean)


def _refuse_grad(name: str) -> Any:
    def guard(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"zero3.hooks.unsharded: a forward of {name} with grad enabled inside the "
                "block; backward is not supported there (the forward runs without zero3's "
                "hooks, so its gradients would not be reduced). Run it under "
                "torch.no_grad() (generate does), and the training forward after the block"
            )

    return guard
