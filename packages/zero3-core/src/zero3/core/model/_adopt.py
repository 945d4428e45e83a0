"""Parameters and modules added to a model after ``shard_module``: finding and preparing them.

Note (the adoption rule):
    Adapter libraries (peft's ``get_peft_model``, ``PeftModel.from_pretrained``) and user
    code add modules and parameters to a model that is already sharded: a ``q_proj``
    becomes a wrapper holding the old module as ``base_layer`` plus new low-rank
    ``Linear`` modules, a ``modules_to_save`` entry a deep copy of a sharded module.
    Nothing in torch tells zero3 (the old modules' parameter dicts are untouched), so
    the sharded model looks for additions itself at the start of every outermost
    forward and when an optimizer is built over it: every module in its tree that it
    does not know, and every parameter that is not yet sharded. The walk costs about
    what ``named_parameters()`` costs and finds nothing in a steady loop.

    What it finds is *adopted* exactly as ``shard_module`` shards a parameter: cast to
    ``Zero3Config.param_dtype`` if set, rank 0's values broadcast (with
    ``sync_module_states``; otherwise the ranks' values must agree), partitioned or
    persistent by ``param_persistence_threshold``, given gradient hooks when it
    requires grad, and gathered for the module holding it; the new modules get zero3's
    hooks. Known modules keep their indices and take their new qualified names. The
    ranks first compare a description of their additions (one header; on a mismatch
    every rank raises naming the differences), so a rank that added something else
    fails together with the others, and a rank that added nothing meets the others'
    header with its next collective and fails too. Additions come between steps: in
    the middle of a gradient accumulation window they are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zero3.comm import CommBackend
from zero3.core.config._config import Zero3Config
from zero3.core.construct._materialize import check_eager_agree, own_storage
from zero3.core.params import _params
from zero3.core.params._broadcast import broadcast_from_rank0
from zero3.core.params._params import ShardedParam

__all__ = [
    "ADOPT_TITLE",
    "Additions",
    "describe_additions",
    "find_additions",
    "prepare_params",
    "relabel",
]

ADOPT_TITLE = (
    "zero3: the ranks added different parameters or modules to the sharded model after "
    "shard_module (every rank must add the same adapters, e.g. the same peft config, "
    "before the next forward or optimizer):"
)


@dataclasses.dataclass
class Additions:
    """What a walk of the model found that the sharded model does not know.

    Attributes:
        modules: Every module of the model now: the known ones at their old indices
            (with their current names; one no longer in the tree keeps its old name),
            then the new ones in ``named_modules()`` order.
        params: ``(qualified name, parameter, index of the module holding it)`` for each
            new parameter, in ``named_parameters()`` order.
        new_modules: How many entries at the end of :attr:`modules` are new.
    """

    modules: list[tuple[str, nn.Module]]
    params: list[tuple[str, nn.Parameter, int]]
    new_modules: int


def find_additions(
    root: nn.Module,
    known: Sequence[tuple[str, nn.Module]],
    ours: Callable[[torch.Tensor], bool],
) -> Additions | None:
    """The modules and parameters under ``root`` that are not in ``known`` / not sharded.

    Args:
        root: The sharded root module.
        known: The modules the sharded model knows, by index.
        ours: Whether a sharded parameter belongs to this model.

    Returns:
        None when nothing was added.

    Raises:
        ValueError: A parameter of another sharded model was put into this one.
    """
    index = {id(module): i for i, (_, module) in enumerate(known)}
    current = list(root.named_modules())
    added = [(name, module) for name, module in current if id(module) not in index]
    modules = list(known)
    for name, module in current:
        if id(module) in index:
            modules[index[id(module)]] = (name, module)
    for name, module in added:
        index[id(module)] = len(modules)
        modules.append((name, module))
    params: list[tuple[str, nn.Parameter, int]] = []
    seen: set[int] = set()
    for mod_name, module in current:
        for key, param in dict.items(module._parameters):
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{mod_name}.{key}" if mod_name else key
            if _params.lookup(param) is None:
                params.append((name, param, index[id(module)]))
            elif not ours(param):
                raise ValueError(
                    f"zero3: parameter {name!r} was added to the sharded model but belongs to "
                    "another sharded model; a parameter is sharded once (give the new module "
                    "its own parameters, or unshard the other model first)"
                )
    if not added and not params:
        return None
    return Additions(modules, params, len(added))


def describe_additions(found: Additions) -> list[str]:
    """``key=value`` lines every rank must agree on before adopting ``found``."""
    lines = []
    for name, module in found.modules[len(found.modules) - found.new_modules :]:
        lines.append(f"added module {name!r}={type(module).__qualname__}")
    for name, param, _ in found.params:
        lines.append(
            f"added parameter {name!r}=shape {tuple(param.shape)}, {param.dtype}, on "
            f"{param.device.type}, {'trainable' if param.requires_grad else 'frozen'}"
        )
    return lines


def prepare_params(
    comm: CommBackend, config: Zero3Config, named: Sequence[tuple[str, nn.Parameter]]
) -> None:
    """Make new parameters ready to shard as ``shard_module`` does: checked for their
    device, cast to ``param_dtype``, in storages of their own, and equal on every rank
    (rank 0's values broadcast with ``sync_module_states``, else checked). A collective.

    Raises:
        ValueError: A parameter is on meta or on another device than the backend's (the
            same on every rank: the device is part of what the ranks compared).
    """
    for name, param in named:
        if param.device.type != comm.device_type:
            where = "on meta (it has no values)" if param.is_meta else f"on {param.device}"
            raise ValueError(
                f"zero3: parameter {name!r} was added to the sharded model {where}, but the "
                f"{comm.name!r} comm backend moves {comm.device_type} tensors; create it with "
                f"its values on {comm.device_type} (peft: leave low_cpu_mem_usage off)"
            )
    with torch.no_grad():
        for _, param in named:
            if config.param_dtype is not None and param.dtype != config.param_dtype:
                param.data = param.data.to(config.param_dtype)
            own_storage(param)
            param.grad = None
        if comm.world_size == 1:
            return
        if config.sync_module_states:
            broadcast_from_rank0(comm, [param.data for _, param in named])
        else:
            check_eager_agree(comm, [(name, param) for name, param in named])


def relabel(root: nn.Module, params: Sequence[ShardedParam], modules: Sequence[nn.Module]) -> None:
    """Give every sharded parameter its current qualified name and owners (modules
    moved: a ``q_proj.weight`` is now ``q_proj.base_layer.weight``).
    """
    for name, param in root.named_parameters():
        found = _params.lookup(param)
        if found is not None:
            found.name = name
    names = {id(m): name or "<root>" for name, m in root.named_modules()}
    for sp in params:
        sp.owners = []
    for module in modules:
        for held in dict.values(module._parameters):
            owned = None if held is None else _params.lookup(held)
            if owned is not None and id(module) in names:
                owned.owners.append(names[id(module)])
