"""Cutting a model's parameters into this rank's shards, and where offloaded shards live.

``ShardedModelState`` builds a model through these: :func:`open_shard_home` decides where
``offload_param`` keeps the shards (a swap file, host memory, or nowhere new) before any
shard is cut, and :func:`new_sharded_param` records one parameter's partition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from zero3.comm import CommBackend, ReduceOp
from zero3.core.config._config import Zero3Config, is_persistent
from zero3.core.files._swap import SwapError
from zero3.core.model._host_shards import HostShards
from zero3.core.model._param_offload import (
    ParamSwap,
    PlannedShard,
    raise_if_any_rank_failed,
    say_once,
)
from zero3.core.params import _params
from zero3.core.params._params import ParamOffloadError, ParamStatus, ShardedParam

__all__ = ["AllReduce", "new_sharded_param", "open_shard_home"]

_log = logging.getLogger("zero3.core")

#: A small all-reduce that waits (construction's, or a step's).
AllReduce = Callable[[torch.Tensor, ReduceOp], None]


def open_shard_home(
    config: Zero3Config,
    comm: CommBackend,
    named: list[tuple[str, nn.Parameter]],
    *,
    step_all_reduce: AllReduce,
    build_all_reduce: AllReduce,
    agree_on: torch.device,
) -> ParamSwap | HostShards | None:
    """Where ``offload_param`` keeps the shards of ``named``'s non-persistent parameters:
    the swap file ``nvme`` streams them into (laid out from the parameters' sizes before
    any is cut), host memory for ``cpu`` with the model on an accelerator, or None where
    nothing moves. A swap file is agreed by every rank: one that cannot create its file
    fails them all (``build_all_reduce`` on ``agree_on``), before anything is built;
    ``step_all_reduce`` is what the swap agrees its later I/O errors with.
    """
    section = config.offload_param
    if not section.enabled:
        return None
    device = next((p.device for _, p in named if not p.is_meta), comm.device())
    world = comm.world_size
    if not section.moves_shards(device.type):
        say_once(
            "zero3: offload_param cpu: nothing moves (the shards are in host memory "
            "already on a CPU run)"
        )
        return None
    offloaded = [
        (index, param)
        for index, (_, param) in enumerate(named)
        if not is_persistent(param.numel(), world, config, offloaded=True)
    ]
    if section.device == "cpu":
        host = HostShards(section.pin_memory)  # read ahead onto the device for each gather
        host.plan(index for index, _ in offloaded)
        return host
    plan = [
        PlannedShard(index, -(-param.numel() // world), config.param_dtype or param.dtype)
        for index, param in offloaded
    ]
    swap: ParamSwap | None = None
    error: BaseException | None = None
    try:
        swap = ParamSwap(
            plan, section, config.aio, comm.rank, step_all_reduce,
            pin=section.pin_memory and device.type != "cpu",
        )  # fmt: skip
    except (SwapError, OSError) as exc:
        error = exc
    raise_if_any_rank_failed(
        build_all_reduce, comm.rank, agree_on, error,
        lambda message: ParamOffloadError(f"zero3: parameter offload failed on {message}"),
    )  # fmt: skip
    assert swap is not None
    if swap.kept_numel and comm.rank == 0:
        _log.info(
            "zero3: offload_param nvme: %s shard elements per rank stay in host memory "
            "(offload_param.max_in_cpu = %s); %s go to %s",
            f"{swap.kept_numel:,}", f"{section.max_in_cpu:,}",
            f"{sum(s.numel for s in plan) - swap.kept_numel:,}", swap.path.parent,
        )  # fmt: skip
    return swap


def new_sharded_param(
    index: int,
    name: str,
    param: nn.Parameter,
    config: Zero3Config,
    comm: CommBackend,
    shard: torch.Tensor | None = None,
    *,
    homed: bool = True,
) -> ShardedParam:
    """Record one parameter's partition (registered; its whole data freed unless it is
    persistent). ``shard``: this rank's shard, already cut (the materializer's; the
    parameter then holds no bytes). ``homed``: ``offload_param`` may give its shard a
    home (False for parameters added after sharding, which stay in memory: in a world
    of one they then stay whole).
    """
    world, rank = comm.world_size, comm.rank
    numel = param.numel()
    shard_numel = -(-numel // world)
    device = comm.device() if param.is_meta else param.device
    moves = homed and config.offload_param.moves_shards(device.type)
    persistent = is_persistent(numel, world, config, offloaded=moves)
    aliases = world == 1 and persistent
    if shard is not None:
        pass  # cut by the materializer
    elif aliases:
        # Note: a world of one has nothing to shard. The "shard" is the parameter's
        # own data and the parameter stays whole (persistent): no gathers, and the
        # optimizer steps the parameter in place, so a single process pays nothing.
        # Offloaded parameters are the exception: their "shard" is a copy that lives
        # off the device, and the parameter is fetched for its module like any shard.
        shard = param.detach().reshape(-1)
    else:
        flat = param.detach().reshape(-1)
        start = min(rank * shard_numel, numel)
        stop = min(start + shard_numel, numel)
        shard = torch.zeros(shard_numel, dtype=param.dtype, device=param.device)
        shard[: stop - start].copy_(flat[start:stop])
    sp = ShardedParam(
        index=index,
        name=name,
        param=param,
        shape=param.shape,
        numel=numel,
        shard_numel=shard_numel,
        _shard=shard,
        persistent=persistent,
        rank=rank,
        world_size=world,
        aliases_param=aliases,
    )
    _params.register(sp)
    _params.dress_sharded(param)
    if not sp.persistent:
        _params.free_full(param)
        sp.set_status(ParamStatus.NOT_AVAILABLE)
    return sp
