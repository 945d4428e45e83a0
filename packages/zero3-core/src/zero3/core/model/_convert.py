"""``module.to(device, dtype)`` on a sharded model: what may be cast, and the cast.

Note (why a device is only checked):
    A sharded parameter lives where its comm backend gathers and reduces it
    (``shard_module`` refuses any other device), so the one device a sharded model can
    be "moved" to is the one it is on; any other is an error naming both, not a silent
    copy the backend could not use.

Note (no cast once an optimizer exists):
    A ``PartitionedOptimizer`` keeps an fp32 master of every parameter it steps (for an
    fp32 parameter, the shard itself) and writes its results back in the parameter's
    dtype, so that dtype is part of the optimizer's layout. Casting after building one
    is refused: cast first (or set ``Zero3Config.param_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zero3.comm import CommBackend
from zero3.core.model._sync import whole
from zero3.core.params import _params
from zero3.core.params._params import ParamStatus, ShardedParam

__all__ = ["cast_param", "check_device", "refuse_cast"]


def check_device(
    module: nn.Module, comm: CommBackend, params: Sequence[ShardedParam], device: torch.device
) -> None:
    """Raise unless ``device`` is where ``comm`` moves the shards of ``params``."""
    here = params[0].device if params else comm.device()
    # Every CPU index names the same memory ("cpu:0" is what some launchers give).
    if device.type == here.type and (device.type == "cpu" or device.index in (None, here.index)):
        return
    raise ValueError(
        f"zero3: cannot move the sharded {type(module).__name__} to {device}: its "
        f"{comm.name!r} comm backend gathers and reduces {comm.device_type} "
        f"tensors and the shards live on {here}. Move the model before shard_module, "
        "with a backend for that device (Zero3Config.backend)"
    )


def refuse_cast(
    module: nn.Module,
    dtype: torch.dtype,
    changing: Sequence[ShardedParam],
    *,
    stepped: Sequence[str],
    busy: bool,
    swapped: bool,
) -> None:
    """Raise if ``changing`` may not be cast to ``dtype`` now: an optimizer steps some
    (``stepped``, their names), a step or window is open (``busy``) or a
    ``gathered_parameters`` block holds some, or the shards are in a swap file.
    """
    name = type(module).__name__
    if stepped:
        raise ValueError(
            f"zero3: cannot cast {name} to {dtype}: a PartitionedOptimizer already keeps "
            f"fp32 masters of {list(stepped[:3])} (and {max(0, len(stepped) - 3)} more) in "
            f"their current dtype ({changing[0].dtype}). Cast the model (model.to({dtype})) "
            "or set Zero3Config.param_dtype before building the optimizer"
        )
    pinned = [sp.name for sp in changing if sp.pinned]
    if busy or pinned:
        where = (
            f"inside a gathered_parameters block holding {pinned[:3]}"
            if pinned
            else "in the middle of a step or a gradient accumulation window"
        )
        raise ValueError(
            f"zero3: cannot cast {name} to {dtype} {where}; "
            "cast between steps, after the optimizer step (or zero_grad)"
        )
    if swapped:
        raise ValueError(
            f"zero3: cannot cast {name} to {dtype}: its parameter shards are offloaded "
            "(offload_param), laid out in their swap file by dtype; cast before "
            "shard_module (or set Zero3Config.param_dtype)"
        )


def cast_param(sp: ShardedParam, dtype: torch.dtype) -> None:
    """Cast one parameter's shard and, where it has them, its whole data."""
    param = sp.param
    if sp.aliases_param:  # a world of one: the shard is the parameter's own data
        param.data = param.data.to(dtype)
        sp.shard = param.detach().reshape(-1)
    elif whole(sp):
        sp.shard = _cast_shard(sp.shard, dtype)
        param.data = param.data.to(dtype)
    else:
        sp.shard = _cast_shard(sp.shard, dtype)
        # The released parameter keeps its shape with no bytes: give it an empty
        # storage of the new dtype (allocated, then freed, one parameter at a time).
        sp.set_status(ParamStatus.AVAILABLE)  # its own class again, so .data may be set
        param.data = torch.empty(sp.shape, dtype=dtype, device=param.device)
        _params.free_full(param)
        sp.set_status(ParamStatus.NOT_AVAILABLE)
    sp.version = param._version


def _cast_shard(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``shard`` in ``dtype``; page-locked again if it was (a shard ``offload_param: cpu``
    keeps in host memory, whose copies to the device are asynchronous only so).
    """
    cast = shard.to(dtype)
    return cast.pin_memory() if shard.is_pinned() else cast
