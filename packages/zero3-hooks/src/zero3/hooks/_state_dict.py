"""Guards on ``state_dict()`` / ``load_state_dict()`` of sharded modules: never empty or
shard-shaped by accident.

The state-dict functions themselves (full and sharded) live in ``zero3.core``;
``zero3.hooks`` re-exports ``full_state_dict``, ``load_full_state_dict`` and ``LoadResult``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from zero3.core.engine import ParamStatus, ShardedModelState, sharded_param

__all__ = ["install_state_dict_guards"]


def _sharded_items(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in dict.items(module._parameters):
        if param is not None:
            sp = sharded_param(param)
            if sp is not None and not sp.persistent:
                yield name, param


def _refuse_unavailable(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """state_dict pre-hook: a partitioned parameter has no data to save here."""
    for name, param in _sharded_items(module):
        sp = sharded_param(param)
        if sp is None or sp.status is not ParamStatus.AVAILABLE:
            raise RuntimeError(
                f"state_dict() of a sharded module: parameter {prefix + name!r} is partitioned "
                "across ranks and not gathered here, so its entry would hold no data. Use "
                "zero3.hooks.full_state_dict(model, rank0_only=False) (every rank calls it; "
                "it gathers module by module), or save a sharded checkpoint with "
                "zero3.optim.save_checkpoint."
            )


def _copy_gathered(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict post-hook: gathered only for now (e.g. inside gathered_parameters), so
    hand out copies; the storages are freed when the parameters are released.
    """
    for name, _ in _sharded_items(module):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = state_dict[key].detach().clone()


def _load_guard(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
    for name, _ in _sharded_items(module):
        if prefix + name in state_dict:
            raise RuntimeError(
                f"load_state_dict() into a sharded module: parameter {prefix + name!r} is "
                "partitioned across ranks. Use zero3.hooks.load_full_state_dict(model, "
                "state_dict), which writes each rank's shard from the full tensors."
            )


def install_state_dict_guards(
    state: ShardedModelState, indices: Sequence[int] | None = None
) -> list[Any]:
    """Register the save and load guards on every module (of ``indices``, default all)
    owning sharded parameters.
    """
    handles = []
    chosen = range(len(state.modules)) if indices is None else indices
    for module in (state.modules[i][1] for i in chosen):
        if any(True for _ in _sharded_items(module)):
            handles.append(module.register_state_dict_pre_hook(_refuse_unavailable))
            handles.append(module.register_state_dict_post_hook(_copy_gathered))
            handles.append(module.register_load_state_dict_pre_hook(_load_guard))
    return handles
