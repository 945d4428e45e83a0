"""Public helpers around partitioned parameters and gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from zero3.core import _params
from zero3.core._coordinator import GATHERED_PARAMETERS
from zero3.core._params import ShardedParam
from zero3.core._state import ShardedModelState, add_pending_external, state_of

__all__ = [
    "full_grad",
    "gathered_parameters",
    "local_grad",
    "register_external_parameter",
    "sharded_param",
]


def _by_state(
    params: Iterable[torch.Tensor],
) -> dict[int, tuple[ShardedModelState, list[ShardedParam]]]:
    groups: dict[int, tuple[ShardedModelState, list[ShardedParam]]] = {}
    seen: set[int] = set()
    for param in params:
        sp = _params.lookup(param)
        if sp is None or id(sp) in seen:
            continue  # unsharded tensors pass through untouched
        seen.add(id(sp))
        state = state_of(param)
        groups.setdefault(id(state), (state, []))[1].append(sp)
    return groups


@contextlib.contextmanager
def gathered_parameters(
    params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None
) -> Iterator[None]:
    """Make ``params`` whole on every rank inside the ``with`` block.

    Every rank must enter the block (it gathers). With ``modifier_rank``, that
    rank's in-place edits to the full parameters are broadcast on exit and every
    rank's shard is updated from them; without it, edits are discarded. Tensors that
    are not sharded parameters pass through untouched.

    Example::

        with gathered_parameters(model.lm_head.weight, modifier_rank=0), torch.no_grad():
            if rank == 0:
                model.lm_head.weight.mul_(0.5)
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    groups = list(_by_state(params).values())
    for state, sps in groups:
        state.coordinator.fetch_params(sps, GATHERED_PARAMETERS, forward=True, pin=True)
    try:
        yield
        if modifier_rank is not None:
            for state, sps in groups:
                _broadcast_edits(state, sps, modifier_rank)
    finally:
        for state, sps in groups:
            state.coordinator.release_params(sps, pin=True)


def _broadcast_edits(state: ShardedModelState, sps: list[ShardedParam], src: int) -> None:
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for sp in sps:
        by_dtype.setdefault(sp.dtype, []).append(sp)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([sp.param.detach().reshape(-1) for sp in group])
            state.comm.broadcast(flat, src=src).wait()
            for sp, part in zip(group, flat.split([sp.numel for sp in group]), strict=True):
                state.write_full(sp, part)


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``param``, which it does not own.

    The parameter is then gathered with ``module`` (forward and backward) and kept
    while it runs. zero3 also detects such reads automatically during forward; the
    explicit call makes the first step's gathers exact too. It may be called before or
    after the model is sharded.
    """
    if not isinstance(param, nn.Parameter):
        raise TypeError(
            f"register_external_parameter: expected an nn.Parameter, got {type(param).__name__}"
        )
    sp = _params.lookup(param)
    if sp is None:
        add_pending_external(module, param)
        return
    state = state_of(param)
    state.coordinator.add_external(state.coordinator.index_of(module), sp)


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's real elements of ``param``'s gradient for the current window.

    None when no rank produced a gradient for it. A view of the gradient-partition
    buffer (in the reduce dtype), valid until the next backward or optimizer step.
    """
    sp = _params.require(param, "zero3.core.local_grad")
    shard = state_of(param).grad_shard(sp)
    return None if shard is None else shard[: sp.local_numel]


def full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full gradient of a sharded parameter, gathered from every rank.

    A collective: every rank must call it, for the same parameters in the same order.
    Returns None when no rank produced a gradient in the current window.
    """
    sp = _params.require(param, "zero3.core.full_grad")
    return state_of(param).full_grad(sp)


def sharded_param(tensor: torch.Tensor) -> ShardedParam | None:
    """The partitioned state of a parameter of a sharded module, or None for any other
    tensor (zero3 keeps it in a side table; nothing is attached to the tensor).
    """
    return _params.lookup(tensor)
