"""ShardedModelState: everything core knows about one sharded model."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zero3.comm import CommBackend, ReduceOp
from zero3.core import _params
from zero3.core._config import Zero3Config
from zero3.core._consistency import (
    check_same_model,
    describe_model,
    merge_edits,
    persistent_buffers,
    whole,
)
from zero3.core._coordinator import ParamCoordinator
from zero3.core._guard import CollectiveGuard, Op, OpKind, waiting_for
from zero3.core._leaves import match_leaf_modules
from zero3.core._materialize import (
    Checkpoint,
    Materializer,
    ParamInitFn,
    broadcast_from_rank0,
    is_persistent,
    own_storage,
)
from zero3.core._params import ParamStatus, ShardedParam
from zero3.core._pool import BufferPool
from zero3.core._reducer import GradReducer
from zero3.core._stats import StatsBook, StepStats
from zero3.core._tracer import Tracer

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
    """Partitioned parameters, coordinator and gradient reducer of one sharded model.

    Created by :meth:`create` (``zero3.hooks.shard_module`` calls it); the hooks
    package drives it from module hooks and the optimizer reads its gradient shards.

    Attributes:
        module: The root module.
        config: Its configuration.
        comm: Backend for parameter gathers and broadcasts.
        grad_comm: Backend for gradient reductions (an independent duplicate).
        params: Every sharded parameter, in ``named_parameters()`` order.
        modules: ``(qualified_name, module)`` for every module.
        coordinator: The :class:`ParamCoordinator`.
        reducer: The :class:`GradReducer`.
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
        self.modules = list(module.named_modules())
        # Headers before size-dependent collectives travel on a host channel of their own.
        self.control = comm.host_channel()
        names = [name or "<root>" for name, _ in self.modules]
        self.guard = CollectiveGuard(self.control, comm.rank, names.__getitem__)
        check_same_model(self.guard, describe_model(module, config, _LEAF_MARKED.__contains__))
        self.params: list[ShardedParam] = self._partition(param_init_fn, checkpoint)
        for sp in self.params:
            sp.version = sp.param._version  # whole data == shards from here on
        self.pool = BufferPool(limit_bytes=self._first_pool_limit())
        self.coordinator = ParamCoordinator(
            comm, config, self.modules, self._direct_params(), self.stats, self.pool, self.guard
        )
        self._apply_leaves()
        self._apply_pending_externals()
        self.reducer = GradReducer(
            self.grad_comm,
            config,
            [sp for sp in self.params if sp.requires_grad],
            self._leaf_of(),
            self.stats,
            self.pool,
            defer_launches=self.grad_comm is comm,
        )
        # Parameter index -> the optimizer stepping it (each parameter at most one).
        self._optimizer_of: dict[int, object] = {}

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
        return state

    def _partition(
        self, param_init_fn: ParamInitFn | None, checkpoint: Checkpoint | None
    ) -> list[ShardedParam]:
        """Cast, synchronise and shard every parameter (``named_parameters()`` order).

        Meta parameters are materialised straight into their shards (see
        :class:`~zero3.core._materialize.Materializer`); the others are cut here.
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
        eager = [p for i, (_, p) in enumerate(named) if i not in builder.handled]
        with torch.no_grad():
            for param in eager:
                if self.config.param_dtype is not None and param.dtype != self.config.param_dtype:
                    param.data = param.data.to(self.config.param_dtype)
                own_storage(param)
                param.grad = None
            if self.config.sync_module_states and self.comm.world_size > 1:
                tensors = [p.data for p in eager] + builder.eager_buffers()
                broadcast_from_rank0(self.comm, tensors)
            shards = builder.run()
            return [
                self._shard(index, name, param, shards.get(index))
                for index, (name, param) in enumerate(named)
            ]

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

    def _shard(
        self, index: int, name: str, param: nn.Parameter, shard: torch.Tensor | None = None
    ) -> ShardedParam:
        """Record one parameter's partition. ``shard``: this rank's shard, already cut
        (the materializer's; the parameter then holds no bytes).
        """
        world, rank = self.comm.world_size, self.comm.rank
        numel = param.numel()
        shard_numel = -(-numel // world)
        if shard is not None:
            pass  # cut by the materializer
        elif world == 1:
            # Note: a world of one has nothing to shard. The "shard" is the parameter's
            # own data and the parameter stays whole (persistent): no gathers, and the
            # optimizer steps the parameter in place, so a single process pays nothing.
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
            shard=shard,
            persistent=is_persistent(numel, world, self.config),
            rank=rank,
            world_size=world,
            aliases_param=world == 1,
        )
        _params.register(sp)
        _PARAM_STATE[param] = self
        if not sp.persistent:
            _params.free_full(param)
            sp.set_status(ParamStatus.NOT_AVAILABLE)
        return sp

    def _first_pool_limit(self) -> int:
        """What the buffer pool may cache before the first step has measured its working set.

        The largest buffers a step needs at once: a whole-model gather (its receive buffer,
        the model's bytes, plus the send buffer, 1/N of that); the gradient bucket reuses
        them (best fit). A configuration that keeps fewer parameters gathered
        (``max_live_parameters`` plus one prefetch bucket, or the largest parameter if
        that is more) bounds it further, as the end of each step does with the measured
        peak: otherwise the first step of a model whose parameters differ in size could
        cache a released storage of every size, the whole model. See BufferPool.
        """
        world = self.comm.world_size
        model_bytes = sum(sp.padded_numel * sp.shard.element_size() for sp in self.params)
        whole = model_bytes + model_bytes // world + (1 << 20)
        if not self.params:
            return whole
        elem = max(sp.shard.element_size() for sp in self.params)
        largest = max(sp.padded_numel * sp.shard.element_size() for sp in self.params)
        live = self.config.max_live_parameters + self.config.prefetch_bucket_size
        peak = max(largest, live * elem)
        return min(whole, 2 * peak + peak // world + (1 << 20))

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

    def _leaf_of(self) -> dict[int, int]:
        """Parameter index → index of the outermost leaf whose subtree owns it."""
        leaf_of: dict[int, int] = {}
        for index in range(len(self.modules)):
            if not self.coordinator.is_leaf(index) or self._under_leaf(index):
                continue
            for member in self.coordinator.subtree(index):
                for sp in self.coordinator.direct_params(member):
                    leaf_of.setdefault(sp.index, index)
        return leaf_of

    def _under_leaf(self, index: int) -> bool:
        return any(
            self.coordinator.is_leaf(i) and index in self.coordinator.subtree(i) and i != index
            for i in range(len(self.modules))
        )

    # -- queries ------------------------------------------------------------------------------

    def hooked_modules(self) -> Iterator[tuple[int, str, nn.Module]]:
        """Modules that get hooks: every module except those strictly inside a leaf."""
        inside: set[int] = set()
        for index in range(len(self.modules)):
            if self.coordinator.is_leaf(index) and index not in inside:
                inside.update(i for i in self.coordinator.subtree(index) if i != index)
        for index, (name, mod) in enumerate(self.modules):
            if index not in inside:
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
        return self.stats.last if self.coordinator.step_open else self.stats.current

    def set_leaf(self, module: nn.Module, leaf: bool = True) -> None:
        """Mark or unmark a submodule as a leaf after sharding (rebuilds buckets)."""
        if self.coordinator.step_open:
            raise RuntimeError("zero3: change leaf modules between steps, not during one")
        self.coordinator.set_leaf(self.coordinator.index_of(module), leaf)
        self.reducer.replan(self._leaf_of())
        for trace in self.coordinator.traces.values():
            trace.invalidate()

    # -- the step, driven by zero3.hooks ----------------------------------------------------

    def begin_forward(self) -> None:
        """The outermost forward starts: open a step unless one awaits its backward.

        Grad mode picks the kind: with grad enabled a training step (its trace spans the
        backward that follows), without it an inference step (forward only).
        """
        if not self.coordinator.step_open:
            self.coordinator.begin_step(training=torch.is_grad_enabled())

    def fetch(self, module: nn.Module, *, forward: bool) -> None:
        """Make ``module``'s parameters whole here: gather, wait, then prefetch ahead.

        A backward that runs after its step was closed (a second backward through a
        retained graph) opens a new step of its own.
        """
        self.begin_forward()
        self.coordinator.fetch_sub_module(module, forward)

    def release(self, module: nn.Module) -> None:
        """``module`` finished (forward or backward): release what is not reused soon."""
        self.coordinator.release_sub_module(module)

    def fetch_set(self, module_index: int) -> list[ShardedParam]:
        """The non-persistent parameters gathered for a module (direct, external, leaf)."""
        return self.coordinator.fetch_set(module_index)

    def use_external(self, module_index: int, sp: ShardedParam, *, forward: bool) -> None:
        """The running module reads ``sp``, which it does not own: from now on ``sp`` is
        gathered with it, and it is gathered (and held under the module) at once.
        """
        if self.coordinator.add_external(module_index, sp):
            self.coordinator.fetch_params([sp], module_index, forward=forward)

    def hold_for_step(self, sp: ShardedParam) -> None:
        """The root module returned ``sp``: keep it whole until the step ends."""
        if not sp.persistent:
            sp.holds += 1

    def end_forward(self, *, backward_pending: bool) -> None:
        """The outermost forward ended; the step ends too unless a backward will follow."""
        coordinator = self.coordinator
        if coordinator.step_open and (not coordinator.training_step or not backward_pending):
            coordinator.end_step(self.params)
            self.synchronize()

    def on_grad(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        """A parameter's full gradient for this backward (zero3 now owns ``grad``)."""
        self.reducer.on_grad(sp, grad)

    def backward_done(self, module_index: int) -> None:
        """Gradients reached the module's inputs: release it, reduce a leaf's buckets."""
        self.coordinator.release_sub_module(self.modules[module_index][1])
        if self.coordinator.is_leaf(module_index):
            self.reducer.leaf_done(module_index)

    def end_backward(self) -> None:
        """The epilogue: reduce what is left, then release everything and end the step."""
        self.reducer.end_backward()
        if self.coordinator.step_open:
            self.coordinator.end_step(self.params)

    def end_window(self) -> None:
        """End the gradient accumulation window (an optimizer step or a ``zero_grad``)."""
        self.reducer.end_window()

    # -- the optimizer's side (zero3.optim drives these) ----------------------------------

    def claim(self, params: Iterable[ShardedParam], optimizer: object) -> None:
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

    def optimizers(self) -> list[object]:
        """The optimizers that claimed parameters of this model, in claiming order."""
        found: list[object] = []
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

    def adopt_master(self, sp: ShardedParam, region: torch.Tensor) -> torch.Tensor:
        """An optimizer keeps ``sp``'s fp32 master in ``region`` (``shard_numel``
        elements): copy the shard in and return the master's real elements.

        An fp32 parameter's shard *moves* into the region (one copy of the fp32 state,
        nothing to write back); any other dtype keeps its shard and the region becomes
        its master, which :meth:`write_local` keeps in step with edits made outside the
        optimizer (loading, ``gathered_parameters(modifier_rank=...)``).
        """
        region.copy_(sp.shard)
        master = region[: sp.local_numel]
        if sp.dtype == torch.float32 and not sp.aliases_param:
            sp.shard = region
        else:
            sp.master = master
        return master

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """A small all-reduce on the gradient backend (norms, overflow flags), counted."""
        with waiting_for(
            lambda: (
                f"rank {self.comm.rank} timed out in the optimizer's all-reduce "
                f"(step {self.coordinator.steps})"
            )
        ):
            self.grad_comm.all_reduce(tensor, op=op).wait()
        self.stats.current.other_collectives += 1

    def publish(self, params: Iterable[ShardedParam]) -> None:
        """New values were written into these parameters' shards (an optimizer step):
        the ones whole on this rank are gathered again, in one refresh.
        """
        whole = [
            sp
            for sp in params
            if not sp.aliases_param and (sp.persistent or sp.status is ParamStatus.AVAILABLE)
        ]
        self.coordinator.refresh(whole)

    # -- consistency across ranks --------------------------------------------------------

    def synchronize(self) -> None:
        """Merge every rank's in-place edits of whole parameters into the shards and
        masters, and give every rank rank 0's changed buffers (see the Notes of
        :mod:`zero3.core._consistency`). A collective; zero3 calls it when an optimizer
        is built and before it steps, at the end of inference forwards, before state
        dicts and when unsharding.
        """
        if self.comm.world_size == 1:
            return
        edited: dict[int, torch.Tensor | None] = dict(self.coordinator.edits)
        for sp in self.params:
            if whole(sp) and sp.param._version != sp.version and not sp.aliases_param:
                edited[sp.index] = sp.param.detach()
        n = len(self.params)
        flags = torch.zeros(n, dtype=torch.uint8)
        for index in edited:
            flags[index] = 1
        step = self.coordinator.steps
        self.guard.check(Op(OpKind.SYNC, step, 0, -1, n, flags.numel()))
        with waiting_for(lambda: f"rank {self.comm.rank} timed out synchronising step {step}"):
            on_device = flags.to(self.comm.device())
            self.comm.all_reduce(on_device, op=ReduceOp.MAX).wait()
            flagged = [self.params[int(i)] for i in torch.nonzero(on_device.cpu()).flatten()]
            if flagged:
                merge_edits(self, edited, flagged)
            buffers = persistent_buffers(self.module)
            if buffers:
                broadcast_from_rank0(self.comm, buffers)
        self.coordinator.edits.clear()
        for sp in flagged:
            sp.version = sp.param._version
        self.coordinator.refresh([sp for sp in flagged if whole(sp) and not sp.aliases_param])
        self.stats.current.other_collectives += 1

    def agree(self, kind: OpKind) -> None:
        """Check that every rank enters the same collective helper now (``kind``);
        raises on every rank, naming what each one does, if not.
        """
        self.guard.check(Op(kind, self.coordinator.steps))

    def refresh_trainable(self) -> list[ShardedParam]:
        """Re-plan gradient buckets if parameters were frozen or unfrozen since sharding;
        returns the parameters that became trainable (they need gradient hooks).

        Raises:
            RuntimeError: The set changed in the middle of an accumulation window.
        """
        trainable = [sp for sp in self.params if sp.requires_grad]
        planned = self.reducer.params
        if [sp.index for sp in trainable] == [sp.index for sp in planned]:
            return []
        if self.reducer.micro_step:
            changed = sorted({sp.name for sp in trainable} ^ {sp.name for sp in planned})
            raise RuntimeError(
                f"zero3: requires_grad changed for {changed[:5]} in the middle of a gradient "
                "accumulation window; freeze or unfreeze parameters between optimizer steps"
            )
        known = {sp.index for sp in planned}
        self.reducer.replace_params(trainable, self._leaf_of())
        return [sp for sp in trainable if sp.index not in known]

    # -- writing parameter values ---------------------------------------------------------

    def write_local(self, sp: ShardedParam, values: torch.Tensor, *, masters: bool = True) -> None:
        """Set this rank's real elements of ``sp``: its shard, and (``masters``) its fp32
        master if an optimizer keeps one apart. The whole parameter is not touched.
        """
        with torch.no_grad():
            sp.shard[: values.numel()].copy_(values)
            if masters and sp.master is not None:
                sp.master.copy_(values)

    def write_full(self, sp: ShardedParam, flat: torch.Tensor, *, masters: bool = True) -> None:
        """Set ``sp`` from its full values (``numel`` elements, flat): this rank's shard
        and (``masters``) master, and the parameter itself where it is whole here.
        """
        start, stop = sp.valid_range(sp.rank)
        self.write_local(sp, flat[start:stop], masters=masters)
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
        self.guard.check(Op(OpKind.FULL_GRAD, self.coordinator.steps, 0, -1, sp.index, nbytes))
        out = torch.empty(sp.padded_numel, dtype=shard.dtype, device=shard.device)
        with waiting_for(lambda: f"rank {self.comm.rank} timed out in full_grad({sp.name!r})"):
            self.grad_comm.all_gather(out, shard.contiguous()).wait()
        self.stats.current.other_collectives += 1
        return out[: sp.numel].view(sp.shape)

    # -- teardown -------------------------------------------------------------------------

    def unshard(self) -> None:
        """Gather every parameter for good and forget the partitioning."""
        if self.coordinator.step_open:
            self.coordinator.end_step(self.params)
        self.synchronize()
        self.coordinator.fetch_params(self.params, -1, forward=True)
        for sp in self.params:
            _params.unregister(sp.param)
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
        ``dtype``; check that ``device`` is where the comm backend moves tensors.
        Returns whether anything was cast (``zero3.hooks.ShardedModule.to`` calls it).

        A cast is collective (it first merges pending edits, as :meth:`synchronize`
        does): every rank casts. A call that changes nothing is local and free.

        Note (why a device is only checked):
            A sharded parameter lives where its comm backend gathers and reduces it
            (``shard_module`` refuses any other device), so the one device a sharded
            model can be "moved" to is the one it is on; any other is an error naming
            both, not a silent copy the backend could not use.

        Note (no cast once an optimizer exists):
            A ``PartitionedOptimizer`` keeps an fp32 master of every parameter it steps
            (for an fp32 parameter, the shard itself) and writes its results back in the
            parameter's dtype, so that dtype is part of the optimizer's layout. Casting
            after building one is refused: cast first (or set ``Zero3Config.param_dtype``).

        Raises:
            ValueError: ``device`` is not the comm backend's; the cast would change
                parameters an optimizer steps; it comes in the middle of a step or a
                gradient accumulation window, or inside a ``gathered_parameters`` block.
            TypeError: ``dtype`` is not a floating-point dtype.
        """
        if device is not None:
            self._check_device(torch.device(device))
        if dtype is None:
            return False
        if not dtype.is_floating_point:
            raise TypeError(
                f"zero3: a sharded module casts to floating-point dtypes only, got {dtype}"
            )
        changing = [sp for sp in self.params if sp.dtype.is_floating_point and sp.dtype != dtype]
        if not changing:
            return False
        stepped = [sp.name for sp in changing if sp.index in self._optimizer_of]
        if stepped:
            raise ValueError(
                f"zero3: cannot cast {type(self.module).__name__} to {dtype}: a "
                f"PartitionedOptimizer already keeps fp32 masters of {stepped[:3]} (and "
                f"{max(0, len(stepped) - 3)} more) in their current dtype "
                f"({changing[0].dtype}). Cast the model (model.to({dtype})) or set "
                "Zero3Config.param_dtype before building the optimizer"
            )
        busy = self.coordinator.step_open or self.reducer.micro_step
        pinned = [sp.name for sp in changing if sp.pinned]
        if busy or pinned:
            where = (
                f"inside a gathered_parameters block holding {pinned[:3]}"
                if pinned
                else "in the middle of a step or a gradient accumulation window"
            )
            raise ValueError(
                f"zero3: cannot cast {type(self.module).__name__} to {dtype} {where}; "
                "cast between steps, after the optimizer step (or zero_grad)"
            )
        self.synchronize()  # whole parameters' edits reach the shards before the cast
        with torch.no_grad():
            for sp in changing:
                self._cast(sp, dtype)
        self.reducer.replan(self._leaf_of())  # buckets and gradient buffers by dtype
        for trace in self.coordinator.traces.values():
            trace.invalidate()
        return True

    def _check_device(self, device: torch.device) -> None:
        here = self.params[0].shard.device if self.params else self.comm.device()
        # Every CPU index names the same memory ("cpu:0" is what some launchers give).
        if device.type == here.type and (
            device.type == "cpu" or device.index in (None, here.index)
        ):
            return
        raise ValueError(
            f"zero3: cannot move the sharded {type(self.module).__name__} to {device}: its "
            f"{self.comm.name!r} comm backend gathers and reduces {self.comm.device_type} "
            f"tensors and the shards live on {here}. Move the model before shard_module, "
            "with a backend for that device (Zero3Config.backend)"
        )

    def _cast(self, sp: ShardedParam, dtype: torch.dtype) -> None:
        """Cast one parameter's shard and, where it has them, its whole data."""
        param = sp.param
        if sp.aliases_param:  # a world of one: the shard is the parameter's own data
            param.data = param.data.to(dtype)
            sp.shard = param.detach().reshape(-1)
        elif whole(sp):
            sp.shard = sp.shard.to(dtype)
            param.data = param.data.to(dtype)
        else:
            sp.shard = sp.shard.to(dtype)
            # The released parameter keeps its shape with no bytes: give it an empty
            # storage of the new dtype (allocated, then freed, one parameter at a time).
            sp.set_status(ParamStatus.AVAILABLE)  # its own class again, so .data may be set
            param.data = torch.empty(sp.shape, dtype=dtype, device=param.device)
            _params.free_full(param)
            sp.set_status(ParamStatus.NOT_AVAILABLE)
        sp.version = param._version


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
    """The state of a sharded root module.

    Raises:
        ValueError: ``module`` was not passed to ``zero3.hooks.shard_module``.
    """
    state = _STATES.get(module)
    if state is None:
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
