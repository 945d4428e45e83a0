"""``copy.deepcopy`` of a sharded model, or of one of its modules: an ordinary copy.

Note (what a deep copy of a sharded module is):
    Plain ``copy.deepcopy`` would copy everything the module reaches: the parameters
    (released ones have no bytes to copy), zero3's hooks and, through them, the model's
    state, its process groups and its comm backends, which cannot be copied (a
    ``TypeError`` about a ``mappingproxy`` or a process group, deep inside). What a user
    means by a copy (an EMA: ``torch.optim.swa_utils.AveragedModel(model)``, a frozen
    reference model, peft's ``modules_to_save``) is the module with the same values.
    So a deep copy of a sharded module is an ordinary, unsharded module of the user's
    classes holding the full values: every parameter an ordinary ``nn.Parameter`` of
    its own class, no zero3 hook, the module's own hooks copied as ``deepcopy`` copies
    them. The sharded original is untouched.

    It gathers the copied modules' partitioned parameters, one module at a time, so it is
    a collective: every rank makes the copy, at the same point (a copy on some ranks only
    fails on every rank, as a gather on some ranks only does); a module whose parameters
    are all persistent is copied without one. Each rank then holds the whole copy: for a
    model too large for one rank, keep an EMA of the shards instead (docs:
    troubleshooting, "What you did, and what zero3 does").

    How: ``copy.deepcopy`` reaches a module's ``_parameters`` (zero3's
    ``ParamAccessDict``) before its hooks and children, and the root module's class
    (the ``ShardedModule`` mixin) before anything. Either place calls
    :func:`seed_plain_copy`, which fills ``deepcopy``'s memo for the whole subtree
    first: each parameter's copy (gathered), each ``_parameters`` as a plain dict, and
    each hook dict without zero3's entries. ``deepcopy`` then builds the modules as it
    always does, taking those pieces from the memo.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zero3.core import gathered_parameters
from zero3.core.engine import ParamStatus, sharded_param

__all__ = ["PICKLE_REFUSED", "seed_plain_copy"]

PICKLE_REFUSED = (
    "zero3: a sharded module cannot be pickled (torch.save(model), pickle.dumps): its "
    "parameters are partitioned across ranks and its hooks hold the process groups. Save "
    "its weights with zero3.hooks.full_state_dict(model) (every rank calls it; torch.save "
    "the dict on rank 0) and load them into a freshly built model, save a sharded "
    "checkpoint with zero3.optim.save_checkpoint, or make an ordinary copy with "
    "copy.deepcopy(model) (every rank)."
)


def seed_plain_copy(
    root: nn.Module,
    memo: dict[int, Any],
    zero3_hooks: Mapping[int, set[int]],
    is_ours: Callable[[object], bool],
) -> None:
    """Fill ``deepcopy``'s ``memo`` so that copying ``root`` gives an ordinary module.

    Args:
        root: A module of a sharded model (its root or a submodule).
        memo: The memo of the running ``copy.deepcopy``.
        zero3_hooks: ``id(hook dict) -> keys`` of zero3's entries in modules' hook dicts.
        is_ours: Whether a module's ``_parameters`` is zero3's (to replace it).
    """
    modules = list(root.modules())
    for module in modules:  # the same order on every rank: the gathers pair up
        table = module.__dict__.get("_parameters", {})
        todo = [p for p in dict.values(table) if p is not None and id(p) not in memo]
        with gathered_parameters([p for p in todo if _released(p)]):
            for param in todo:
                # A sharded parameter's __deepcopy__ (ShardedParameter's) gives an
                # ordinary parameter of the user's class.
                memo[id(param)] = copy.deepcopy(param, memo)
    for module in modules:
        for value in list(module.__dict__.values()):
            if id(value) in memo:
                continue
            if is_ours(value):
                memo[id(value)] = {
                    k: None if v is None else memo[id(v)] for k, v in dict.items(value)
                }
            elif isinstance(value, dict) and id(value) in zero3_hooks:
                ours = zero3_hooks[id(value)]
                keep = type(value)((k, v) for k, v in value.items() if k not in ours)
                memo[id(value)] = copy.deepcopy(keep, memo)


def _released(param: torch.Tensor) -> bool:
    sp = sharded_param(param)
    return sp is not None and sp.status is not ParamStatus.AVAILABLE
