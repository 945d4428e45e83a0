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
    as the unsharded model's.

    Every rank must enter the block (a collective). On entry the parameters are gathered
    once: all of them, or with ``max_bytes`` as many as fit in the order forwards use
    them; the rest are gathered per use, with prefetches that stay within the budget.
    The forward hooks of every module whose parameters are all kept are taken out for
    the block (the module runs exactly as unsharded) and put back, in their places, on
    exit. On exit the parameters go back to their shards (``stats(model).memory``
    counts the block's gathers; its ``gathered_bytes`` is 0 again).

    - **In-place edits** of whole parameters inside the block (``torch.no_grad()``
      writes, ``nn.Embedding(max_norm=...)``) are merged into the shards on exit by the
      rule every edit of a whole parameter follows: each element takes the value a rank
      wrote to it, the largest where ranks wrote different values (the in-place edits
      Note of ``zero3.core.model._sync``). This is what ``gathered_parameters`` does
      without ``modifier_rank``; writes through ``param.data`` bypass autograd's version
      counter, are not seen and are lost.
    - **Backward is refused**: a forward with grad enabled on a model with trainable
      parameters raises (run rollouts under ``torch.no_grad()``, as ``generate`` does,
      and the training forward after the block). A frozen model (a reference policy)
      may run with grad enabled.
    - Entering inside another block on the model, inside a step (a running forward, or
      a training forward whose backward has not run), or with a module that is not a
      sharded root raises; so do ``unshard_module`` and ``set_leaf_modules`` inside.

    ``transformers``' ``generate`` on a sharded model opens such a block by itself,
    bounded by the model's reuse window (``Zero3Config.max_reuse_distance`` and
    ``max_live_parameters``), unless it runs inside one already.

    Args:
        module: The root module returned by :func:`~zero3.hooks.shard_module`.
        max_bytes: At most this many bytes of parameters kept gathered (None: all). The
            gathered bytes stay within ``max_bytes`` plus the largest parameter (see
            the budget Note of ``zero3.core.model._unshard`` for the one exception).

    Yields:
        The module itself.

    Raises:
        ValueError: ``module`` is not a sharded root module, or ``max_bytes`` is not a
            byte count.
        RuntimeError: Nested or inside a step (on entry); a grad-enabled forward of a
            trainable model inside the block.
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
