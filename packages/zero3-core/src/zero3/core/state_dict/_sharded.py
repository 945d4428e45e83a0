"""Sharded state dicts: each rank's flat slice described to torch.distributed.checkpoint.

A rank's flat range of a parameter is the union of a few boxes (at most ``2*(ndim-1)+1``),
each a plain view of its shard, so a parameter becomes a ``ShardedTensor`` in its natural
shape under the unsharded model's key and DCP saves, reshards and merges it like any
other. The ShardedTensors are built from metadata every rank computes alone (no
collective per tensor), and nothing of the type reaches the files. Why boxes and not
DTensor, and what happens if torch drops ShardedTensor: docs/checkpoints.rst, "Flat
shards as boxes".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharded_tensor.shard import Shard

from zero3.core.files._boxes import Box, flat_boxes, join_flat
from zero3.core.model._state import ShardedModelState, sharded_state, state_of
from zero3.core.model._unshard import chunks
from zero3.core.params._params import ParamStatus, ShardedParam, lookup
from zero3.core.state_dict._full import LoadResult, match_keys, state_dict_entries
from zero3.core.state_dict._groups import global_ranks

__all__ = [
    "OffloadedShard",
    "finish_module_state_dict",
    "load_module_entry",
    "load_sharded_state_dict",
    "local_flat",
    "sharded_like",
    "sharded_state_dict",
    "streamed_sharded_state_dict",
]


@functools.lru_cache(maxsize=4096)
def _rank_boxes(shape: tuple[int, ...], world: int) -> tuple[tuple[Box, ...], ...]:
    """Every rank's boxes of a parameter of ``shape`` sharded over ``world`` ranks."""
    numel = math.prod(shape)
    per_rank = -(-numel // world)
    out = []
    for rank in range(world):
        start = min(rank * per_rank, numel)
        out.append(tuple(flat_boxes(start, min(start + per_rank, numel), shape)))
    return tuple(out)


def _as_sharded_param(param: torch.Tensor | ShardedParam) -> ShardedParam:
    if isinstance(param, ShardedParam):
        return param
    sp = lookup(param)
    if sp is None:
        raise ValueError(
            f"the tensor of shape {tuple(param.shape)} is not a parameter of a sharded module"
        )
    return sp


def sharded_like(param: torch.Tensor | ShardedParam, local: torch.Tensor) -> torch.Tensor:
    """A tensor laid out like ``param``'s shard, described to DCP in ``param``'s shape.

    Args:
        param: A sharded parameter (or its :class:`ShardedParam`).
        local: This rank's elements of a tensor with ``param``'s shape, flat and
            contiguous, ``sp.local_numel`` of them (any dtype): the real part of the
            parameter's shard, of its fp32 master, or of a per-element optimizer state.

    Returns:
        A ``ShardedTensor`` whose local shards are views of ``local`` (no copy): one per
        box of this rank's flat range. In a world of one, or for an empty parameter,
        the plain tensor ``local.view(shape)`` instead (it is whole everywhere).
    """
    sp = _as_sharded_param(param)
    shape = tuple(sp.shape)
    if local.dim() != 1 or local.numel() != sp.local_numel:
        raise ValueError(
            f"sharded_like({sp.name!r}): expected this rank's {sp.local_numel} elements as a "
            f"1-D tensor, got shape {tuple(local.shape)}"
        )
    if sp.world_size == 1 or sp.numel == 0:
        return local.view(shape)
    if not local.is_contiguous():
        raise ValueError(f"sharded_like({sp.name!r}): the local elements must be contiguous")
    ranks = global_ranks(state_of(sp.param))
    device = str(local.device)
    shards_md: list[ShardMetadata] = []
    local_shards: list[Shard] = []
    for rank, boxes in enumerate(_rank_boxes(shape, sp.world_size)):
        placement = f"rank:{ranks[rank]}/{device}"
        pos = 0
        for offsets, sizes in boxes:
            md = ShardMetadata(list(offsets), list(sizes), placement)
            shards_md.append(md)
            n = math.prod(sizes)
            if rank == sp.rank:
                local_shards.append(Shard(local[pos : pos + n].view(sizes), md))
            pos += n
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False)
    metadata = ShardedTensorMetadata(shards_md, torch.Size(shape), properties)
    out: torch.Tensor = ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata
    )
    return out


def local_flat(value: Any, param: torch.Tensor | ShardedParam) -> torch.Tensor:
    """This rank's flat elements of ``value``, the inverse of :func:`sharded_like`.

    ``value`` is a ``ShardedTensor`` holding this rank's boxes of a tensor shaped like
    ``param`` (a view of one flat buffer when it came from :func:`sharded_like`, and
    then so is the result), or a whole tensor of that shape (its slice is taken).

    Raises:
        ValueError: The value has another shape, or its local shards are not this
            rank's boxes (a state dict built for another world size).
    """
    sp = _as_sharded_param(param)
    shape = tuple(sp.shape)
    start, stop = sp.valid_range(sp.rank)
    if isinstance(value, ShardedTensor):
        size = tuple(value.metadata().size)
        if size != shape:
            raise ValueError(
                f"{sp.name!r}: the sharded value has shape {size}, the parameter {shape}"
            )
        shards = value.local_shards()
        boxes = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in shards]
        if boxes != flat_boxes(start, stop, shape):
            raise ValueError(
                f"{sp.name!r}: the sharded value holds boxes {boxes} on rank {sp.rank}, not "
                "this rank's slice of the parameter (a state dict built for another world "
                "size: load it through torch.distributed.checkpoint, which reshards)"
            )
        return join_flat(s.tensor for s in shards)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{sp.name!r}: expected a tensor of shape {shape}, got {got}")
    return value.reshape(-1)[start:stop]


def sharded_state_dict(module: nn.Module) -> dict[str, Any]:
    """The model's state as objects torch.distributed.checkpoint saves and loads natively.

    Keys are those of the unsharded model's ``state_dict()`` (tied parameters under
    every name, non-persistent buffers left out). A partitioned parameter is a
    ``ShardedTensor`` in its natural shape whose local shards are views of this rank's
    shard (no copy); persistent parameters and buffers, whole on every rank, are plain
    tensors (DCP keeps one copy of a key every rank saves). Not a collective.

    Example::

        import torch.distributed.checkpoint as dcp

        dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path)
        sd = {"model": sharded_state_dict(model)}
        dcp.load(sd, checkpoint_id=path)          # any world size: DCP reshards
        load_sharded_state_dict(model, sd["model"])

    Prefer ``zero3.optim.save_checkpoint``/``load_checkpoint``: atomic, checked, and
    they carry the optimizer too.
    """
    sharded_state(module)  # a clear error for a module that is not sharded
    return _by_key(module, _entry)


def _by_key(module: nn.Module, make: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """``make(tensor)`` under each state-dict key, made once per tensor (tied
    parameters share one entry).
    """
    out: dict[str, Any] = {}
    made: dict[int, Any] = {}
    for key, _, tensor in state_dict_entries(module):
        if id(tensor) not in made:
            made[id(tensor)] = make(tensor)
        out[key] = made[id(tensor)]
    return out


class OffloadedShard:
    """A parameter shard that ``offload_param`` keeps in its swap file, as a deferred
    checkpoint entry (``zero3.core.engine.DeferredTensor``): the state dict views a
    placeholder, a save reads the values when it writes them, a load writes them to the
    file as soon as they are all in.

    Args:
        sp: The offloaded parameter.
        placeholder: ``sp.local_numel`` elements of a scratch tensor all the placeholders
            of a state dict share (never read or written: only its sizes count).
        update_masters: Whether a load also sets an optimizer's fp32 master.
    """

    def __init__(
        self, sp: ShardedParam, placeholder: torch.Tensor, update_masters: bool = True
    ) -> None:
        self.sp = sp
        self.placeholder = placeholder
        self.update_masters = update_masters
        self.group = ""  # each shard is written once whole: no group to keep together

    def read(self) -> torch.Tensor:
        """This rank's real elements, read back now (the model lets them go at once)."""
        return _local_values(self.sp)

    def target(self) -> torch.Tensor | None:
        """None: a load fills a buffer of the planner's, written to the file whole."""
        return None

    def write(self, values: torch.Tensor) -> None:
        """Set this rank's real elements (to the swap file).

        Raises:
            ValueError: The parameter is gathered right now (its whole copy would go
                stale), as :func:`~zero3.core.load_sharded_state_dict` refuses it.
        """
        if self.sp.status is ParamStatus.AVAILABLE:
            raise ValueError(
                f"load: parameter {self.sp.name!r} is gathered right now (inside "
                "zero3.core.gathered_parameters): its whole copy would go stale. Load outside "
                "the block."
            )
        with torch.no_grad():
            self.sp.write_local(values, masters=self.update_masters)


def streamed_sharded_state_dict(
    module: nn.Module, *, update_masters: bool = True
) -> tuple[dict[str, Any], dict[str, OffloadedShard]]:
    """:func:`~zero3.core.sharded_state_dict`, except that the shards parameter offload keeps out of
    memory are not read: their entries view placeholders, returned by key, that a
    checkpoint planner reads when it saves them and writes when it loads them, one at
    a time (``zero3.core.engine.CheckpointSavePlanner`` / ``CheckpointLoadPlanner``).
    Only those planners may be given such a state dict.

    Args:
        module: The sharded module.
        update_masters: Whether a load through the planner sets optimizers' masters too.
    """
    offloaded = [sp for sp in sharded_state(module).params if _offloaded(sp)]
    # One scratch tensor per dtype, as long as the longest offloaded shard: placeholders
    # of real tensors (DCP refuses ShardedTensors on meta), untouched, so no memory.
    longest: dict[torch.dtype, int] = {}
    for sp in offloaded:
        longest[sp.dtype] = max(longest.get(sp.dtype, 0), sp.local_numel)
    scratch = {dtype: torch.empty(n, dtype=dtype) for dtype, n in longest.items()}
    entries: dict[int, OffloadedShard] = {}  # by id of the parameter

    def make(tensor: torch.Tensor) -> Any:
        sp = lookup(tensor)
        if sp is None or not _offloaded(sp):
            return _entry(tensor)
        entry = OffloadedShard(sp, scratch[sp.dtype][: sp.local_numel], update_masters)
        entries[id(tensor)] = entry
        return sharded_like(sp, entry.placeholder)

    out = _by_key(module, make)
    deferred = {key: entries[id(t)] for key, _, t in state_dict_entries(module) if id(t) in entries}
    return out, deferred


def _offloaded(sp: ShardedParam) -> bool:
    """Whether ``sp``'s shard is only in its swap file now (and this rank has some)."""
    return sp.home is not None and not sp.resident and sp.local_numel > 0


def _entry(tensor: torch.Tensor) -> Any:
    sp = lookup(tensor)
    if sp is None or sp.persistent:
        return tensor.detach()
    return sharded_like(sp, _local_values(sp))


def _local_values(sp: ShardedParam) -> torch.Tensor:
    """This rank's real elements of ``sp``: a view of its shard, or of the values read
    back for the state dict alone where ``offload_param`` keeps the shard out (the model
    lets them go at once, so a state dict of an offloaded model holds the only copy).
    """
    values = sp.shard[: sp.local_numel]
    if sp.home is not None:
        sp.home.drop(sp)
    return values


def load_sharded_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    strict: bool = True,
    *,
    update_masters: bool = True,
) -> LoadResult:
    """Write a :func:`~zero3.core.sharded_state_dict` that DCP filled into the model.

    Values that DCP loaded in place (views of the shards) need no copy; others are
    copied into this rank's shard. Whole values (persistent parameters, buffers, or
    full tensors) are copied whole and their slice goes to the shard. Not a
    collective. The fp32 masters of an existing ``PartitionedOptimizer`` follow the
    loaded values, unless ``update_masters`` is False: for a caller that loads the
    optimizer's saved masters as well (``zero3.optim.load_checkpoint`` does), whose
    fp32 values must not be replaced by the rounded parameter values.

    Raises:
        ValueError: With ``strict``, missing or unexpected keys; always, a value of
            another shape or another rank's boxes, or a partitioned parameter that is
            gathered right now (inside ``gathered_parameters``: load outside it).
    """
    state = sharded_state(module)
    expected, result = match_keys(module, state_dict, strict, "load_sharded_state_dict", ValueError)
    # Whole copies that frozen_params keeps would go stale: DCP may have loaded the
    # shards in place already. Released, they are gathered afresh at the next use.
    state.coordinator.release_kept()
    with torch.no_grad():
        for key, target in expected.items():
            if key in state_dict:
                _load_entry(state, key, target, state_dict[key], update_masters)
    return result


def _load_entry(
    state: ShardedModelState, key: str, target: torch.Tensor, value: Any, masters: bool
) -> None:
    sp = lookup(target)
    if sp is None:
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"load_sharded_state_dict: {key!r} is {got} in the state dict but "
                f"{tuple(target.shape)} in the model"
            )
        if value.data_ptr() != target.data_ptr():
            target.copy_(value)
        return
    whole = sp.persistent or sp.aliases_param
    if sp.status is ParamStatus.AVAILABLE and not whole:
        raise ValueError(
            f"load_sharded_state_dict: parameter {key!r} is gathered right now (inside "
            "zero3.core.gathered_parameters): its whole copy would go stale. Load outside the "
            "block."
        )
    if whole and isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor):
        if tuple(value.shape) != tuple(sp.shape):
            raise ValueError(
                f"load_sharded_state_dict: {key!r} has shape {tuple(value.shape)} in the state "
                f"dict but {tuple(sp.shape)} in the model"
            )
        flat = value.detach().reshape(-1).to(device=sp.device, dtype=sp.dtype)
        state.write_full(sp, flat, masters=masters)
        return
    if whole:
        raise ValueError(
            f"load_sharded_state_dict: parameter {key!r} is whole on every rank (persistent), "
            "but the state dict holds a sharded value for it"
        )
    local = local_flat(value, sp)
    if local.numel():
        sp.write_local(local, masters=masters)  # shard (unless loaded in place), master


def finish_module_state_dict(
    state: ShardedModelState, destination: dict[str, Any], keys: list[str]
) -> None:
    """``module.state_dict()`` of a sharded model: turn the entries torch collected as
    variables (``keep_vars=True``) under ``keys`` into values, by the rule of
    docs/transformers.rst, "Whole-model state_dict() of a sharded model".

    A frozen partitioned parameter becomes a ``ShardedTensor`` of its natural shape
    whose local shards are views of this rank's shard (no collective, no copy: what
    :func:`~zero3.core.sharded_state_dict` gives); a trainable partitioned parameter a whole copy,
    gathered in runs of ``prefetch_bucket_size`` elements (a collective, every rank
    calls ``state_dict()``); anything else (persistent parameters, buffers) is detached
    as torch does. Pending edits are merged first (a collective).
    """
    state.synchronize()
    trainable: dict[int, tuple[ShardedParam, list[str]]] = {}
    for key in keys:
        value = destination[key]
        sp = state.owns(value) if isinstance(value, torch.Tensor) else None
        if sp is None or sp.persistent or sp.aliases_param:
            if isinstance(value, torch.Tensor):
                destination[key] = value.detach()
        elif sp.requires_grad:
            trainable.setdefault(sp.index, (sp, []))[1].append(key)
        else:
            destination[key] = sharded_like(sp, _local_values(sp))
    wanted = [sp for sp, _ in trainable.values()]
    for piece in chunks(wanted, max(1, state.window.prefetch_numel)):
        state.pin(piece)
        try:
            for sp in piece:
                whole = sp.param.detach().clone()
                for key in trainable[sp.index][1]:
                    destination[key] = whole
        finally:
            state.unpin(piece)


def load_module_entry(state: ShardedModelState, key: str, sp: ShardedParam, value: Any) -> None:
    """``module.load_state_dict()`` of a partitioned parameter: write this rank's part of
    ``value`` (a whole tensor of the parameter's shape, or a ``ShardedTensor`` holding
    this rank's boxes) into its shard and master. Not a collective.

    Raises:
        ValueError: The value has another shape, or another rank's boxes.
    """
    state.coordinator.release_kept()  # whole copies frozen_params keeps would go stale
    with torch.no_grad():
        if isinstance(value, ShardedTensor):
            sp.write_local(local_flat(value, sp).to(sp.dtype))
            return
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(sp.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"load_state_dict: {key!r} is {got} in the state dict but {tuple(sp.shape)} "
                "in the model"
            )
        flat = value.detach().reshape(-1).to(device=sp.device, dtype=sp.dtype)
        state.write_full(sp, flat)
