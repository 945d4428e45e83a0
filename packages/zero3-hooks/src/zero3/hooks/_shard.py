"""shard_module and its inverse: the user-facing entry points of zero3.hooks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch import nn

from zero3.comm import CommBackend, create_backend
from zero3.core import MemoryStats, StepStats, WeightSource, Zero3Config
from zero3.core import memory_stats as _core_memory_stats
from zero3.core.engine import (
    LeafTarget,
    ShardedModelState,
    mark_leaf,
    match_leaf_modules,
    sharded_state,
    try_sharded_state,
)
from zero3.hooks._generate import ShardedGeneration, generates
from zero3.hooks._hooks import INSTALLED, ModelHooks, install_hooks
from zero3.hooks._module import ShardedModule
from zero3.hooks._state_dict import install_state_dict_guards

__all__ = [
    "ShardedModule",
    "memory_stats",
    "set_leaf_modules",
    "shard_module",
    "stats",
    "unshard_module",
]

_HOOKS = INSTALLED
_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    sharded = _CLASSES.get(cls)
    if sharded is None:
        # Same name and module: code that reads type(model).__name__ (checkpoint
        # metadata, logging) sees the user's class. A class that generates gets the
        # generation mixin too (zero3.hooks._generate, Note "why the model class").
        mixin = ShardedGeneration if generates(cls) else ShardedModule
        sharded = type(
            cls.__name__,
            (mixin, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        _CLASSES[cls] = sharded
    return sharded


def _check_devices(module: nn.Module, comm: CommBackend) -> None:
    for name, param in module.named_parameters():
        if param.device.type not in (comm.device_type, "meta"):
            raise ValueError(
                f"parameter {name!r} is on {param.device} but the {comm.name!r} comm backend "
                f"moves {comm.device_type} tensors; move the model (model.to(...)) or pick a "
                "backend for its device (Zero3Config.backend)"
            )


def shard_module(
    module: nn.Module,
    config: Zero3Config | None = None,
    *,
    comm: CommBackend | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    checkpoint: str | os.PathLike[str] | WeightSource | None = None,
) -> nn.Module:
    """Partition ``module``'s parameters across ranks and install zero3's hooks.

    Returns the same module object, which is called as before: forward gathers
    parameters module by module (prefetching once the order is known), backward
    gathers them again and reduces gradients into per-rank shards, and the end of
    backward is detected automatically. Every rank must call this, on identically
    built models.

    A model built under :func:`empty_init` (or ``torch.device("meta")``) is never whole
    on any rank: its parameters are materialized one module at a time straight into this
    rank's shard.

    - With ``checkpoint``, every parameter (and persistent buffer) is read from it,
      each rank reading only the elements of its own shard. Keys are the unsharded
      model's ``state_dict()`` keys (tied weights need one of their names; stored under
      several, the last in ``state_dict()`` order wins, as in ``load_state_dict``); missing,
      unexpected and mis-shaped keys are reported together in one error, on every rank,
      before anything is changed. Tensors are cast to the parameter's dtype.
    - Without it, each module's meta parameters are initialised by
      ``param_init_fn(module)`` if given, else by the module's ``reset_parameters()``
      (or ``_reset_parameters()``), children before parents as in eager construction.
      For transformers models pass ``param_init_fn=model._init_weights``. With
      ``config.sync_module_states`` (the default) rank 0's values are broadcast as each
      module is built; with it off, ranks that initialised differently raise an error
      naming the parameters. A meta parameter that nothing initialises is an error.

    A buffer still on the meta device (nothing provides it) is an error naming it.
    Parameters not on meta, without ``checkpoint``, are sharded from their values.

    Args:
        module: The model (parameters on the device the backend serves, or on meta).
        config: Engine settings; default ``Zero3Config()``.
        comm: A ready backend; default ``zero3.comm.create_backend(config.backend,
            timeout_s=config.timeout_s)``.
        param_init_fn: Initialises one module's own parameters in place (called for
            every module that has meta parameters, or writes some).
        checkpoint: A safetensors file, or a directory holding ``model.safetensors`` or
            ``model.safetensors.index.json`` and its files (the transformers layout), or
            an open :class:`~zero3.core.WeightSource`.

    Raises:
        ValueError: The module (or one of its parameters) is already sharded, its
            parameters are on a device the backend does not serve, or the checkpoint /
            initialisation does not cover the model (the message lists every problem).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard_module expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, ShardedModule) or try_sharded_state(module) is not None:
        raise ValueError(
            f"{type(module).__name__} is already sharded; shard a module once "
            "(zero3.hooks.unshard_module undoes it)"
        )
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(
            "shard_module: param_init_fn must be a callable taking a module, got "
            f"{type(param_init_fn).__name__}"
        )
    config = config or Zero3Config()
    if comm is None:
        comm = create_backend(config.backend, timeout_s=config.timeout_s)
    _check_devices(module, comm)
    state = ShardedModelState.create(
        module, config, comm, param_init_fn=param_init_fn, checkpoint=checkpoint
    )
    _HOOKS[module] = _install(state)
    module.__class__ = _sharded_class(type(module))
    return module


def unshard_module(module: nn.Module) -> nn.Module:
    """Undo :func:`shard_module`: full parameters restored on every rank, hooks removed.

    A collective (it gathers every parameter). Returns the same module.

    Raises:
        ValueError: ``module`` is not sharded.
        RuntimeError: Inside a :func:`~zero3.hooks.unsharded` block.
    """
    state = sharded_state(module)
    _refuse_inside_unsharded(state, "unshard_module")
    hooks = _HOOKS.pop(module)
    state.unshard()
    hooks.remove()
    cls = type(module)
    if issubclass(cls, ShardedModule):
        original = next(c for c in cls.__mro__[1:] if not issubclass(c, ShardedModule))
        module.__class__ = original
    return module


def stats(module: nn.Module) -> StepStats:
    """The counters of the last step of a sharded module, with its memory now.

    A snapshot: what was gathered, prefetched and reduced in the last finished step,
    and in :attr:`~zero3.core.StepStats.memory` the model-state bytes this rank holds
    (counting the optimizers that step the model) against one unsharded process, and
    the peaks (see :func:`memory_stats`).
    """
    return dataclasses.replace(
        sharded_state(module).last_stats(), memory=_core_memory_stats(module)
    )


def memory_stats(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryStats:
    """Model-state bytes this rank holds against one unsharded process, and the peaks.

    The sibling of :func:`stats` for memory: parameter shards, gradient shards, fp32
    masters and optimizer state (of ``optimizer``, default the PartitionedOptimizers
    stepping the model), against what
    one process would hold; the full parameters gathered now and at most since
    sharding; the cached buffers; and the process's peak resident set. See
    :class:`zero3.core.MemoryStats`; :func:`zero3.core.estimate_model_states` answers
    before the model is built.
    """
    return _core_memory_stats(module, optimizer)


def set_leaf_modules(module: nn.Module, *targets: LeafTarget) -> list[str]:
    """Make every submodule matching ``targets`` a leaf: gathered whole on entry.

    A leaf's subtree is fetched once when it is entered and released when it exits,
    and its gradients are reduced together once its backward is done — so routing
    inside it (experts picked differently per rank) cannot desynchronize ranks.
    Call it before or after :func:`shard_module` (after: between steps).

    Args:
        module: The (root) model.
        *targets: Module classes, qualified or bare class names, or
            :class:`~zero3.core.ModulePath` places in the model.

    Returns:
        The qualified names of the modules marked.

    Raises:
        ValueError: No submodule matches one of the targets.
    """
    if not targets:
        raise ValueError("set_leaf_modules needs at least one class or class name")
    state = try_sharded_state(module)
    if state is not None:
        _refuse_inside_unsharded(state, "set_leaf_modules")
    matched = match_leaf_modules(module, targets, source="set_leaf_modules")
    for _, sub in matched:
        if state is None:
            mark_leaf(sub)
        else:
            state.set_leaf(sub, True)
    marked = [name or "<root>" for name, _ in matched]
    if state is not None:
        _HOOKS[module].remove()
        _HOOKS[module] = _install(state)
    return marked


def _refuse_inside_unsharded(state: ShardedModelState, what: str) -> None:
    if state.step.unsharded:
        raise RuntimeError(
            f"zero3.hooks.{what} inside a zero3.hooks.unsharded block: the block has taken "
            "hooks out and will put them back on exit; call it after the block"
        )


def _install(state: ShardedModelState) -> ModelHooks:
    """Module hooks and state-dict guards for ``state``, removable together."""
    return install_hooks(state, install_state_dict_guards)


def _hooks_of(module: nn.Module) -> ModelHooks:
    return _HOOKS[module]
