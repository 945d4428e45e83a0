"""Guards on ``state_dict()`` / ``load_state_dict()`` of sharded modules: never empty or
shard-shaped by accident.

The state-dict functions themselves (full and sharded) live in ``zero3.core``;
``zero3.hooks`` re-exports ``full_state_dict``, ``load_full_state_dict`` and ``LoadResult``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from zero3.core.engine import (
    ParamStatus,
    ShardedModelState,
    ShardedParam,
    load_module_entry,
    sharded_param,
)

__all__ = ["install_state_dict_guards"]


def _sharded_items(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in dict.items(module._parameters):
        if param is not None:
            sp = sharded_param(param)
            if sp is not None and not sp.persistent:
                yield name, param


class _SaveGuard:
    """state_dict hooks of one module owning partitioned parameters, for a
    ``state_dict()`` called on the module itself (the sharded root's own
    ``ShardedModule.state_dict`` asks for the variables and gives sharded values).

    Trainable partitioned parameters are gathered for the call (a collective: every
    rank calls it, as peft does for a ``modules_to_save`` copy) and handed out as
    copies; a frozen one that is not gathered has no data here and is refused, naming
    what to call instead.
    """

    def __init__(self, state: ShardedModelState) -> None:
        self.state = state
        self.pinned: list[ShardedParam] = []

    def pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return  # the variables themselves (the root's state_dict asks for them)
        wanted = []
        for name, param in _sharded_items(module):
            sp = sharded_param(param)
            if sp is None or sp.status is ParamStatus.AVAILABLE:
                continue
            if not sp.requires_grad:
                raise RuntimeError(
                    f"state_dict() of a sharded module: frozen parameter {prefix + name!r} is "
                    "partitioned across ranks and not gathered here, so its entry would hold "
                    "no data. Call state_dict() on the sharded model (or a module wrapping "
                    "it): its frozen entries are ShardedTensors viewing each rank's shard. "
                    "For whole values use zero3.hooks.full_state_dict(model, "
                    "rank0_only=False) (every rank calls it; it gathers module by module), "
                    "or save a sharded checkpoint with zero3.optim.save_checkpoint."
                )
            wanted.append(sp)
        if wanted:
            self.state.pin(wanted)
            self.pinned.extend(wanted)

    def post(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        """Gathered only for now (for this call, or inside gathered_parameters): hand out
        copies; the storages are freed when the parameters are released.
        """
        try:
            for name, param in _sharded_items(module):
                key = prefix + name
                if key in state_dict and state_dict[key] is not param:  # keep_vars: leave it
                    state_dict[key] = state_dict[key].detach().clone()
        finally:
            pinned, self.pinned = self.pinned, []
            if pinned:
                self.state.unpin(pinned)


class _LoadGuard:
    """load_state_dict hooks of one module: a partitioned parameter's value is written
    into this rank's shard (and master) by zero3, then taken out of torch's way.

    Note (why the key is taken out):
        torch would ``copy_`` the value into the parameter, which has no bytes here. The
        pre-hook writes this rank's part of the value itself (no collective: every rank
        holds the value, whole or as its own boxes) and removes the key from the dict
        torch reads (a copy torch made for this module); the post-hook then takes the
        key off torch's missing keys, so ``strict`` loading still reports only real ones.
    """

    def __init__(self, state: ShardedModelState) -> None:
        self.state = state
        self.written: list[str] = []

    def pre(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, param in _sharded_items(module):
            key = prefix + name
            if key in state_dict:
                sp = sharded_param(param)
                assert sp is not None
                load_module_entry(self.state, key, sp, state_dict.pop(key))
                self.written.append(key)

    def post(self, module: nn.Module, incompatible: Any) -> None:
        written, self.written = set(self.written), []
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in written]


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
            saver = _SaveGuard(state)
            handles.append(module.register_state_dict_pre_hook(saver.pre))
            # A partial, not the bound method: torch marks the hook with an attribute.
            handles.append(module.register_state_dict_post_hook(functools.partial(saver.post)))
            loader = _LoadGuard(state)
            handles.append(module.register_load_state_dict_pre_hook(loader.pre))
            handles.append(module.register_load_state_dict_post_hook(loader.post))
    return handles
