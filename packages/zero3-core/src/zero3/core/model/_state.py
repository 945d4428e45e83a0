"""ShardedModelState: everything core knows about one sharded model."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zero3.comm import CommBackend, ReduceOp
from zero3.core.config._config import Zero3Config
from zero3.core.config._leaves import match_leaf_modules
from zero3.core.config._window import GatherWindow
from zero3.core.construct._materialize import (
    Checkpoint,
    Materializer,
    ParamInitFn,
    check_eager_agree,
    own_storage,
)
from zero3.core.diag._guard import CollectiveGuard, Op, OpKind, waiting_for
from zero3.core.diag._memory import trim_heap
from zero3.core.diag._stats import StatsBook, StepStats
from zero3.core.diag._tracer import Tracer
from zero3.core.grads._reducer import GradReducer
from zero3.core.model._adopt import (
    ADOPT_TITLE,
    describe_additions,
    find_additions,
    prepare_params,
    relabel,
)
from zero3.core.model._convert import cast_param, check_device, refuse_cast
from zero3.core.model._host_shards import HostShards
from zero3.core.model._param_offload import ParamSwap
from zero3.core.model._partition import new_sharded_param, open_shard_home
from zero3.core.model._step import TrainingStep
from zero3.core.model._sync import ModelSync, check_same_model, describe_model, whole
from zero3.core.model._unshard import UnshardedPlan, chunks, plan_unsharded
from zero3.core.model._votes import StopVotes
from zero3.core.params import _params
from zero3.core.params._broadcast import broadcast_from_rank0
from zero3.core.params._coordinator import GATHERED_PARAMETERS, UNSHARDED, ParamCoordinator
from zero3.core.params._params import ParamStatus, ShardedParam
from zero3.core.params._pool import BufferPool

__all__ = [
    "ShardedModelState",
    "mark_leaf",
    "sharded_state",
    "state_of",
    "try_sharded_state",
]

_log = logging.getLogger("zero3.core")

_STATES: weakref.WeakKeyDictionary[nn.Module, ShardedModelState] = weakref.WeakKeyDictionary()
_PARAM_STATE: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LEAF_MARKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_PENDING_EXTERNAL: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = (
    weakref.WeakKeyDictionary()
)


def mark_leaf(module: nn.Module) -> None:
    """Mark a module as a leaf before it is sharded (``set_leaf_modules`` uses this)."""
    _LEAF_MARKED.add(module)


def add_pending_external(module: nn.Module, param: nn.Parameter) -> None:
    """Remember an external parameter registered before the model is sharded."""
    _PENDING_EXTERNAL.setdefault(module, []).append(param)


class ShardedModelState:
    """Everything core knows about one sharded model: the façade hooks and optim call.

    Created by :meth:`create` (``zero3.hooks.shard_module`` calls it). The module hooks
    drive its :attr:`step`; the optimizer reads its gradient shards, keeps its fp32
    masters in buffers this state lays out (:meth:`make_masters`) and hands the stepped
    values back with :meth:`commit_step`.

    Attributes:
        module: The root module.
        config: Its configuration.
        comm: Backend for parameter gathers and broadcasts.
        grad_comm: Backend for gradient reductions (an independent duplicate).
        params: Every sharded parameter, in ``named_parameters()`` order.
        modules: ``(qualified_name, module)`` for every module.
        coordinator: Gathers, prefetches and releases parameters.
        reducer: Reduces gradients into this rank's gradient shards.
        sync: Merges in-place edits and rank 0's buffers.
        step: The :class:`~zero3.core.engine.TrainingStep` that owns each step.
        stats: Step counters.
    """

    def __init__(
        self,
        module: nn.Module,
        config: Zero3Config,
        comm: CommBackend,
        *,
        param_init_fn: ParamInitFn | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.comm = comm
        self.grad_comm = _duplicate(comm)
        self.stats = StatsBook(comm.world_size)
        self._window_logged = False
        self.modules = list(module.named_modules())
        # Headers before size-dependent collectives travel on a host channel of their own.
        self.control = comm.host_channel()
        self.guard = CollectiveGuard(self.control, comm.rank, self._module_name)
        check_same_model(self.guard, describe_model(module, config, _LEAF_MARKED.__contains__))
        #: Where ``offload_param: nvme`` keeps the parameter shards (None: in memory).
        self.param_swap: ParamSwap | None = None
        #: ``offload_param: cpu`` with the model on an accelerator: the shards in host
        #: memory and their copies read ahead onto the device (None: not offloaded so).
        self.host_shards: HostShards | None = None
        self.params: list[ShardedParam] = self._partition(param_init_fn, checkpoint)
        for sp in self.params:
            sp.version = sp.param._version  # whole data == shards from here on
        self.pool = BufferPool(limit_bytes=0)
        self.coordinator = ParamCoordinator(
            comm, config, self.modules, self._direct_params(), self.stats, self.pool, self.guard
        )
        self._apply_leaves()
        self._apply_pending_externals()
        self._resolve_window()
        self.reducer = GradReducer(
            self.grad_comm,
            config,
            [sp for sp in self.params if sp.requires_grad],
            self.coordinator.leaf_of(),
            self.stats,
            self.pool,
            defer_launches=self.grad_comm is comm,
            chunk_numel=self.window.chunk_numel,
        )
        self.sync = ModelSync(module, self.params, comm, self.guard, self.coordinator, self.stats)
        self.step = TrainingStep(
            self.modules, self.params, self.coordinator, self.reducer, self.sync, self.stats
        )
        for sp in self.params:  # param.grad asks the reducer (parameters unfrozen later too)
            sp.grads = self.step
        # Offloaded shards are read ahead in trace order: from the swap file, or from
        # host memory onto the device.
        swap = self.param_swap
        self.coordinator.shard_home = swap if swap is not None else self.host_shards
        # Parameter index -> the optimizer stepping it (each parameter at most one).
        self._optimizer_of: dict[int, torch.optim.Optimizer] = {}
        #: ``generate``'s stopping votes across ranks.
        self.votes = StopVotes(comm, self.guard, self.step, self.stats)
        self._trims_heap = config.trims_host_heap  # resolved once: the config is frozen
        if self._trims_heap:
            # Half way through a backward the forward's activations it freed are heap
            # glibc keeps; handed back, the gradients and read-ahead that the second
            # half brings do not stack on them (the optimizer's read-ahead, registered
            # later, starts after this).
            self.step.on_backward(self.trim_host_heap)
        #: ``zero3.hooks.unsharded`` blocks opened on the model (generate opens one).
        self.unsharded_blocks = 0
        #: The plan of the ``unsharded`` block open now, if any.
        self.unsharded_plan: UnshardedPlan | None = None
        #: Counts adoptions (:meth:`adopt`): the hooks install theirs on new modules.
        self.structure_version = 0

    def _build_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """The small all-reduce of construction (the step's :meth:`all_reduce` names a
        step in its timeout messages).
        """
        self.grad_comm.all_reduce(tensor, op=op).wait()

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        module: nn.Module,
        config: Zero3Config,
        comm: CommBackend,
        *,
        param_init_fn: ParamInitFn | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> ShardedModelState:
        """Partition ``module``'s parameters across ``comm``'s ranks.

        Parameters on the meta device are built straight into this rank's shards, one
        module at a time: read from ``checkpoint`` (a path or a
        :class:`~zero3.core.WeightSource`; then every parameter is loaded from it), or
        initialised by ``param_init_fn(module)`` / the modules' ``reset_parameters()``.
        See ``zero3.hooks.shard_module`` for the rules.
        """
        if module in _STATES:
            raise ValueError(
                f"{type(module).__name__} is already sharded; call zero3.hooks.unshard_module "
                "first to shard it again"
            )
        for name, param in module.named_parameters():
            if _params.lookup(param) is not None:
                raise ValueError(
                    f"parameter {name!r} of {type(module).__name__} already belongs to a "
                    "sharded model; a parameter can be sharded once (unshard the other model)"
                )
        state = cls(module, config, comm, param_init_fn=param_init_fn, checkpoint=checkpoint)
        _STATES[module] = state
        if config.trim_host_heap is None and config.trims_host_heap and comm.rank == 0:
            _log.info(
                "zero3: offload to nvme: each backward half way and each optimizer step "
                "as it begins and ends hand the host heap's free pages back to the kernel "
                "(Zero3Config.trim_host_heap=False keeps them)"
            )
        return state

    def _partition(
        self, param_init_fn: ParamInitFn | None, checkpoint: Checkpoint | None
    ) -> list[ShardedParam]:
        """Cast, synchronise and shard every parameter (``named_parameters()`` order).

        Meta parameters are materialised straight into their shards (see
        :class:`~zero3.core.construct._materialize.Materializer`); the others are cut here.
        """
        named = list(self.module.named_parameters())
        builder = Materializer(
            self.module,
            named,
            self.config,
            self.comm,
            param_init_fn=param_init_fn,
            checkpoint=checkpoint,
        )
        builder.prepare()  # every check, agreed by every rank, before anything changes
        eager_named = [(n, p) for i, (n, p) in enumerate(named) if i not in builder.handled]
        eager = [p for _, p in eager_named]
        with torch.no_grad():
            for param in eager:
                if self.config.param_dtype is not None and param.dtype != self.config.param_dtype:
                    param.data = param.data.to(self.config.param_dtype)
                own_storage(param)
                param.grad = None
            if self.config.sync_module_states and self.comm.world_size > 1:
                tensors = [p.data for p in eager] + builder.eager_buffers()
                broadcast_from_rank0(self.comm, tensors)
            elif not self.config.sync_module_states:
                check_eager_agree(self.comm, eager_named)
            # The swap file, if any, is opened only now: every check above has passed.
            home = open_shard_home(
                self.config, self.comm, named, step_all_reduce=self.all_reduce,
                build_all_reduce=self._build_all_reduce, agree_on=self.grad_comm.device(),
            )  # fmt: skip
            swap = self.param_swap = home if isinstance(home, ParamSwap) else None
            host = self.host_shards = home if isinstance(home, HostShards) else None
            keep = swap.store if swap is not None else host.store if host is not None else None
            shards = builder.run(keep=keep)
            params = []
            for index, (name, param) in enumerate(named):
                sp = self._shard(index, name, param, shards.get(index))
                if swap is not None and swap.offloads(index):
                    swap.adopt(sp)  # a shard cut here (eager) goes out before the next
                elif host is not None:
                    host.adopt(sp)  # its shard in host memory, HostShards its home
                params.append(sp)
            if swap is not None:
                swap.finish_build(self._build_all_reduce, self.grad_comm.device())
            return params

    def _shard(
        self,
        index: int,
        name: str,
        param: nn.Parameter,
        shard: torch.Tensor | None = None,
        *,
        homed: bool = True,
    ) -> ShardedParam:
        """Record one parameter's partition (``shard``: already cut) as this model's
        (``homed``: see :func:`new_sharded_param`).
        """
        sp = new_sharded_param(index, name, param, self.config, self.comm, shard, homed=homed)
        _PARAM_STATE[param] = self
        return sp

    def _direct_params(self) -> list[list[ShardedParam]]:
        """For each module, the sharded parameters it owns directly (records owners)."""
        by_param = {id(sp.param): sp for sp in self.params}
        direct: list[list[ShardedParam]] = []
        for mod_name, mod in self.modules:
            own = [by_param[id(p)] for p in mod._parameters.values() if p is not None]
            for sp in own:
                sp.owners.append(mod_name or "<root>")
            direct.append(own)
        return direct

    @property
    def window(self) -> GatherWindow:
        """The resolved gather window (prefetch, live, reuse and chunk sizes) every
        gather, release, reduction chunk, ``unsharded`` block and ``generate`` follows.
        """
        return self.coordinator.window

    def _resolve_window(self) -> None:
        """Size the gather window from the model's fetch units (at shard time, and again
        when leaf modules change them), bound the buffer pool by it, and log it once.

        Before the first step has measured its working set, the pool may cache what the
        window's bound allows (:attr:`GatherWindow.pool_bytes`): otherwise the first step
        of a model whose parameters differ in size could cache a released storage of
        every size, the whole model. See BufferPool.
        """
        window = self.coordinator.resolve_window()
        changed = window != self.coordinator.window or not self._window_logged
        self.coordinator.window = window
        self.pool.limit_bytes = window.pool_bytes
        gathers = self.comm.world_size > 1 or not all(sp.persistent for sp in self.params)
        if changed and self.comm.rank == 0 and gathers:
            _log.info(
                "zero3: gather window of %s: %s", type(self.module).__name__, window.describe()
            )
        self._window_logged = True

    def _apply_leaves(self) -> None:
        matched = match_leaf_modules(
            self.module, self.config.leaf_modules, source="Zero3Config.leaf_modules"
        )
        chosen = {id(mod) for _, mod in matched}
        for index, (_, mod) in enumerate(self.modules):
            if id(mod) in chosen or mod in _LEAF_MARKED:
                self.coordinator.set_leaf(index, True)

    def _apply_pending_externals(self) -> None:
        for index, (_, mod) in enumerate(self.modules):
            for param in _PENDING_EXTERNAL.pop(mod, []):
                sp = _params.lookup(param)
                if sp is not None:
                    self.coordinator.add_external(index, sp)

    def _module_name(self, index: int) -> str:
        return self.modules[index][0] or "<root>"

    def adopt(self) -> bool:
        """Adopt modules and parameters added to the model since sharding (a collective
        when there are any; returns whether there were). The rule: ``zero3.core.model.
        _adopt``, Note "the adoption rule". Called at every outermost forward (by the
        hooks) and when an optimizer is built.

        Raises:
            FingerprintMismatchError: The ranks added different things.
            RuntimeError: Added in the middle of a step or gradient accumulation window.
            ValueError: A new parameter is on meta or another device, or belongs to
                another sharded model.
        """
        found = find_additions(self.module, self.modules, lambda p: self.owns(p) is not None)
        if found is None:
            return False
        if self.step.busy:
            raise RuntimeError(
                f"zero3: {[n for n, _, _ in found.params][:3]} were added to the sharded model "
                "in the middle of a step or gradient accumulation window; add parameters "
                "and modules between optimizer steps"
            )
        check_same_model(self.guard, describe_additions(found), OpKind.ADOPT, ADOPT_TITLE)
        prepare_params(self.comm, self.config, [(n, p) for n, p, _ in found.params])
        start = len(self.params)
        owned = []
        for k, (name, param, owner) in enumerate(found.params):
            sp = self._shard(start + k, name, param, homed=False)  # not offloaded
            sp.version, sp.grads = param._version, self.step
            self.params.append(sp)  # the step, the sync and the reducer share this list
            owned.append((owner, sp))
        self.modules[:] = found.modules
        self.coordinator.adopt(self.modules, owned)
        relabel(self.module, self.params, [m for _, m in self.modules])
        trainable = [sp for sp in self.params if sp.requires_grad]
        self.reducer.replace_params(trainable, self.coordinator.leaf_of())
        self.structure_version += 1
        return True

    # -- queries ------------------------------------------------------------------------------

    def hooked_modules(self) -> Iterator[tuple[int, str, nn.Module]]:
        """Modules that get hooks: every module except those strictly inside a leaf."""
        for index in self.coordinator.hooked_modules():
            name, mod = self.modules[index]
            yield index, name, mod

    @property
    def tracer(self) -> Tracer | None:
        """The trace-event recorder, or None while tracing is off. Set it to start tracing."""
        return self.coordinator.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | None) -> None:
        self.coordinator.tracer = tracer
        self.reducer.tracer = tracer

    def last_stats(self) -> StepStats:
        """Counters of the last finished step (the step in progress is not finished)."""
        return self.stats.last if self.step.is_open else self.stats.current

    def set_leaf(self, module: nn.Module, leaf: bool = True) -> None:
        """Mark or unmark a submodule as a leaf after sharding (rebuilds buckets)."""
        if self.step.is_open:
            raise RuntimeError("zero3: change leaf modules between steps, not during one")
        if self.step.micro_steps:
            raise RuntimeError(
                "zero3: leaf modules changed in the middle of a gradient accumulation "
                "window; change them before backward or after the optimizer step"
            )
        self.coordinator.set_leaf(self.coordinator.index_of(module), leaf)
        self._resolve_window()
        self.reducer.chunk_numel = self.window.chunk_numel
        self.reducer.replan(self.coordinator.leaf_of())
        for trace in self.coordinator.traces.values():
            trace.invalidate()

    def fetch_set(self, module_index: int) -> list[ShardedParam]:
        """The non-persistent parameters gathered for a module (direct, external, leaf)."""
        return self.coordinator.fetch_set(module_index)

    # -- gathering outside the hooks -------------------------------------------------------

    def pin(self, params: Sequence[ShardedParam], purpose: int = GATHERED_PARAMETERS) -> None:
        """Gather ``params`` and keep them whole across steps until :meth:`unpin`
        (``gathered_parameters``; a collective). ``purpose`` names the caller in headers
        and fingerprints (``zero3.core.params._coordinator``'s pseudo-module indices).
        """
        self.coordinator.fetch_params(params, purpose, self.step.moment(), pin=True)

    def unpin(self, params: Sequence[ShardedParam]) -> None:
        """Drop :meth:`pin`'s hold; parameters no module holds are released."""
        self.coordinator.release_params(params, pin=True)

    def open_unsharded(self, max_bytes: int | None) -> UnshardedPlan:
        """Begin a ``zero3.hooks.unsharded`` block (a collective): plan what it keeps
        gathered (``zero3.core.model._unshard``) and gather it in runs of at most the
        window's prefetch elements (their headers check every rank does the same).

        Raises:
            RuntimeError: A block or a step is open (:meth:`TrainingStep.enter_unsharded`).
            FingerprintMismatchError: The ranks do not all enter the same block.
        """
        self.step.enter_unsharded()
        self.unsharded_blocks += 1
        plan = plan_unsharded(self.coordinator, self.params, max_bytes)
        pinned: list[ShardedParam] = []
        try:
            # No header of its own: the gathers' headers name the block and the set of
            # parameters, so ranks entering different blocks (or one not entering) fail.
            self.coordinator.traces["unsharded"].invalidate()
            self.coordinator.cap_bytes = plan.cap_bytes
            for piece in chunks(plan.pinned, max(1, self.window.prefetch_numel)):
                pinned.extend(piece)
                self.pin(piece, UNSHARDED)
        except BaseException:
            self._end_unsharded(pinned, clean=False)
            raise
        self.unsharded_plan = plan
        return plan

    def close_unsharded(self, plan: UnshardedPlan, *, clean: bool) -> None:
        """End a block: with ``clean`` (every rank leaves it normally; a collective) merge
        the edits made inside it and rank 0's buffers first, then release what it kept.
        A block left by an exception only releases (no collective a peer may not join).
        """
        self._end_unsharded(plan.pinned, clean=clean)

    def _end_unsharded(self, pinned: Sequence[ShardedParam], *, clean: bool) -> None:
        self.coordinator.cap_bytes = None
        self.unsharded_plan = None
        try:
            if clean:
                self.synchronize()
        finally:
            self.unpin(pinned)
            self.step.exit_unsharded()

    def add_external(self, module: nn.Module, sp: ShardedParam) -> None:
        """``module``'s forward uses ``sp``, which it does not own: gather it with it."""
        self.coordinator.add_external(self.coordinator.index_of(module), sp)

    # -- the optimizer's side (zero3.optim drives these) ----------------------------------

    def claim(self, params: Iterable[ShardedParam], optimizer: torch.optim.Optimizer) -> None:
        """Record that ``optimizer`` steps ``params``; each parameter has one optimizer.

        Raises:
            ValueError: A parameter already belongs to another optimizer.
        """
        params = list(params)
        self.synchronize()  # edits made since sharding (re-initialised weights) first
        for sp in params:
            owner = self._optimizer_of.get(sp.index)
            if owner is not None and owner is not optimizer:
                raise ValueError(
                    f"PartitionedOptimizer: parameter {sp.name!r} is already stepped by "
                    "another PartitionedOptimizer; give each parameter to one optimizer"
                )
        for sp in params:
            self._optimizer_of[sp.index] = optimizer

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers that claimed parameters of this model, in claiming order."""
        found: list[torch.optim.Optimizer] = []
        for optimizer in self._optimizer_of.values():
            if not any(optimizer is seen for seen in found):
                found.append(optimizer)
        return found

    def owns(self, param: torch.Tensor) -> ShardedParam | None:
        """The sharded state of ``param`` if it is a parameter of this model, else None."""
        sp = _params.lookup(param)
        return sp if sp is not None and _PARAM_STATE.get(param) is self else None

    def grad_shard(self, sp: ShardedParam) -> torch.Tensor | None:
        """This rank's padded gradient shard of ``sp`` for the window (None: no gradient
        on any rank).
        """
        return self.reducer.grad_shard(sp)

    def make_masters(
        self,
        params: Sequence[ShardedParam],
        *,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Lay out fp32 masters for ``params`` (an optimizer sub-group): one flat buffer of
        their padded shards back to back, and each one's real elements in it.

        An fp32 parameter's shard *moves* into the buffer (one copy of the fp32 state,
        nothing to write back); any other dtype keeps its shard and its region becomes
        the master, which :meth:`commit_step` copies back and writes keep in step with
        edits made outside the optimizer (loading, ``gathered_parameters``).

        Args:
            params: The sub-group's parameters (one device).
            device: Where the buffer lives (default: the shards' device). On another
                device (host masters of shards on an accelerator, for optimizer
                offload) every master is a copy of its own, fp32 ones too.
        """
        home = params[0].device
        where = home if device is None else device
        flat = torch.empty(sum(sp.shard_numel for sp in params), dtype=torch.float32, device=where)
        views, cursor = [], 0
        # With offloaded shards in the sub-group every master is a copy of its own: a
        # shard moved into the buffer would keep the whole buffer (the offloaded
        # parameters' masters too) in memory when optimizer offload empties it.
        separate = where != home or any(sp.offloaded for sp in params)
        for sp in params:
            region = flat[cursor : cursor + sp.shard_numel]
            cursor += sp.shard_numel
            region.copy_(sp.shard)
            if sp.home is not None:  # copied: an offloaded shard goes back out
                sp.home.drop(sp)
            if sp.dtype == torch.float32 and not sp.aliases_param and not separate:
                sp.shard = region
            else:
                sp.master = region[: sp.local_numel]
            views.append(region[: sp.local_numel])
        return flat, views

    def take_shard_edit(self, sp: ShardedParam) -> bool:
        """Whether ``sp``'s offloaded shard was set from outside the optimizer since the
        optimizer last asked (a load, ``gathered_parameters``, an in-place edit of a host
        shard); asking clears it.
        """
        swap, host = self.param_swap, self.host_shards
        if swap is not None and sp.home is swap:
            return swap.take_edit(sp)
        if host is not None and sp.home is host:
            return host.take_edit(sp)
        return False

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """A small all-reduce on the gradient backend (norms, overflow flags), counted."""
        with waiting_for(
            lambda: (
                f"rank {self.comm.rank} timed out in the optimizer's all-reduce "
                f"(step {self.step.number})"
            ),
            rank=self.comm.rank,
            during=lambda: f"the optimizer's all-reduce (step {self.step.number})",
            after=self.guard.last_words,
        ):
            self.grad_comm.all_reduce(tensor, op=op).wait()
        self.stats.current.other_collectives += 1

    def commit_step(self, params: Iterable[ShardedParam], *, written: Collection[int] = ()) -> None:
        """An optimizer stepped these parameters' masters: copy each separate master into
        its shard (in the parameter's dtype), then gather again, in one refresh, the ones
        whole on this rank.

        Args:
            params: The stepped parameters.
            written: Indices of parameters whose shards the optimizer has written itself
                (host masters copied to the device on a stream of their own); their
                masters are not copied again.
        """
        whole_here = []
        with torch.no_grad():
            for sp in params:
                if sp.master is not None and sp.index not in written:
                    sp.write_local(sp.master, masters=False, stepped=True)
                if not sp.aliases_param and whole(sp):
                    whole_here.append(sp)
        if self.param_swap is not None:  # the stepped shards are on disk on every rank
            self.param_swap.settle(self.grad_comm.device())
        self.coordinator.refresh(whole_here, self.step.moment())
        self.trim_host_heap()  # what the step freed (the swapped state, temporaries)
        self.coordinator.read_ahead(-1)  # the next step's first offloaded shards

    def trim_host_heap(self) -> None:
        """Hand the host heap's free pages back to the kernel if the config says so
        (:attr:`~zero3.core.Zero3Config.trim_host_heap`). The model's step calls it when
        a backward is half done; the optimizer when its step begins (the backward's
        activations are free: the swap buffers the step takes then do not stack on the
        heap they left); :meth:`commit_step` when the step ends.
        """
        if self._trims_heap:
            trim_heap()

    # -- consistency across ranks --------------------------------------------------------

    def synchronize(self) -> None:
        """Merge every rank's in-place edits of whole parameters into the shards and
        masters, and give every rank rank 0's buffers
        (:class:`~zero3.core.model._sync.ModelSync`). A collective; zero3 calls it when an
        optimizer is built and before it steps, at the end of inference forwards, before
        state dicts and when unsharding.
        """
        self.sync.synchronize(self.step.number)

    def agree(self, kind: OpKind) -> None:
        """Check that every rank enters the same collective helper now (``kind``);
        raises on every rank, naming what each one does, if not.
        """
        self.guard.check(Op(kind, self.step.number))

    # -- writing parameter values ---------------------------------------------------------

    def write_full(self, sp: ShardedParam, flat: torch.Tensor, *, masters: bool = True) -> None:
        """Set ``sp`` from its full values (``numel`` elements, flat): this rank's shard
        and (``masters``) master, and the parameter itself where it is whole here.
        """
        start, stop = sp.valid_range(sp.rank)
        sp.write_local(flat[start:stop], masters=masters)
        if sp.status is ParamStatus.AVAILABLE and not sp.aliases_param:
            _params.write_full(sp.param, flat)
        # The whole data (if any) equals the shards again: no edit pending.
        sp.version = sp.param._version
        self.coordinator.edits.pop(sp.index, None)

    def full_grad(self, sp: ShardedParam) -> torch.Tensor | None:
        """``sp``'s full gradient for the window, gathered from every rank (a collective)."""
        shard = self.reducer.grad_shard(sp)
        if shard is None:
            return None
        nbytes = shard.numel() * shard.element_size()
        self.guard.check(Op(OpKind.FULL_GRAD, self.step.number, 0, -1, sp.index, nbytes))
        out = torch.empty(sp.padded_numel, dtype=shard.dtype, device=shard.device)
        with waiting_for(
            lambda: f"rank {self.comm.rank} timed out in full_grad({sp.name!r})",
            rank=self.comm.rank,
            during=lambda: f"full_grad({sp.name!r}) (step {self.step.number})",
            after=self.guard.last_words,
        ):
            self.grad_comm.all_gather(out, shard.contiguous()).wait()
        self.stats.current.other_collectives += 1
        return out[: sp.numel].view(sp.shape)

    # -- teardown -------------------------------------------------------------------------

    def unshard(self) -> None:
        """Gather every parameter for good and forget the partitioning."""
        self.step.close()
        self.synchronize()
        self.coordinator.fetch_params(self.params, -1, self.step.moment())
        if self.param_swap is not None:  # shards back in memory, the swap file removed
            self.param_swap.close()
            self.param_swap = self.coordinator.shard_home = None
        if self.host_shards is not None:  # the whole parameters are on the device now
            self.host_shards.clear()
            self.coordinator.shard_home = None
        for sp in self.params:
            _params.unregister(sp.param)
            _params.undress_sharded(sp.param)
            _PARAM_STATE.pop(sp.param, None)
        _STATES.pop(self.module, None)
        if self.grad_comm is not self.comm:
            self.grad_comm.close()
        if self.control is not None:
            self.control.close()

    # -- device and dtype (``module.to``) -----------------------------------------------

    def convert(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> bool:
        """Apply ``module.to(device, dtype)`` to the sharded parameters: cast each
        floating-point parameter's shard (and its whole data where it is whole here) to
        ``dtype``; check that ``device`` is where the comm backend moves tensors
        (``model/_convert.py`` says why a device is only checked, and why no cast comes
        after an optimizer is built). Returns whether anything was cast
        (``zero3.hooks.ShardedModule.to`` calls it).

        A cast is collective (it first merges pending edits, as :meth:`synchronize`
        does): every rank casts. A call that changes nothing is local and free.

        Raises:
            ValueError: ``device`` is not the comm backend's; the cast would change
                parameters an optimizer steps; it comes in the middle of a step or a
                gradient accumulation window, or inside a ``gathered_parameters`` block.
            TypeError: ``dtype`` is not a floating-point dtype.
        """
        if device is not None:
            check_device(self.module, self.comm, self.params, torch.device(device))
        if dtype is None:
            return False
        if not dtype.is_floating_point:
            raise TypeError(
                f"zero3: a sharded module casts to floating-point dtypes only, got {dtype}"
            )
        changing = [sp for sp in self.params if sp.dtype.is_floating_point and sp.dtype != dtype]
        if not changing:
            return False
        refuse_cast(
            self.module, dtype, changing,
            stepped=[sp.name for sp in changing if sp.index in self._optimizer_of],
            busy=self.step.busy, swapped=self.param_swap is not None,
        )  # fmt: skip
        self.coordinator.release_kept()  # frozen_params' whole copies: cast the shards only
        self.synchronize()  # whole parameters' edits reach the shards before the cast
        with torch.no_grad():
            for sp in changing:
                cast_param(sp, dtype)
        self.reducer.replan(self.coordinator.leaf_of())  # buckets and gradient buffers by dtype
        for trace in self.coordinator.traces.values():
            trace.invalidate()
        return True


def _duplicate(comm: CommBackend) -> CommBackend:
    try:
        return comm.duplicate()
    except NotImplementedError:
        _log.warning(
            "zero3: %s cannot duplicate itself; gradient reductions share the parameter "
            "backend and are deferred to the end of backward so both collective sequences "
            "stay in the same order on every rank",
            type(comm).__name__,
        )
        return comm


def try_sharded_state(module: nn.Module) -> ShardedModelState | None:
    """The state of a sharded root module, or None."""
    return _STATES.get(module)


def sharded_state(module: nn.Module) -> ShardedModelState:
    """The state of a sharded root module, or of the one sharded model inside a wrapper
    (a ``peft.PeftModel`` around a sharded base).

    Raises:
        ValueError: ``module`` was not passed to ``zero3.hooks.shard_module`` and holds
            no sharded module (or several).
    """
    state = _STATES.get(module)
    if state is None:
        inner = [_STATES[m] for m in module.modules() if m in _STATES]
        if len(inner) == 1:
            return inner[0]
        if inner:
            raise ValueError(
                f"{type(module).__name__} holds {len(inner)} sharded models; pass the one "
                "meant (the module returned by zero3.hooks.shard_module)"
            )
        raise ValueError(
            f"{type(module).__name__} is not a sharded module: pass the module returned by "
            "zero3.hooks.shard_module(model, config)"
        )
    return state


def state_of(param: torch.Tensor) -> ShardedModelState:
    """The state of the model a sharded parameter belongs to."""
    state = _PARAM_STATE.get(param)
    if state is None:
        raise ValueError(
            f"the tensor of shape {tuple(param.shape)} is not a parameter of a sharded module"
        )
    return state  # type: ignore[no-any-return]
