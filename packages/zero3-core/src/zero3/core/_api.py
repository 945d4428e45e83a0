"""Public helpers around partitioned parameters and gradients."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from zero3.core.diag._memory import MemoryStats, peak_rss_bytes, storage_bytes, storages
from zero3.core.model._state import ShardedModelState, add_pending_external, sharded_state, state_of
from zero3.core.params import _params
from zero3.core.params._params import ShardedParam

__all__ = [
    "full_grad",
    "gathered_parameters",
    "local_grad",
    "memory_stats",
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
        state.pin(sps)
    try:
        yield
        if modifier_rank is not None:
            for state, sps in groups:
                _broadcast_edits(state, sps, modifier_rank)
    finally:
        for state, sps in groups:
            state.unpin(sps)


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
    state.add_external(module, sp)


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


def _on_device(sps: Sequence[ShardedParam]) -> bool:
    """Whether the model is on an accelerator (its parameters' device)."""
    return any(sp.device.type != "cpu" for sp in sps)


@dataclasses.dataclass(frozen=True)
class _OptimizerHeld:
    """Bytes this rank's optimizers hold (memory_stats): masters and state, in the
    device's memory, in host memory (offloaded beside an accelerator) and in swap files,
    and how many elements they step.
    """

    master: int
    optimizer: int
    host_master: int
    host_optimizer: int
    nvme_master: int
    nvme_optimizer: int
    stepped: int

    @classmethod
    def count(
        cls,
        optimizers: Sequence[torch.optim.Optimizer],
        shards: list[torch.Tensor],
        on_device: bool,
    ) -> _OptimizerHeld:
        """Count ``optimizers``; masters that share a storage with ``shards`` are the
        parameters themselves (fp32 without offload) and count nowhere here.
        """
        masters = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        values = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        # With the shards on an accelerator, offloaded masters and state are in host
        # memory (torch keeps scalar state such as Adam's ``step`` on the host anyway:
        # not counted).

        def where(ts: list[torch.Tensor], host: bool) -> list[torch.Tensor]:
            return [t for t in ts if (on_device and t.device.type == "cpu" and t.dim() > 0) == host]

        # What optimizer offload holds in swap files (its store says; in memory it is empty).
        nvme_master = nvme_state = numel_out = 0
        for opt in optimizers:
            store = getattr(opt, "offload", None)
            if store is not None and store.nvme:
                master_out, state_out, numel = store.offloaded_split()
                nvme_master, nvme_state = nvme_master + master_out, nvme_state + state_out
                numel_out += numel
        return cls(
            master=storage_bytes(where(masters, False), skip=storages(shards)),
            optimizer=storage_bytes(where(tensors, False)),
            host_master=storage_bytes(where(masters, True)),
            host_optimizer=storage_bytes(where(tensors, True)),
            nvme_master=nvme_master,
            nvme_optimizer=nvme_state,
            stepped=sum(p.numel() for p in masters) + numel_out,
        )


def _unsharded_bytes(state: ShardedModelState, held: _OptimizerHeld, numel: int, el: int) -> int:
    """The same model state in one unsharded process: ``numel`` parameter elements of
    ``el`` bytes, gradients, separate fp32 masters where the optimizers keep them, and
    optimizer state per element as the optimizers hold it.
    """
    sps = state.params
    trainable = sum(sp.numel for sp in sps if sp.requires_grad)
    reduce_dtype = state.config.reduce_dtype
    grad_el = torch.empty((), dtype=reduce_dtype).element_size() if reduce_dtype else el
    unsharded = numel * el + trainable * grad_el
    # A separate fp32 master is part of the one-process state only for other dtypes
    # (parameter offload keeps an fp32 parameter's master apart from its shard too).
    if (held.master or held.nvme_master or held.host_master) and any(
        sp.requires_grad and sp.dtype != torch.float32 for sp in sps
    ):
        unsharded += trainable * 4
    if held.stepped:
        state_bytes = held.optimizer + held.nvme_optimizer + held.host_optimizer
        unsharded += int(trainable * state_bytes / held.stepped)
    return unsharded


def memory_stats(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryStats:
    """What this rank holds of a sharded model's state (and of its optimizer's).

    Args:
        module: A module returned by ``zero3.hooks.shard_module``.
        optimizer: An optimizer over its shards whose masters and state to count;
            default: every ``zero3.optim.PartitionedOptimizer`` stepping the model
            (none before one is built).
    """
    state = sharded_state(module)
    sps = state.params
    shards = [sp.held_shard for sp in sps] + [sp.param for sp in sps if sp.persistent]
    # offload_param cpu on an accelerator: shards in host memory, counted apart.
    on_device = _on_device(sps)
    param_bytes = storage_bytes(t for t in shards if not on_device or t.device.type != "cpu")
    host_param_bytes = storage_bytes(t for t in shards if on_device and t.device.type == "cpu")
    grad_bytes = storage_bytes(state.reducer.grad_buffers())
    optimizers = [optimizer] if optimizer is not None else state.optimizers()
    held = _OptimizerHeld.count(optimizers, shards, on_device)
    psi = sum(sp.numel for sp in sps)
    el = max((sp.param.element_size() for sp in sps), default=4)
    unsharded = _unsharded_bytes(state, held, psi, el)
    gathered = sum(
        sp.numel * sp.param.element_size()
        for sp in sps
        if not sp.persistent and sp.param.untyped_storage().nbytes()
    )
    return MemoryStats(
        world_size=state.comm.world_size,
        numel=psi,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        master_bytes=held.master,
        optimizer_bytes=held.optimizer,
        unsharded_bytes=unsharded,
        gathered_bytes=gathered,
        peak_gathered_bytes=state.stats.peak_live_numel * el,
        pool_bytes=state.pool.cached_bytes,
        peak_rss_bytes=peak_rss_bytes(),
        window=state.window,
        peak_pool_bytes=state.pool.peak_cached_bytes,
        peak_gather_buffer_bytes=state.pool.peak_kind_bytes.get("gather", 0),
        peak_bucket_bytes=state.pool.peak_kind_bytes.get("bucket", 0),
        peak_full_grad_bytes=state.reducer.peak_grad_bytes,
        peak_engine_bytes=state.pool.peak_bytes,
        nvme_master_bytes=held.nvme_master,
        nvme_optimizer_bytes=held.nvme_optimizer,
        nvme_param_bytes=state.param_swap.offloaded_bytes() if state.param_swap else 0,
        peak_grad_shard_bytes=state.reducer.peak_shard_bytes,
        host_param_bytes=host_param_bytes,
        host_master_bytes=held.host_master,
        host_optimizer_bytes=held.host_optimizer,
    )
