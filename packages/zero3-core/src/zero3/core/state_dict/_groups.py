"""The ranks of a sharded model's checkpoints: DCP's own gloo group over them."""

from __future__ import annotations

import datetime
import weakref
from typing import Any

import torch.distributed as dist
from torch import nn

from zero3.comm import TorchDistBackend
from zero3.core.model._state import ShardedModelState, sharded_state

__all__ = ["checkpoint_group", "global_ranks"]

_GLOBAL_RANKS: weakref.WeakKeyDictionary[ShardedModelState, list[int]] = weakref.WeakKeyDictionary()
# ranks -> (the default group it was made under, the checkpoint group), both weakly: a
# strong reference here would keep a destroyed group, and its gloo threads, alive into
# interpreter finalization, where gloo can abort the process (docs/troubleshooting.rst,
# "A finished gloo rank exits with SIGABRT"). torch's own group map holds a group until
# it is destroyed, so the cache stays good exactly as long as the group is usable.
_GROUPS: dict[tuple[int, ...], tuple[weakref.ref[Any], weakref.ref[dist.ProcessGroup]]] = {}


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
        checkpoints get a gloo group of their own, with the model's comm timeout: the
        comm backend's host channel where it has one, so that zero3.comm destroys it
        with the other groups zero3 made (at exit, or by ``release_groups``).
    """
    state = sharded_state(module)
    if state.comm.world_size == 1:
        return None
    ranks = tuple(global_ranks(state))
    world = dist.group.WORLD
    cached = _GROUPS.get(ranks)
    group = cached[1]() if cached is not None and cached[0]() is world else None
    if group is not None and _usable(group):
        return group
    group = _new_gloo_group(state, ranks)
    _GROUPS[ranks] = (weakref.ref(world), weakref.ref(group))
    return group


def _usable(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is not destroyed (torch forgets a destroyed group)."""
    try:
        dist.get_process_group_ranks(group)
    except KeyError:  # torch's map no longer has it
        return False
    return True


def _new_gloo_group(state: ShardedModelState, ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A new gloo group over ``ranks`` (collective over them)."""
    comm = state.comm
    if isinstance(comm, TorchDistBackend):
        # A gloo group zero3.comm made and destroys; the teardown keeps the channel
        # backend (which holds the group) open until then, so dropping it here is fine.
        channel = comm.host_channel()
        if isinstance(channel, TorchDistBackend) and channel.process_group is not None:
            return channel.process_group
    # A backend without a torch group (one whose world matches the default group's):
    # the group is the program's, like its default group, and goes when that does.
    group = dist.new_group(
        ranks=list(ranks),
        backend="gloo",
        timeout=datetime.timedelta(seconds=comm.timeout_s),
        use_local_synchronization=len(ranks) != dist.get_world_size(),
    )
    assert isinstance(group, dist.ProcessGroup)
    return group
