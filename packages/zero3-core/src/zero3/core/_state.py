"""ShardedModelState: everything core knows about one sharded model."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zero3.comm import CommBackend
from zero3.core import _params
from zero3.core._config import LeafTarget, Zero3Config
from zero3.core._coordinator import ParamCoordinator
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

__all__ = ["ShardedModelState", "mark_leaf", "sharded_state", "state_of", "try_sharded_state"]

_log = logging.getLogger("zero3.core")

_STATES: weakref.WeakKeyDictionary[nn.Module, ShardedModelState] = weakref.WeakKeyDictionary()
_PARAM_STATE: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LEAF_MARKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_PENDING_EXTERNAL: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = (
    weakref.WeakKeyDictionary()
)


def _class_names(module: nn.Module) -> set[str]:
    cls = type(module)
    return {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}


def _matches(module: nn.Module, target: LeafTarget) -> bool:
    if isinstance(target, str):
        return target in _class_names(module)
    return isinstance(module, target)


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

    def __init__(self, module: nn.Module, config: Zero3Config, comm: CommBackend) -> None:
        self.module = module
        self.config = config
        self.comm = comm
        self.grad_comm = _duplicate(comm)
        self.stats = StatsBook(comm.world_size)
        self.modules = list(module.named_modules())
        self.params: list[ShardedParam] = []
        #: Indices of parameters a PartitionedOptimizer steps (each at most once).
        self.optimized: set[int] = set()

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
        state = cls(module, config, comm)
        state._partition(param_init_fn, checkpoint)
        _STATES[module] = state
        return state

    def _partition(self, param_init_fn: ParamInitFn | None, checkpoint: Checkpoint | None) -> None:
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
            for index, (name, param) in enumerate(named):
                self.params.append(self._shard(index, name, param, shards.get(index)))
        by_param = {id(sp.param): sp for sp in self.params}
        direct: list[list[ShardedParam]] = []
        for mod_name, mod in self.modules:
            own = [by_param[id(p)] for p in mod._parameters.values() if p is not None]
            for sp in own:
                sp.owners.append(mod_name or "<root>")
            direct.append(own)
        # The largest buffers a step needs at once: a whole-model gather (its receive
        # buffer, the model's bytes, plus the send buffer, 1/N of that); the gradient
        # bucket reuses them (best fit). See BufferPool.
        model_bytes = sum(sp.padded_numel * sp.shard.element_size() for sp in self.params)
        limit = model_bytes + model_bytes // self.comm.world_size + (1 << 20)
        self.pool = BufferPool(limit_bytes=limit)
        self.coordinator = ParamCoordinator(
            self.comm, self.config, self.modules, direct, self.stats, self.pool
        )
        self._apply_leaves()
        self._apply_pending_externals()
        trainable = [sp for sp in self.params if sp.requires_grad]
        self.reducer = GradReducer(
            self.grad_comm, self.config, trainable, self._leaf_of(), self.stats, self.pool
        )
        self.reducer.defer_launches = self.grad_comm is self.comm

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
            sp.status = ParamStatus.NOT_AVAILABLE
        return sp

    def _apply_leaves(self) -> None:
        targets = self.config.leaf_modules
        matched: set[LeafTarget] = set()
        for index, (_, mod) in enumerate(self.modules):
            hit = [t for t in targets if _matches(mod, t)]
            matched.update(hit)
            if hit or mod in _LEAF_MARKED:
                self.coordinator.set_leaf(index, True)
        missing = [t for t in targets if t not in matched]
        if missing:
            raise ValueError(
                f"Zero3Config.leaf_modules: no module of {type(self.module).__name__} matches "
                f"{missing!r} (give classes, or qualified/bare class names of submodules)"
            )

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

    # -- teardown -------------------------------------------------------------------------

    def unshard(self) -> None:
        """Gather every parameter for good and forget the partitioning."""
        if self.coordinator.step_open:
            self.coordinator.end_step(self.params)
        self.coordinator.fetch_params(self.params, -1, forward=True)
        for sp in self.params:
            _params.unregister(sp.param)
            _PARAM_STATE.pop(sp.param, None)
        _STATES.pop(self.module, None)
        if self.grad_comm is not self.comm:
            self.grad_comm.close()


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
