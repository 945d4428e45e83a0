"""PartitionedOptimizer: fp32 master shards stepped by any torch-style optimizer.

Note (what the wrapped optimizer sees):
    Each rank owns a 1/N slice of every parameter. Its fp32 master copy lives in flat
    buffers, one per user param group, cut into ``sub_group_size``-element sub-groups
    (a parameter's shard never straddles two). By default the wrapped optimizer gets
    one 1-D tensor per parameter: a view of that parameter's master shard (this rank's
    real elements, no padding; possibly empty on ranks past a tiny parameter's end).
    Per-parameter semantics therefore hold: a parameter that no rank produced a
    gradient for has ``grad None`` and is skipped, exactly as in plain PyTorch, and
    per-group options (``weight_decay``, ``lr``...) apply per parameter. Shape-aware
    optimizers (Shampoo, Muon, Adafactor's factored moments) see 1-D shards, not the
    parameters' shapes. With ``flat=True`` it gets one tensor per sub-group instead
    (DeepSpeed's way: fewer, larger tensors), whose gradient is zero for gradless
    parameters, so weight decay then touches them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zero3.comm import ReduceOp
from zero3.core.engine import (
    CheckpointReader,
    ShardedModelState,
    ShardedParam,
    sharded_param,
    sharded_state,
)
from zero3.optim import _optim_checkpoint, _records
from zero3.optim._host_step import HostStepper
from zero3.optim._loss_scale import LossScaler
from zero3.optim._offload import OffloadStats, OffloadStore, offloaded_count

__all__ = ["PartitionedOptimizer", "SubGroup"]

OptimizerSpec = (
    type[torch.optim.Optimizer] | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
)


@dataclasses.dataclass(eq=False)
class SubGroup:
    """A chunk of one param group's fp32 master buffer."""

    group: int
    params: list[ShardedParam]
    offsets: list[int]
    master: torch.Tensor | None  # flat fp32 padded shards back to back (None: see views)
    views: list[torch.Tensor]  # each member's real fp32 elements the optimizer steps
    aliased: list[bool]  # the member's shard *is* its master (fp32 parameters)

    @property
    def numel(self) -> int:
        """Elements of the sub-group (padded shards)."""
        return sum(sp.shard_numel for sp in self.params)

    def tensors(self) -> list[torch.Tensor]:
        """Everything that may carry a ``.grad`` for the wrapped optimizer."""
        return [*([self.master] if self.master is not None else []), *self.views]


def _on_host(sg: SubGroup) -> bool:
    """Whether a sub-group's masters are host copies of shards on an accelerator."""
    return sg.master is not None and sg.master.device.type != sg.params[0].device.type


def _normalize_groups(module: nn.Module, params: Iterable[Any] | None) -> list[dict[str, Any]]:
    if params is None:
        params = [p for p in module.parameters() if p.requires_grad]
    items = list(params)
    if not items:
        raise ValueError("PartitionedOptimizer got an empty parameter list")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    seen: set[int] = set()
    for g in groups:
        if "params" not in g:
            raise ValueError("each param group must be a dict with a 'params' entry")
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for p in g["params"]:
            if id(p) in seen:
                raise ValueError(
                    "a parameter appears in more than one param group "
                    f"(shape {tuple(p.shape)}); torch.optim refuses that too"
                )
            seen.add(id(p))
    return groups


def _foreign_param_message(
    module: nn.Module, zstate: ShardedModelState, param: torch.Tensor, group: int
) -> str:
    """Why ``param`` cannot be stepped, naming it and the fix."""
    name = next((n for n, p in module.named_parameters() if p is param), None)
    what = f"{name!r} (shape {tuple(param.shape)})" if name else f"of shape {tuple(param.shape)}"
    if name is not None and zstate.module is not module:
        # A wrapper (a PeftModel) holding parameters beside the sharded model: peft's
        # prompt and prefix tuning keep their prompt encoder on the PeftModel itself, so
        # its gradients would never be reduced and the ranks would drift apart.
        return (
            f"PartitionedOptimizer: the parameter {what} in group {group} lies outside the "
            f"sharded model ({type(zstate.module).__name__}) that {type(module).__name__} "
            "wraps, so zero3 cannot reduce its gradients; build the wrapper first and "
            "shard it whole (zero3.hooks.shard_module(peft.get_peft_model(model, config))), "
            "or add such parameters inside the sharded model"
        )
    return (
        f"PartitionedOptimizer: the parameter {what} in group {group} is not a parameter "
        "of this sharded module; pass the module zero3.hooks.shard_module returned and its "
        "own parameters"
    )


@dataclasses.dataclass
class StreamedLoad:
    """A checkpoint's optimizer section on its way in
    (:meth:`~zero3.optim.PartitionedOptimizer.streamed_load`).

    Attributes:
        template: The destinations to give ``dcp.load`` (with the deferred entries).
        deferred: The deferred entries by key path within the optimizer section, for
            ``zero3.core.engine.CheckpointLoadPlanner``.
    """

    template: dict[str, Any]
    deferred: dict[tuple[str, ...], Any]
    _optimizer: PartitionedOptimizer
    _records: Mapping[int, Any]

    def finish(self) -> None:
        """After ``dcp.load`` (and the model's load): load what is in memory."""
        loaded = {
            section: {k: v for k, v in values.items() if (section, k) not in self.deferred}
            if section == "master"
            else values
            for section, values in self.template.items()
        }
        if "state" in loaded:
            loaded["state"] = {
                name: {k: v for k, v in keys.items() if ("state", name, k) not in self.deferred}
                for name, keys in loaded["state"].items()
            }
        self._optimizer._load_streamed(loaded, self._records)


class PartitionedOptimizer(torch.optim.Optimizer):
    """Wraps any torch-style optimizer to step this rank's fp32 master shards.

    Args:
        module: A module returned by ``zero3.hooks.shard_module``.
        optimizer: A ``torch.optim.Optimizer`` subclass (torch's or a third party's
            following its protocol), or a factory ``param_groups -> optimizer``.
        params: The module's parameters or param groups, exactly as for torch
            (``[{"params": [...], "weight_decay": 0.0}, ...]``); default: every
            trainable parameter. Per-group options are honoured.
        flat: Hand the wrapped optimizer one tensor per sub-group instead of one per
            parameter shard (see the module note for what changes).
        **defaults: Keyword arguments for the optimizer class (``lr=3e-4``...).

    The instance *is* a ``torch.optim.Optimizer``: its ``param_groups`` and ``state``
    are the wrapped optimizer's, so LR schedulers and trainers work and writing
    ``param_groups[i]["lr"]`` takes effect. Its parameters are master shards, not the
    model's parameters.

    Attributes:
        module: The sharded module whose parameters this optimizer steps.
        optimizer: The wrapped optimizer, built over the master shards.
        flat: Whether the wrapped optimizer gets one tensor per sub-group.
        scaler: The fp16 :class:`~zero3.optim.LossScaler` (unused without fp16 parameters).
        fp16: Whether any optimized parameter is fp16 (loss scaling is active).
        last_grad_norm: The global gradient norm measured by the last clipping, or None.

    Note:
        A sharded model's gradients live in per-rank shards, not in ``param.grad``:
        reading ``param.grad`` after a backward raises (it would be None where plain
        PyTorch holds a gradient, so ``torch.nn.utils.clip_grad_norm_(model.parameters())``
        would clip nothing and return 0). Clip with :meth:`clip_grad_norm_`, or
        ``Zero3Config.gradient_clipping``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerSpec,
        params: Iterable[Any] | None = None,
        *,
        flat: bool = False,
        **defaults: Any,
    ) -> None:
        self._constructed = False
        self._zstate: ShardedModelState = sharded_state(module)
        # Modules and parameters added since sharding (adapters) are adopted first, so
        # the parameters given here (default: module's trainable ones) are all sharded.
        self._zstate.adopt()
        self.module = module
        self.flat = flat
        config = self._zstate.config
        groups = _normalize_groups(module, params)
        self._subgroups = self._build_masters(groups, config.sub_group_size)
        inner_groups = []
        for g_index, g in enumerate(groups):
            options = {k: v for k, v in g.items() if k != "params"}
            tensors: list[torch.Tensor] = []
            for sg in self._subgroups:
                if sg.group == g_index:
                    tensors.extend([sg.master] if flat and sg.master is not None else sg.views)
            inner_groups.append({"params": tensors, **options})
        if isinstance(optimizer, type):
            self.optimizer = optimizer(inner_groups, **defaults)
        else:
            if defaults:
                raise TypeError(
                    "PartitionedOptimizer: keyword defaults go to an optimizer *class*; a "
                    f"factory must set them itself (got {sorted(defaults)})"
                )
            self.optimizer = optimizer(inner_groups)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "PartitionedOptimizer: the optimizer must follow torch.optim.Optimizer's "
                f"protocol (be an instance of it), got {type(self.optimizer).__name__}"
            )
        super().__init__([{"params": [torch.zeros(0)]}], dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults
        self.scaler = LossScaler.from_config(
            config.loss_scale,
            config.initial_scale_power,
            config.loss_scale_window,
            config.hysteresis,
            config.min_loss_scale,
        )
        self.fp16 = any(sp.dtype == torch.float16 for sg in self._subgroups for sp in sg.params)
        self._grads_unscaled = False
        self._fp32_scratch: dict[torch.device, torch.Tensor] = {}
        self.last_grad_norm: float | None = None
        self._offload: OffloadStore | None = None
        self._host: HostStepper | None = None
        if config.offload_optimizer.enabled:
            self._offload = OffloadStore(self._zstate, self.optimizer, self._subgroups, flat)
            if self._offload.host_stepped:
                self._host = HostStepper(
                    self._subgroups[0].params[0].device,
                    config.offload_optimizer.pin_memory,
                    self._zstate.grad_shard,
                )
        self._constructed = True

    # -- masters ----------------------------------------------------------------------------

    def _build_masters(self, groups: list[dict[str, Any]], sub_group_size: int) -> list[SubGroup]:
        chunks: list[tuple[int, list[ShardedParam]]] = []
        for g_index, g in enumerate(groups):
            members: list[ShardedParam] = []
            for p in g["params"]:
                sp = self._zstate.owns(p)
                if sp is None:
                    raise ValueError(_foreign_param_message(self.module, self._zstate, p, g_index))
                members.append(sp)
            self._zstate.claim(members, self)
            chunk: list[ShardedParam] = []
            size = 0
            for sp in [*members, None]:
                if sp is None or (chunk and size + sp.local_numel > sub_group_size):
                    if chunk:
                        chunks.append((g_index, chunk))
                    chunk, size = [], 0
                if sp is not None:
                    chunk.append(sp)
                    size += sp.local_numel
        # Offloaded sub-groups of shards on an accelerator keep their masters on the host.
        config = self._zstate.config.offload_optimizer
        on_device = bool(chunks) and chunks[0][1][0].device.type != "cpu"
        host = offloaded_count(config, len(chunks)) if on_device else 0
        return [
            self._subgroup(group, chunk, host=i < host) for i, (group, chunk) in enumerate(chunks)
        ]

    def _subgroup(self, group: int, members: list[ShardedParam], *, host: bool) -> SubGroup:
        offsets, cursor = [], 0
        for sp in members:
            offsets.append(cursor)
            cursor += sp.shard_numel
        if host:
            master, views = self._zstate.make_masters(members, device=torch.device("cpu"))
            return SubGroup(group, members, offsets, master, views, [False] * len(members))
        if not self.flat and all(sp.dtype == torch.float32 and not sp.offloaded for sp in members):
            # fp32 parameters, one tensor each: the shard is the master. No extra copy of
            # the fp32 state, nothing to write back (and in a world of one the shard is
            # the parameter itself, so the step updates it in place).
            views = [sp.shard[: sp.local_numel] for sp in members]
            return SubGroup(group, members, offsets, None, views, [True] * len(members))
        # The model state lays the masters out; an fp32 parameter's shard moves into its
        # region (flat mode needs the sub-group contiguous), so it is its own master.
        master, views = self._zstate.make_masters(members)
        aliased = [sp.master is None for sp in members]
        return SubGroup(group, members, offsets, master, views, aliased)

    def master_shards(self) -> list[torch.Tensor]:
        """Every optimized parameter's fp32 master shard (this rank's real elements), in
        parameter-group order: the tensors the wrapped optimizer steps (unless ``flat``).
        Offloaded masters are read back first (they stay in memory until the next step).
        """
        self._bring_in()
        return [view for sg in self._subgroups for view in sg.views]

    def master_shard(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master shard (this rank's real elements) of a model parameter
        (offloaded masters are read back first).
        """
        self._bring_in()
        sp = sharded_param(param)
        for sg in self._subgroups:
            for member, view in zip(sg.params, sg.views, strict=True):
                if member is sp:
                    return view
        raise ValueError("this parameter is not optimized by this PartitionedOptimizer")

    # -- gradients --------------------------------------------------------------------------

    def _grad_shards(self) -> list[tuple[SubGroup, int, torch.Tensor]]:
        """(sub-group, member position, this rank's real gradient elements) with a grad."""
        out = []
        for sg in self._subgroups:
            for k, sp in enumerate(sg.params):
                shard = self._zstate.grad_shard(sp)
                if shard is not None:
                    out.append((sg, k, shard[: sp.local_numel]))
        return out

    def _all_reduce_scalar(self, local: torch.Tensor, op: ReduceOp) -> float:
        """Reduce a one-element tensor over ranks; the one host sync of its caller."""
        value = local.reshape(1).to(device=self._zstate.grad_comm.device(), dtype=torch.float32)
        self._zstate.all_reduce(value, op)
        return float(value.item())

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=self._zstate.grad_comm.device())

    def _unscale(self) -> None:
        if self.fp16 and not self._grads_unscaled:
            inv = 1.0 / self.scaler.scale
            for _, _, grad in self._grad_shards():
                grad.mul_(inv)
            self._grads_unscaled = True

    def _global_norm(self) -> float:
        # Norms stay on the device until the one all-reduce: no host sync per parameter.
        grads = [grad for _, _, grad in self._grad_shards()]
        local = self._zero()
        if grads:
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
            local = torch.stack(norms).to(local.device).pow(2).sum()
        return math.sqrt(self._all_reduce_scalar(local, ReduceOp.SUM))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip gradients by their global norm over all ranks, like
        ``torch.nn.utils.clip_grad_norm_``; returns the norm before clipping.

        A collective (every rank calls it). In fp16 it first unscales the gradients
        (as ``torch.amp.GradScaler.unscale_`` would), so ``max_norm`` is in real units.
        """
        self._unscale()
        norm = self._global_norm()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for _, _, grad in self._grad_shards():
                grad.mul_(coef)
        self.last_grad_norm = norm
        return torch.tensor(norm)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (fp16): call ``.backward()`` on the result.

        bf16 and fp32 need no scaling; the loss comes back unchanged there.
        """
        return loss * self.scaler.scale if self.fp16 else loss

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.fp16 else 1.0

    def _overflow(self) -> bool:
        # One flag per rank, computed on the device: no host sync per parameter.
        grads = [grad for _, _, grad in self._grad_shards()]
        local = self._zero()
        if grads:
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            local = (~finite).to(local.device, torch.float32)
        return self._all_reduce_scalar(local, ReduceOp.MAX) > 0

    # -- step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the master shards and write the results back into the model.

        Gradient shards become fp32 (the only conversion to fp32), fp16 overflow is
        checked on every rank (an overflow anywhere skips the step everywhere),
        ``Zero3Config.gradient_clipping`` clips by the global norm, the wrapped
        optimizer steps, and the updated shards go back into the parameters in their
        dtype; persistent parameters are refreshed in one coalesced gather. Ends the
        gradient accumulation window.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tracer = self._zstate.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        if self._offload is not None:
            self._offload.stats = OffloadStats()  # this step's (none if it is skipped)
        self._zstate.trim_host_heap()
        try:
            # Edits made to whole parameters since the last step reach the masters first.
            self._zstate.synchronize()
            if self.fp16 and self._overflow():
                self.scaler.update(overflow=True)
                return loss
            self._unscale()
            clip = self._zstate.config.gradient_clipping
            if clip is not None:
                self.clip_grad_norm_(clip)
            self._step_all()
            self._write_back()
            if self.fp16:
                self.scaler.update(overflow=False)
        finally:
            self._end_window()
            if tracer is not None:
                tracer.complete("optimizer.step", "optimizer", start, tracer.now_us())
        return loss

    def _step_all(self) -> None:
        """Give the master shards their fp32 gradients and step, in batches.

        Sub-groups are batched while their elements fit in ``sub_group_size``, so with
        the default the wrapped optimizer steps once; a smaller ``sub_group_size`` bounds
        the fp32 gradient memory of one batch and the optimizer steps once per batch
        (the other batches' tensors have grad None then, so it skips them).
        """
        limit = self._zstate.config.sub_group_size
        batches: list[list[SubGroup]] = []
        size = 0
        for sg in self._subgroups:
            if not batches or size + sg.numel > limit:
                batches.append([])
                size = 0
            batches[-1].append(sg)
            size += sg.numel
        start = time.perf_counter()
        if self._host is not None and self._offload is not None:  # gradients to the host
            self._host.begin([[sg for sg in b if _on_host(sg)] for b in batches],
                             self._offload.stats)  # fmt: skip
        if self._offload is not None and self._offload.nvme:
            # Swapped in ahead and out behind, one batch at a time.
            self._offload.run(batches, self._step_batch)
            return
        for batch in batches:
            self._step_batch(batch)
        if self._host is not None and self._offload is not None:
            self._offload.stats.step_s = time.perf_counter() - start

    def _step_batch(self, batch: list[SubGroup]) -> None:
        scratch_offset = 0
        stepped = False
        for sg in batch:
            used = self._set_grads(sg, scratch_offset)
            stepped = stepped or used > 0
            scratch_offset += used if self.flat else 0
        if stepped:
            self.optimizer.step()
        for sg in batch:
            for view in sg.tensors():
                view.grad = None
            if self._host is not None and self._host.steps(sg):
                self._host.upload(sg)  # overlaps the next batch's step

    def _set_grads(self, sg: SubGroup, scratch_offset: int) -> int:
        """Attach fp32 gradients to a sub-group's tensors; return the elements given."""
        if self._host is not None and self._host.steps(sg):
            grads = self._host.grads(sg)  # host copies of this rank's real elements
        else:
            grads = [self._zstate.grad_shard(sp) for sp in sg.params]
        if all(g is None for g in grads):
            return 0
        if self.flat and sg.master is not None:
            scratch = self._scratch(scratch_offset + sg.master.numel(), sg.master.device)
            scratch = scratch[scratch_offset:]
            scratch.zero_()
            for sp, offset, grad in zip(sg.params, sg.offsets, grads, strict=True):
                if grad is not None:
                    scratch[offset : offset + sp.local_numel].copy_(grad[: sp.local_numel])
            sg.master.grad = scratch
            return sg.master.numel()
        given = 0
        for sp, view, grad in zip(sg.params, sg.views, grads, strict=True):
            if grad is None:
                view.grad = None
            elif grad.dtype == torch.float32:
                view.grad = grad[: sp.local_numel]  # no copy: already fp32
            else:
                view.grad = grad[: sp.local_numel].float()  # the only conversion to fp32
            given += 0 if grad is None else max(1, sp.local_numel)
        return given

    def _scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        scratch = self._fp32_scratch.get(device)
        if scratch is None or scratch.numel() < numel:
            scratch = torch.empty(numel, dtype=torch.float32, device=device)
            self._fp32_scratch[device] = scratch
        return scratch[:numel]

    def _write_back(self) -> None:
        """Stepped masters go back into the model (non-fp32 shards; whole parameters)."""
        written = self._host.finish() if self._host is not None else set()
        params = [sp for sg in self._subgroups for sp in sg.params]
        self._zstate.commit_step(params, written=written)
        if self._offload is not None:
            self._offload.mark_written(params)

    def _end_window(self, *, clear: bool = False) -> None:
        self._grads_unscaled = False
        self._zstate.step.end_window(clear=clear)

    def _parts(self, *, bring_in: bool = True) -> _optim_checkpoint.OptimizerParts:
        """The masters, the wrapped optimizer and the scaler (for checkpoints); offloaded
        state is read back first (it stays in memory until the next step) unless
        ``bring_in`` is False.
        """
        if bring_in:
            self._bring_in()
        return _optim_checkpoint.OptimizerParts(
            self._subgroups, self.flat, self.optimizer, self.scaler
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """End the gradient accumulation window (gradients live in zero3's shards)."""
        for sg in self._subgroups:
            for view in sg.tensors():
                view.grad = None
        self._end_window(clear=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: zero3 lays out master shards when the optimizer is built."""
        if not self._constructed:  # called by Optimizer.__init__
            super().add_param_group(param_group)
            return
        raise NotImplementedError(
            "PartitionedOptimizer cannot add param groups after construction; pass every "
            "group to the constructor"
        )

    # -- checkpoints ------------------------------------------------------------------------------

    def sharded_state_dict(self) -> dict[str, Any]:
        """This optimizer's state for ``torch.distributed.checkpoint``, by parameter name.

        fp32 masters that are separate copies (``master``), per-element state tensors
        (``state``) as ShardedTensors in the parameters' natural shapes (views of this
        rank's slices, no copy), scalar state such as ``step`` (``scalars``), the param
        groups with their parameters by name (``param_groups``) and the loss scaler
        (``scaler``). DCP saves it at one world size and loads it at another. Not a
        collective. ``zero3.optim.save_checkpoint`` saves it beside the model.

        Raises:
            ValueError: The wrapped optimizer keeps state that is neither a per-element
                tensor nor a scalar (naming the state key and the parameter).
        """
        return _optim_checkpoint.sharded_state(self._parts())

    def streamed_sharded_state_dict(self) -> tuple[dict[str, Any], dict[tuple[str, ...], Any]]:
        """:meth:`sharded_state_dict` without reading the records optimizer offload keeps
        in swap files: their masters and state are deferred entries (by key path in the
        state dict) that ``zero3.core.engine.CheckpointSavePlanner`` reads, one record at
        a time, as it writes them. For saving only (``save_checkpoint`` uses it).
        """
        if self._offload is None or not self._offload.nvme:
            return self.sharded_state_dict(), {}
        reader = _records.record_reader(self._offload)
        return _optim_checkpoint.streamed_sharded_state(self._parts(bring_in=False), reader.entries)

    def streamed_load(self, reader: CheckpointReader) -> StreamedLoad:
        """Destinations for loading a checkpoint's optimizer section without reading the
        records optimizer offload keeps in swap files: each offloaded record is filled
        from the checkpoint, written to its file and let go before the next
        (``load_checkpoint`` uses it; see :class:`~zero3.optim._optimizer.StreamedLoad`).
        """
        if self._offload is None or not self._offload.nvme:
            template, _ = _optim_checkpoint.load_template(self._parts(), reader)
            return StreamedLoad(template, {}, self, {})
        parts = self._parts(bring_in=False)
        saved = _optim_checkpoint.saved_entries(parts, reader)  # checked before any change
        records = _records.record_loads(self._offload, saved)

        def entries_of(sg: _optim_checkpoint.SubGroup) -> Any:
            record = records.get(id(sg))
            return None if record is None else record.entries

        template, deferred = _optim_checkpoint.load_template(parts, reader, entries_of)
        return StreamedLoad(template, deferred, self, records)

    def _load_streamed(self, state_dict: Mapping[str, Any], records: Mapping[int, Any]) -> None:
        """The rest of a :class:`StreamedLoad`: records not filled up yet (masters from
        the model), then what is in memory, as :meth:`load_sharded_state_dict`.
        """
        error: BaseException | None = None
        try:
            for record in records.values():
                record.finish()
        except RuntimeError as exc:  # a failed read of a shard or write of a record
            error = exc
        if self._offload is not None and records:
            self._offload.agree(error)  # every rank fails alike, none waits
        self._load_state(state_dict, bring_in=not records)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`sharded_state_dict` contents (filled by ``dcp.load``, at any world
        size) into this optimizer, then write the masters back into the model.

        The model's weights must be loaded first: where the checkpoint holds no
        separate master for a parameter, the master is refreshed from the model's shard.
        A collective (persistent parameters are re-gathered).

        Raises:
            CheckpointMismatchError: The param groups list other parameters (by name),
                or the state names parameters this optimizer does not step.
        """
        self._load_state(state_dict, bring_in=True)

    def _load_state(self, state_dict: Mapping[str, Any], *, bring_in: bool) -> None:
        """Load what ``state_dict`` holds in memory, then write the masters back into
        the model and the offloaded state out to its files (``bring_in``: read the
        offloaded records first, for state that is loaded into them).
        """
        _optim_checkpoint.load_sharded_state(self._parts(bring_in=bring_in), state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        with torch.no_grad():
            self._write_back()
            self._offload_again()

    def _bring_in(self) -> None:
        if self._offload is not None and self._offload.nvme:
            self._offload.bring_all_in()

    def _offload_again(self) -> None:
        """Loaded state goes back to its swap files (nothing held between steps)."""
        if self._offload is not None and self._offload.nvme:
            self._offload.write_all_out()

    @property
    def offload(self) -> OffloadStore | None:
        """The offloaded sub-groups' store (None without ``offload_optimizer``): its
        ``stats`` say where the last step's time went, ``files`` where the state is.
        """
        return self._offload

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, for a file per rank (same rank, same world size only).

        Follows ``torch.optim.Optimizer.state_dict()``'s contract (``state`` and
        ``param_groups`` of the wrapped optimizer, so trainers that save and restore it
        work), plus zero3's per-rank entries: the fp32 masters, the loss scaler, and the
        rank and world size it belongs to. For checkpoints that load at any world size
        use :meth:`sharded_state_dict` (or ``zero3.optim.save_checkpoint``).
        """
        comm = self._zstate.comm
        self._parts()  # offloaded state read back
        inner = self.optimizer.state_dict()
        return {
            "state": inner["state"],
            "param_groups": inner["param_groups"],
            "masters": [torch.cat([v.detach() for v in sg.views]) for sg in self._subgroups],
            "layout": [[sp.name for sp in sg.params] for sg in self._subgroups],
            "flat": self.flat,
            "rank": comm.rank,
            "world_size": comm.world_size,
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank of a same-sized world.

        The model's shards (and persistent parameters) are set from the masters.
        """
        comm = self._zstate.comm
        if (state_dict.get("world_size"), state_dict.get("rank")) != (comm.world_size, comm.rank):
            raise ValueError(
                "PartitionedOptimizer.load_state_dict: the state was saved by rank "
                f"{state_dict.get('rank')} of {state_dict.get('world_size')}, this is rank "
                f"{comm.rank} of {comm.world_size}; load each rank's own file, or use "
                "zero3.optim.load_checkpoint, which reshards"
            )
        layout = [[sp.name for sp in sg.params] for sg in self._subgroups]
        if state_dict.get("layout") != layout or state_dict.get("flat") != self.flat:
            raise ValueError(
                "PartitionedOptimizer.load_state_dict: the parameter groups differ from the "
                "ones the state was saved with (names, order, sub_group_size or flat)"
            )
        inner = {"state": state_dict["state"], "param_groups": state_dict["param_groups"]}
        self._parts()  # offloaded state read back, to be replaced
        self.optimizer.load_state_dict(inner)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        with torch.no_grad():
            for sg, master in zip(self._subgroups, state_dict["masters"], strict=True):
                for view, part in zip(
                    sg.views, master.split([v.numel() for v in sg.views]), strict=True
                ):
                    view.copy_(part)
            self._write_back()
            self._offload_again()
        self.scaler.load_state_dict(state_dict["scaler"])
