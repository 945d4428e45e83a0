"""The ranks of a sharded model's checkpoints: DCP's own gloo group over them."""

from __future__ import annotations

import datetime
import weakref
from typing import Any

import torch.distributed as dist
from torch import nn

from zero3.core.model._state import ShardedModelState, sharded_state

__all__ = ["checkpoint_group", "global_ranks"]

_GLOBAL_RANKS: weakref.WeakKeyDictionary[ShardedModelState, list[int]] = weakref.WeakKeyDictionary()
# ranks -> (the default group it was made under, the checkpoint group)
_GROUPS: dict[tuple[int, ...], tuple[Any, dist.ProcessGroup]] = {}


def global_ranks(state: ShardedModelState) -> list[int]:
    """Global rank of each rank of the model's sharding group.

    Raises:
        RuntimeError: torch.distributed is not initialized (the ``mpi`` backend runs
            without it), or the backend's ranks cannot be placed in it.
    """
    ranks = _GLOBAL_RANKS.get(state)
    if ranks is None:
        comm = state.comm
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"sharded checkpoints need torch.distributed: torch.distributed.checkpoint "
                f"coordinates ranks over a process group, and the {comm.name!r} comm backend "
                "runs without one. Use a torch.distributed backend (gloo, nccl, hccl) for "
                "sharded checkpoints, or zero3.core.full_state_dict for full weights."
            )
        group = getattr(comm, "group", None)
        if isinstance(group, dist.ProcessGroup):
            ranks = list(dist.get_process_group_ranks(group))
        elif dist.get_world_size() == comm.world_size:
            ranks = list(range(comm.world_size))
        else:
            raise RuntimeError(
                f"sharded checkpoints: the {comm.name!r} comm backend spans {comm.world_size} "
                f"ranks but names no torch.distributed group, and the default group has "
                f"{dist.get_world_size()}; zero3 cannot tell which ranks hold the shards"
            )
        _GLOBAL_RANKS[state] = ranks
    return ranks


def checkpoint_group(module: nn.Module) -> dist.ProcessGroup | None:
    """A gloo group over the sharding group's ranks for DCP's collectives (None in a
    world of one). Collective on first use for a set of ranks; cached afterwards.

    Note:
        DCP coordinates a save with collectives (plans, results). ``async_save`` runs
        them on a background thread while training goes on: on the group training
        uses, the two sequences interleave differently on each rank and hang (seen
        with gloo). DCP's metadata exchange is also CPU-side, which NCCL cannot do. So
        checkpoints get a gloo group of their own, with the model's comm timeout.
    """
    state = sharded_state(module)
    if state.comm.world_size == 1:
        return None
    ranks = tuple(global_ranks(state))
    world = dist.group.WORLD
    cached = _GROUPS.get(ranks)
    if cached is not None and cached[0] is world:
        return cached[1]
    group = dist.new_group(
        ranks=list(ranks),
        backend="gloo",
        timeout=datetime.timedelta(seconds=state.comm.timeout_s),
        use_local_synchronization=len(ranks) != dist.get_world_size(),
    )
    assert isinstance(group, dist.ProcessGroup)
    _GROUPS[ranks] = (world, group)
    return group
