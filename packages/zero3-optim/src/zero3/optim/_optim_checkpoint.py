"""A PartitionedOptimizer's state by parameter name, in the parameters' natural shapes.

Note (what is saved, and how it reshards):
    The wrapped optimizer sees 1-D master shards (or, with ``flat=True``, one flat
    tensor per sub-group), so its state is per rank and per shard. For a checkpoint
    that loads at any world size each piece is put back in parameter terms:

    * ``master.<name>``: the fp32 master of a parameter whose master is a separate
      copy (bf16/fp16 parameters); an fp32 parameter's master *is* its shard, saved
      under ``model.``.
    * ``state.<name>.<key>``: a per-element state tensor (Adam's moments...), shaped
      like the parameter, as a ShardedTensor of this rank's slice (``flat=True``
      state is cut per parameter first).
    * ``scalars.<name>.<key>``: 0-d tensors and numbers (``step``...): the same on
      every rank, one copy kept.
    * ``param_groups``: each group's hyperparameters, its parameters by name.
    * ``scaler``: the fp16 loss scaler.

    Any other kind of state (a tensor of another shape, a list, an object) cannot be
    resliced for another world size, so saving it is an error naming the key. Loading
    builds the wrapped optimizer's ``state_dict()`` for this rank's shards and hands it
    to the wrapped optimizer's own ``load_state_dict`` (which casts and places tensors
    as torch always does), then writes the masters back into the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from zero3.core import CheckpointMismatchError
from zero3.core.engine import (
    CHECKPOINT_LAYOUT,
    CheckpointReader,
    DeferredTensor,
    ShardedParam,
    local_flat,
    sharded_like,
)
from zero3.optim._loss_scale import LossScaler

__all__ = [
    "EntriesOf",
    "EntryKey",
    "OptimizerParts",
    "SubGroup",
    "load_sharded_state",
    "load_template",
    "saved_entries",
    "sharded_state",
    "streamed_sharded_state",
]

_L = CHECKPOINT_LAYOUT
_PLAIN = (bool, int, float, str, type(None))


class SubGroup(Protocol):
    """What this module reads of a sub-group of fp32 master shards (the optimizer's)."""

    group: int
    params: list[ShardedParam]
    offsets: list[int]
    master: torch.Tensor | None
    views: list[torch.Tensor]
    aliased: list[bool]

    @property
    def numel(self) -> int:
        """Elements of the sub-group (padded shards)."""
        ...


@dataclasses.dataclass(frozen=True)
class OptimizerParts:
    """What a OptimizerParts's state dict is made of.

    Attributes:
        subgroups: The fp32 master shards, in sub-groups.
        flat: Whether the wrapped optimizer sees one tensor per sub-group.
        optimizer: The wrapped optimizer.
        scaler: The fp16 loss scaler.
    """

    subgroups: Sequence[SubGroup]
    flat: bool
    optimizer: torch.optim.Optimizer
    scaler: LossScaler


def _members(opt: OptimizerParts) -> list[tuple[SubGroup, int, ShardedParam]]:
    return [(sg, k, sp) for sg in opt.subgroups for k, sp in enumerate(sg.params)]


def _owner(opt: OptimizerParts, sg: SubGroup, k: int) -> torch.Tensor:
    """The tensor the wrapped optimizer keys member ``k``'s state by."""
    return sg.master if opt.flat and sg.master is not None else sg.views[k]


def _local(opt: OptimizerParts, sg: SubGroup, k: int, value: torch.Tensor) -> torch.Tensor:
    """Member ``k``'s elements of a per-element state tensor of its owner."""
    if opt.flat and sg.master is not None:
        sp = sg.params[k]
        return value[sg.offsets[k] : sg.offsets[k] + sp.local_numel]
    return value


def _kind(opt: OptimizerParts, sp: ShardedParam, owner: torch.Tensor, key: str, value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.shape == owner.shape and value.dim() == 1:
        return "element"
    if (isinstance(value, torch.Tensor) and value.dim() == 0) or isinstance(value, _PLAIN):
        return "scalar"
    what = (
        f"a tensor of shape {tuple(value.shape)}"
        if isinstance(value, torch.Tensor)
        else f"a {type(value).__name__}"
    )
    raise ValueError(
        f"PartitionedOptimizer.sharded_state_dict: {type(opt.optimizer).__name__} keeps state "
        f"{key!r} of parameter {sp.name!r} as {what}; a sharded checkpoint holds per-element "
        f"tensors (shaped like the master shard, {tuple(owner.shape)}) and scalars only, "
        "since nothing else can be resliced for another world size"
    )


def sharded_state(opt: OptimizerParts) -> dict[str, Any]:
    """See :meth:`PartitionedOptimizer.sharded_state_dict`."""
    return streamed_sharded_state(opt, lambda sg: None)[0]


#: A member's entry in a sub-group's record: ("master" or "state", member index, key).
EntryKey = tuple[str, int, str]
#: A sub-group's deferred entries by :data:`EntryKey`, or None (its state is in memory).
EntriesOf = Callable[[SubGroup], Mapping[EntryKey, DeferredTensor] | None]


def streamed_sharded_state(
    opt: OptimizerParts, entries_of: EntriesOf
) -> tuple[dict[str, Any], dict[tuple[str, ...], DeferredTensor]]:
    """:func:`sharded_state`, with the masters and per-element state of the sub-groups
    ``entries_of`` gives entries for deferred (read by the checkpoint's save planner as
    it writes them); returns the state dict and the deferred entries by key path.
    """
    masters: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    deferred: dict[tuple[str, ...], DeferredTensor] = {}
    for sg in opt.subgroups:
        by_member = _by_member(entries_of(sg))
        for k, sp in enumerate(sg.params):
            mine = by_member.get(k, {})
            _add_deferred(sp, mine, masters, state, deferred)
            if ("master", k, "") not in mine and not sg.aliased[k]:
                masters[sp.name] = sharded_like(sp, sg.views[k])  # a master in memory
            owner = _owner(opt, sg, k)
            for key, value in opt.optimizer.state.get(owner, {}).items():
                if ("state", k, key) in mine:
                    continue
                if _kind(opt, sp, owner, key, value) == "element":
                    local = _local(opt, sg, k, value)
                    state.setdefault(sp.name, {})[key] = sharded_like(sp, local)
                else:
                    plain = value.detach() if isinstance(value, torch.Tensor) else value
                    scalars.setdefault(sp.name, {})[key] = plain
    out = {
        "param_groups": _named_groups(opt),
        "master": masters,
        "state": state,
        "scalars": scalars,
        "scaler": opt.scaler.state_dict(),
    }
    return out, deferred


def _by_member(
    entries: Mapping[EntryKey, DeferredTensor] | None,
) -> dict[int, dict[EntryKey, DeferredTensor]]:
    out: dict[int, dict[EntryKey, DeferredTensor]] = {}
    for entry_key, entry in (entries or {}).items():
        out.setdefault(entry_key[1], {})[entry_key] = entry
    return out


def _add_deferred(
    sp: ShardedParam,
    entries: Mapping[EntryKey, DeferredTensor],
    masters: dict[str, Any],
    state: dict[str, dict[str, Any]],
    deferred: dict[tuple[str, ...], DeferredTensor],
) -> None:
    """One member's deferred master and state entries, in the state dict's places."""
    for (kind, _, key), entry in entries.items():
        value = sharded_like(sp, entry.placeholder)
        if kind == "master":
            masters[sp.name] = value
            deferred[("master", sp.name)] = entry
        else:
            state.setdefault(sp.name, {})[key] = value
            deferred[("state", sp.name, key)] = entry


def _group_names(opt: OptimizerParts) -> list[list[str]]:
    names: list[list[str]] = [[] for _ in opt.optimizer.param_groups]
    for sg, _, sp in _members(opt):
        names[sg.group].append(sp.name)
    return names


def _named_groups(opt: OptimizerParts) -> list[dict[str, Any]]:
    out = []
    for group, names in zip(opt.optimizer.param_groups, _group_names(opt), strict=True):
        options = {k: v for k, v in group.items() if k != "params"}
        out.append({**options, "params": names})
    return out


def _check_groups(opt: OptimizerParts, saved: Any) -> None:
    current = _group_names(opt)
    saved_names = [list(g.get("params", [])) for g in saved] if isinstance(saved, list) else None
    if saved_names != current:
        if saved_names is None or len(saved_names) != len(current):
            count = "?" if saved_names is None else len(saved_names)
            detail = f"{count} param groups saved, {len(current)} here"
        else:
            g = next(i for i, (a, b) in enumerate(zip(saved_names, current, strict=True)) if a != b)
            only_saved = sorted(set(saved_names[g]) - set(current[g]))[:5]
            only_here = sorted(set(current[g]) - set(saved_names[g]))[:5]
            detail = (
                f"group {g} differs: saved only {only_saved}, here only {only_here}"
                if only_saved or only_here
                else f"group {g} lists the same parameters in another order"
            )
        raise CheckpointMismatchError(
            f"optimizer state of another parameter layout: {detail} (build the optimizer "
            "with the same param groups as the run that saved)"
        )


def load_sharded_state(opt: OptimizerParts, sd: Mapping[str, Any]) -> None:
    """See :meth:`PartitionedOptimizer.load_sharded_state_dict`."""
    _check_groups(opt, sd.get("param_groups"))
    by_name = {sp.name: (sg, k) for sg, k, sp in _members(opt)}
    for section in ("master", "state", "scalars"):
        unknown = sorted(set(sd.get(section, {})) - set(by_name))
        if unknown:
            raise CheckpointMismatchError(
                f"optimizer state for parameters this optimizer does not step: {unknown[:5]}"
            )
    with torch.no_grad():
        _load_masters(opt, sd.get("master", {}))
    inner = opt.optimizer.state_dict()
    owners = [p for group in opt.optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(owners)}
    new_state: dict[int, dict[str, Any]] = {}
    for sg in opt.subgroups:
        flat = opt.flat and sg.master is not None
        for k in [0] if flat else range(len(sg.params)):
            entry = _owner_state(opt, sg, k, sd)
            if entry:
                new_state[index[id(_owner(opt, sg, k))]] = entry
    groups = [
        {**{key: v for key, v in saved.items() if key != "params"}, "params": mine["params"]}
        for saved, mine in zip(sd["param_groups"], inner["param_groups"], strict=True)
    ]
    opt.optimizer.load_state_dict({"state": new_state, "param_groups": groups})
    if "scaler" in sd:
        opt.scaler.load_state_dict(dict(sd["scaler"]))


def _load_masters(opt: OptimizerParts, masters: Mapping[str, Any]) -> None:
    """Masters from the checkpoint; where it has none, from the (loaded) model shards."""
    for sg, k, sp in _members(opt):
        view = sg.views[k]
        if sp.name in masters:
            local = local_flat(masters[sp.name], sp)
            if local.numel() and local.data_ptr() != view.data_ptr():
                view.copy_(local)
        elif not sg.aliased[k] and view.numel():
            view.copy_(sp.shard[: sp.local_numel])


def _owner_state(
    opt: OptimizerParts, sg: SubGroup, k: int, sd: Mapping[str, Any]
) -> dict[str, Any]:
    """The wrapped optimizer's state for one owner tensor, from the named state."""
    state, scalars = sd.get("state", {}), sd.get("scalars", {})
    if not (opt.flat and sg.master is not None):
        sp = sg.params[k]
        entry = {key: local_flat(v, sp) for key, v in state.get(sp.name, {}).items()}
        entry.update(scalars.get(sp.name, {}))
        return entry
    # flat: one tensor per sub-group; members' slices laid out at their offsets.
    entry = {}
    keys = {key for sp in sg.params for key in state.get(sp.name, {})}
    for key in sorted(keys):
        parts = [
            (i, state[sp.name][key])
            for i, sp in enumerate(sg.params)
            if key in state.get(sp.name, {})
        ]
        locals_ = {i: local_flat(v, sg.params[i]) for i, v in parts}
        dtype = next(iter(locals_.values())).dtype
        flat = _flat_buffer(sg, locals_, dtype)
        entry[key] = flat
    for sp in sg.params:
        for key, value in scalars.get(sp.name, {}).items():
            entry.setdefault(key, value)  # members share one scalar (e.g. step)
    return entry


def _flat_buffer(
    sg: SubGroup, locals_: dict[int, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The sub-group's flat tensor holding the members' slices; reuses the buffer the
    slices already live in (the load template's) instead of copying.
    """
    assert sg.master is not None
    numel = sg.master.numel()
    first_i, first = next(iter(locals_.items()))
    if first.numel():
        base = first.untyped_storage()
        start = first.storage_offset() - sg.offsets[first_i]
        if start >= 0 and base.nbytes() >= (start + numel) * first.element_size():
            candidate = torch.empty(0, dtype=dtype, device=first.device).set_(
                base, start, (numel,), (1,)
            )
            if all(
                v.numel() == 0 or v.data_ptr() == candidate[sg.offsets[i] :].data_ptr()
                for i, v in locals_.items()
            ):
                return candidate
    flat = torch.zeros(numel, dtype=dtype, device=sg.master.device)
    for i, v in locals_.items():
        flat[sg.offsets[i] : sg.offsets[i] + v.numel()].copy_(v)
    return flat


def saved_entries(
    opt: OptimizerParts, reader: CheckpointReader
) -> dict[int, dict[EntryKey, torch.dtype]]:
    """The checkpoint's masters and per-element state for each sub-group's members that
    hold elements on this rank, by ``id`` of the sub-group: {entry: saved dtype}.

    Raises:
        CheckpointMismatchError: The checkpoint names parameters this optimizer does not
            step (checked before anything changes).
    """
    _check_stray(opt, reader)
    masters = set(reader.section_keys(_L.optim, "master"))
    states = set(reader.section_keys(_L.optim, "state"))
    out: dict[int, dict[EntryKey, torch.dtype]] = {}
    for sg, k, sp in _members(opt):
        entries = out.setdefault(id(sg), {})
        if not sp.local_numel:
            continue  # nothing of it here: DCP reads nothing for it
        if sp.name in masters:
            entries[("master", k, "")] = reader.entry_dtype(_L.fqn(_L.optim, "master", sp.name))
        if sp.name in states:
            for key in reader.section_keys(_L.optim, "state", sp.name):
                fqn = _L.fqn(_L.optim, "state", sp.name, key)
                entries[("state", k, key)] = reader.entry_dtype(fqn)
    return out


def _check_stray(opt: OptimizerParts, reader: CheckpointReader) -> None:
    names = {sp.name for _, _, sp in _members(opt)}
    stray = [
        name
        for part in ("master", "state", "scalars")
        for name in reader.section_keys(_L.optim, part)
        if name not in names
    ]
    if stray:
        raise CheckpointMismatchError(
            f"checkpoint {reader.path} holds optimizer state for parameters this optimizer "
            f"does not step: {sorted(stray)[:5]}"
        )


def load_template(
    opt: OptimizerParts,
    reader: CheckpointReader,
    entries_of: EntriesOf = lambda sg: None,
) -> tuple[dict[str, Any], dict[tuple[str, ...], DeferredTensor]]:
    """Destinations for ``dcp.load`` of a checkpoint's optimizer section, and the
    deferred entries among them by key path.

    Masters and per-element state of this rank land in place (the masters, the
    existing state tensors) or in new buffers (a fresh optimizer has no state yet);
    plain values get placeholders DCP fills. The entries ``entries_of`` gives for a
    sub-group are deferred instead (a streamed load fills its offloaded records).
    """
    _check_stray(opt, reader)
    masters: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    deferred: dict[tuple[str, ...], DeferredTensor] = {}
    for sg in opt.subgroups:
        by_member = _by_member(entries_of(sg))
        for k, sp in enumerate(sg.params):
            _add_deferred(sp, by_member.get(k, {}), masters, state, deferred)
    by_name = {sp.name: (sg, k) for sg, k, sp in _members(opt)}
    for name in reader.section_keys(_L.optim, "master"):
        sg, k = by_name[name]
        if ("master", name) not in deferred:
            masters[name] = sharded_like(sg.params[k], sg.views[k])
    fresh: dict[tuple[int, str], torch.Tensor] = {}
    for name in reader.section_keys(_L.optim, "state"):
        sg, k = by_name[name]
        for key in reader.section_keys(_L.optim, "state", name):
            if ("state", name, key) in deferred:
                continue
            dtype = reader.entry_dtype(_L.fqn(_L.optim, "state", name, key))
            local = _state_buffer(opt, sg, k, key, dtype, fresh)
            state.setdefault(name, {})[key] = sharded_like(sg.params[k], local)
    template = {
        "param_groups": reader.template(_L.optim, "param_groups"),
        "master": masters,
        "state": state,
        "scalars": reader.template(_L.optim, "scalars"),
        "scaler": reader.template(_L.optim, "scaler"),
    }
    return template, deferred


def _state_buffer(
    opt: OptimizerParts,
    sg: SubGroup,
    k: int,
    key: str,
    dtype: torch.dtype,
    fresh: dict[tuple[int, str], torch.Tensor],
) -> torch.Tensor:
    """Where a member's slice of a per-element state loads: in place if the optimizer
    has that state already, else a new buffer (one per sub-group with ``flat=True``).
    """
    owner = _owner(opt, sg, k)
    existing = opt.optimizer.state.get(owner, {}).get(key)
    usable = isinstance(existing, torch.Tensor) and existing.shape == owner.shape
    if not usable or existing.dtype != dtype:
        existing = None
    if existing is None:
        if opt.flat and sg.master is not None:
            existing = fresh.get((id(sg), key))
            if existing is None:
                existing = torch.zeros(owner.numel(), dtype=dtype, device=owner.device)
                fresh[(id(sg), key)] = existing
        else:
            existing = torch.empty(owner.numel(), dtype=dtype, device=owner.device)
    return _local(opt, sg, k, existing)
