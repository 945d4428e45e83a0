"""ParamCoordinator: when parameters are gathered, prefetched and released.

Note (fetch in three steps):
    ``fetch_sub_module`` (1) starts one coalesced gather of the module's parameters
    that are not on this rank, (2) waits for them and for any prefetch already
    carrying the rest, then (3) once the trace is COMPLETE prefetches what comes next
    in trace order, up to the window's prefetch elements (``prefetch_bucket_size``),
    never past its live elements (``max_live_parameters``), with at most two prefetches in flight
    (each gather holds its buffers from the moment it is issued, so a host that
    queued gathers without bound would pin their memory long before use). One
    prefetch leaves as several gathers cut at module boundaries (overlap chunks,
    :func:`~zero3.core.params._gather.cut_at_modules`).
    With ``overlap_comm=False`` the gather stream is the compute stream: prefetches
    are still issued but waited for at once, and ``StepStats.blocking_prefetches``
    counts them.

Note (the trace):
    A trace is recorded over one whole step (forward *and* backward for training,
    forward only for inference: zero3 keeps one trace of each kind, so evaluating
    between training steps never throws the training trace away). Once COMPLETE it
    tells the coordinator which parameters come next (prefetch) and which will be
    used again soon (kept on release). Results never depend on the trace: a step that
    departs from it falls back to on-demand gathering for the rest of the step, so a
    wrong trace costs speed, never correctness.

Note (holds):
    A parameter is released only when no running module holds it: a parent keeps its
    own parameters while children run, a module re-entered by checkpoint recomputation
    during its own backward keeps what the backward needs, and an external parameter
    stays while the module reading it runs.
"""

from __future__ import annotations

import array
import collections
import logging
import warnings
import zlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from zero3.comm import CommBackend
from zero3.core.config._config import Zero3Config
from zero3.core.config._window import GatherWindow, resolve_window
from zero3.core.diag._guard import CollectiveGuard, Moment, Op, OpKind, Phase, waiting_for
from zero3.core.diag._stats import StatsBook
from zero3.core.diag._tracer import Tracer
from zero3.core.params._gather import (
    GatherHandle,
    GatherLayout,
    cut_at_modules,
    verify_fingerprints,
)
from zero3.core.params._params import (
    ParamStatus,
    ShardedParam,
    ShardHome,
    free_full,
    write_full,
)
from zero3.core.params._pool import BufferPool
from zero3.core.params._trace import Trace, TraceState

__all__ = [
    "GATHERED_PARAMETERS",
    "MAX_INFLIGHT_PREFETCHES",
    "STREAMED",
    "UNSHARDED",
    "ParamCoordinator",
]

_log = logging.getLogger("zero3.core")

#: Prefetch gathers allowed in flight at once (each holds its buffers until consumed).
MAX_INFLIGHT_PREFETCHES = 2
#: Module indices used in fingerprints and headers of gathers that no module asked for:
#: ``gathered_parameters`` (and state dicts, refreshes), ``zero3.hooks.unsharded``, and
#: ``zero3.hooks.iter_full_parameters``.
GATHERED_PARAMETERS = -1
UNSHARDED = -2
STREAMED = -3
_PSEUDO_MODULES = {
    GATHERED_PARAMETERS: "zero3.core.gathered_parameters",
    UNSHARDED: "zero3.hooks.unsharded",
    STREAMED: "zero3.hooks.iter_full_parameters",
}


class ParamCoordinator:
    """Gathers, prefetches and releases the parameters of one sharded model.

    Args:
        comm: The backend parameter gathers go through.
        config: The model's configuration.
        modules: Every module of the model as ``(qualified_name, module)``, in
            ``named_modules()`` order (the same on every rank).
        direct: For each module (same order), the sharded parameters it owns directly.
        stats: Where the step counters go.
        pool: Reusable gather buffers.
        guard: Exchanges a header before each gather (see the guard's Note); without
            one, gathers are checked by their in-band fingerprints, once per step.

    The resolved gather window (:attr:`window`) is set by :meth:`resolve_window` from the
    fetch units; the model state calls it again once the leaves are known.
    """

    def __init__(
        self,
        comm: CommBackend,
        config: Zero3Config,
        modules: Sequence[tuple[str, nn.Module]],
        direct: Sequence[Sequence[ShardedParam]],
        stats: StatsBook,
        pool: BufferPool,
        guard: CollectiveGuard | None = None,
    ) -> None:
        self.comm = comm
        self.guard = guard or CollectiveGuard(None, comm.rank, self.describe)
        # Finished gathers whose fingerprints wait for one batched check (no headers).
        self._unverified: list[GatherHandle] = []
        #: Copies of edited whole parameters released before their edit was merged.
        self.edits: dict[int, torch.Tensor] = {}
        self.config = config
        self.names = [name or "<root>" for name, _ in modules]
        self._index = {id(module): i for i, (_, module) in enumerate(modules)}
        self._children = self._child_lists(modules)
        self._direct = [list(params) for params in direct]
        self._external: list[list[ShardedParam]] = [[] for _ in modules]
        self._leaf: set[int] = set()
        self._fetch_sets: dict[int, list[ShardedParam]] = {}
        self._layouts: dict[tuple[int, ...], GatherLayout] = {}
        self.stats = stats
        self.pool = pool
        # One trace per kind of step; "unsharded" is for the steps inside
        # zero3.hooks.unsharded, whose module order is not that of a plain step.
        self.traces = {name: Trace(name) for name in ("train", "infer", "unsharded")}
        self.trace = self.traces["train"]
        self.position = 0
        self.diverged = False
        self._prefetched: set[int] = set()
        # Prefetches in flight; one prefetch is a list of gathers (overlap chunks).
        self._inflight: collections.deque[list[GatherHandle]] = collections.deque()
        # Parameter index -> the gather carrying it, while its status is INFLIGHT.
        self._gathering: dict[int, GatherHandle] = {}
        self._structure_changed = False
        self._warned_invalidation = False
        self.tracer: Tracer | None = None
        self.live_numel = 0
        self.live_bytes = 0
        self._high_bytes = 0  # most gathered bytes at once in this step
        # Frozen parameters kept whole from forward until their backward
        # (frozen_params="keep") or from their first use on ("replicate"): index ->
        # parameter. They do not count against the live-parameter bound that stops
        # prefetching.
        self._kept_frozen: dict[int, ShardedParam] = {}
        self._kept_numel = 0
        self._sharded_numel = sum(sp.numel for ps in direct for sp in ps if not sp.persistent)
        self.window = self.resolve_window()
        self.gather_stream = comm.new_stream() if config.overlap_comm else comm.current_stream()
        #: With a bound (``zero3.hooks.unsharded(max_bytes=...)``): prefetches never take
        #: the gathered bytes past it, and modules release on exit (no reuse window).
        self.cap_bytes: int | None = None
        #: Where offloaded shards live (``offload_param``): read ahead in trace order.
        self.shard_home: ShardHome | None = None

    @property
    def window(self) -> GatherWindow:
        """The resolved gather window every prefetch, release and chunk follows."""
        return self._window

    @window.setter
    def window(self, window: GatherWindow) -> None:
        self._window = window
        # Read at every step's end: kept as a number, not recomputed per step.
        self._pool_bound = window.pool_bytes

    @staticmethod
    def _child_lists(modules: Sequence[tuple[str, nn.Module]]) -> list[list[int]]:
        index = {id(m): i for i, (_, m) in enumerate(modules)}
        return [[index[id(c)] for c in m.children() if id(c) in index] for _, m in modules]

    # -- module bookkeeping ---------------------------------------------------------

    def index_of(self, module: nn.Module) -> int:
        """The module's index (its position in ``named_modules()``)."""
        try:
            return self._index[id(module)]
        except KeyError:
            raise ValueError(
                f"{type(module).__name__} is not a submodule of this sharded model"
            ) from None

    def describe(self, module_index: int) -> str:
        """Qualified name of a module index (for messages)."""
        if module_index in _PSEUDO_MODULES:
            return _PSEUDO_MODULES[module_index]
        if 0 <= module_index < len(self.names):
            return self.names[module_index]
        return f"<unknown module #{module_index}>"

    def set_leaf(self, module_index: int, leaf: bool) -> None:
        """Mark a module as a leaf: its whole subtree is gathered on entry."""
        (self._leaf.add if leaf else self._leaf.discard)(module_index)
        self._structure_updated()

    def is_leaf(self, module_index: int) -> bool:
        """Whether the module is a leaf."""
        return module_index in self._leaf

    def subtree(self, module_index: int) -> list[int]:
        """The module and all its descendants (indices)."""
        out, stack = [], [module_index]
        while stack:
            i = stack.pop()
            out.append(i)
            stack.extend(self._children[i])
        return out

    def leaf_of(self) -> dict[int, int]:
        """Parameter index → index of the outermost leaf whose subtree owns it."""
        inner = {i for leaf in self._leaf for i in self.subtree(leaf) if i != leaf}
        leaf_of: dict[int, int] = {}
        for index in sorted(self._leaf - inner):
            for member in self.subtree(index):
                for sp in self._direct[member]:
                    leaf_of.setdefault(sp.index, index)
        return leaf_of

    def hooked_modules(self) -> list[int]:
        """Modules that get hooks: every module except those strictly inside a leaf."""
        inner = {i for leaf in self._leaf for i in self.subtree(leaf) if i != leaf}
        return [i for i in range(len(self.names)) if i not in inner]

    def direct_params(self, module_index: int) -> list[ShardedParam]:
        """The sharded parameters the module owns directly (persistent ones included)."""
        return self._direct[module_index]

    def external_params(self, module_index: int) -> list[ShardedParam]:
        """Parameters the module uses without owning them."""
        return self._external[module_index]

    def add_external(self, module_index: int, sp: ShardedParam) -> bool:
        """Record that the module uses ``sp`` without owning it; False if already known."""
        if sp in self._direct[module_index] or sp in self._external[module_index]:
            return False
        self._external[module_index].append(sp)
        self._structure_updated()
        return True

    def adopt(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        owned: Sequence[tuple[int, ShardedParam]],
    ) -> None:
        """Take in modules and parameters added after sharding (``ShardedModelState.adopt``).

        ``modules``: every module, the known ones at their old indices (renamed where
        they moved) and the new ones after them; ``owned``: each new parameter with the
        index of the module holding it directly. Every trace is recorded again.
        """
        self.names = [name or "<root>" for name, _ in modules]
        self._index = {id(module): i for i, (_, module) in enumerate(modules)}
        self._children = self._child_lists(modules)
        grow = len(modules) - len(self._direct)
        self._direct += [[] for _ in range(grow)]
        self._external += [[] for _ in range(grow)]
        for index, sp in owned:
            self._direct[index].append(sp)
            if not sp.persistent:
                self._sharded_numel += sp.numel
        self._structure_updated()
        for trace in self.traces.values():
            trace.invalidate()

    def _structure_updated(self) -> None:
        self._fetch_sets.clear()
        self._structure_changed = True

    def fetch_set(self, module_index: int) -> list[ShardedParam]:
        """Non-persistent parameters gathered for the module (direct + external; whole
        subtree for a leaf), deduplicated, in a deterministic order.
        """
        cached = self._fetch_sets.get(module_index)
        if cached is not None:
            return cached
        members = self.subtree(module_index) if module_index in self._leaf else [module_index]
        seen: dict[int, ShardedParam] = {}
        for i in sorted(members):
            for sp in (*self._direct[i], *self._external[i]):
                if not sp.persistent:
                    seen.setdefault(sp.index, sp)
        result = list(seen.values())
        self._fetch_sets[module_index] = result
        return result

    def resolve_window(self) -> GatherWindow:
        """The gather window of this model now: the config's values, and for the auto
        ones the rule of ``zero3.core.config._window`` from the current fetch units.
        """
        sharded = [sp for ps in self._direct for sp in ps if not sp.persistent]
        elem = max((sp.itemsize for sp in sharded), default=4)
        units = (sum(sp.numel for sp in self.fetch_set(i)) for i in self.hooked_modules())
        world = self.comm.world_size
        shard_bytes = 2 * sum(sp.shard_numel * sp.itemsize for sp in sharded)
        return resolve_window(
            self.config,
            units,
            sharded_numel=self._sharded_numel,
            element_size=elem,
            world_size=world,
            shard_bytes=shard_bytes,
        )

    # -- passes (the training step opens and ends them) ------------------------------------

    def begin_pass(self, training: bool, trace: str | None = None) -> None:
        """A step begins: ``training`` picks the training or the inference trace (or
        ``trace`` names one), whose module order this pass records or follows.
        """
        self.trace = self.traces[trace or ("train" if training else "infer")]
        if self.trace.state is TraceState.INVALID:
            self.trace.start_recording()
        self.position = 0
        self.diverged = False
        self._prefetched.clear()
        # The reads the last optimizer step started (ShardedModelState.commit_step) are
        # in by now: a home whose shards go on to a device copies them before the first
        # gather asks.
        self.read_ahead(-1)

    def end_pass(self, all_params: Iterable[ShardedParam]) -> None:
        """The step ends: complete gathers, release everything, freeze or check the trace."""
        for handles in self._inflight:
            for handle in handles:
                self._finish(handle)
        self._inflight.clear()
        replicate = self.config.frozen_params == "replicate" and self.cap_bytes is None
        for sp in all_params:
            sp.holds = 0
            if replicate and self._replicable(sp):
                self._keep(sp)
                self._keep_edit(sp)  # stays whole; an in-place edit still reaches the shard
                continue
            self._release(sp)
        self.verify_gathers()
        trace = self.trace
        if not self.diverged:
            if trace.state is TraceState.RECORD:
                if self.position:
                    trace.freeze(self.fetch_set)
                else:
                    trace.invalidate()
            elif trace.state is TraceState.COMPLETE and (
                self.position != len(trace.modules) or self._structure_changed
            ):
                if self.position != len(trace.modules):
                    self._count_invalidation(
                        f"the step ran {self.position} module fetches but the "
                        f"{trace.kind} trace holds {len(trace.modules)}"
                    )
                trace.invalidate()
        self._structure_changed = False
        if self._high_bytes:
            # Keep what this step used at once: its gathered parameters, their gather
            # buffers (receive + send) — and never more than the window's pool bound
            # (see BufferPool).
            peak = self._high_bytes
            used = 2 * peak + peak // self.comm.world_size + (1 << 20)
            self.pool.limit_bytes = min(used, self._pool_bound)
            self._high_bytes = self.live_bytes

    def begin_backward(self) -> None:
        """Forward turned into backward: empty the buffer pool (see BufferPool's Note,
        "the turn"). Backward's first gathers allocate afresh, and what they release
        is cached again for the rest of backward.
        """
        self.pool.clear()

    def _count_invalidation(self, reason: str) -> None:
        self.stats.current.trace_invalidations += 1
        self.stats.total_invalidations += 1
        if not self._warned_invalidation:
            self._warned_invalidation = True
            warnings.warn(
                f"zero3: the module order changed ({reason}); falling back to on-demand "
                "gathers for this step and recording the order again. Results are exact; "
                "if this repeats every step, prefetching is lost (StepStats."
                "trace_invalidations counts it; this warning is shown once).",
                stacklevel=3,
            )
        else:
            _log.debug("zero3: trace invalidated: %s", reason)

    # -- fetch / release --------------------------------------------------------------

    def fetch_sub_module(self, module: nn.Module, at: Moment) -> None:
        """Make the module's parameters whole on this rank (the three steps of the Note).

        A pass must be open (:meth:`begin_pass`; the training step opens it).
        """
        if at.phase is Phase.BETWEEN:
            raise RuntimeError("zero3 internal error: a module fetch outside a step")
        index = self.index_of(module)
        position = self.position
        self.position += 1
        traced = self._check_trace(index, position)
        params = self.fetch_set(index)
        for sp in params:
            sp.holds += 1
        self._make_available(params, index, at, traced)
        if traced:
            self._prefetch(position, at)
            self.read_ahead(position)

    def release_sub_module(self, module: nn.Module, *, backward_follows: bool = False) -> None:
        """Release the module's parameters, keeping those the trace uses again within
        ``max_reuse_distance`` elements, and the frozen ones under
        ``frozen_params="replicate"``, or under ``"keep"`` with ``backward_follows`` (a
        forward exit whose outputs carry gradients: its backward finds them whole).
        """
        index = self.index_of(module)
        params = self.fetch_set(index)
        keep: frozenset[int] = frozenset()
        if self.trace.state is TraceState.COMPLETE and not self.diverged and self.cap_bytes is None:
            keep = self.trace.reused_within(self.position, index, self.window.reuse_numel)
        mode = self.config.frozen_params
        keep_frozen = self.cap_bytes is None and (
            mode == "replicate" or (mode == "keep" and backward_follows)
        )
        for sp in params:
            sp.holds = max(0, sp.holds - 1)
            if sp.holds > 0 or sp.index in keep:
                continue
            if keep_frozen and self._replicable(sp):
                self._keep(sp)
                continue
            self._release(sp)

    @staticmethod
    def _replicable(sp: ShardedParam) -> bool:
        """A frozen partitioned parameter whole (or arriving) here: ``frozen_params`` may
        keep it.
        """
        return (
            not sp.requires_grad
            and not sp.persistent
            and sp.status is not ParamStatus.NOT_AVAILABLE
        )

    def _keep(self, sp: ShardedParam) -> None:
        if sp.index not in self._kept_frozen:
            self._kept_frozen[sp.index] = sp
            self._kept_numel += sp.numel

    def release_kept(self) -> None:
        """Release the frozen parameters ``frozen_params`` keeps whole (before their
        shards are written from elsewhere: a checkpoint load, a cast); an in-place
        edit is kept for the shards, as on any release.
        """
        for sp in list(self._kept_frozen.values()):
            if sp.holds == 0:
                self._release(sp)

    def fetch_params(
        self, params: Sequence[ShardedParam], module_index: int, at: Moment, pin: bool = False
    ) -> None:
        """Hold (or pin, across steps) and gather an explicit list of parameters."""
        todo = [sp for sp in params if not sp.persistent]
        for sp in todo:
            if pin:
                sp.pinned += 1
            else:
                sp.holds += 1
        self._make_available(todo, module_index, at, traced=False)

    def release_params(self, params: Sequence[ShardedParam], pin: bool = False) -> None:
        """Drop the holds (or pins) taken by :meth:`fetch_params`; release what is free."""
        for sp in params:
            if sp.persistent:
                continue
            if pin:
                sp.pinned = max(0, sp.pinned - 1)
            else:
                sp.holds = max(0, sp.holds - 1)
            if sp.holds == 0:
                self._release(sp)
        self.verify_gathers()

    def verify_gathers(self) -> None:
        """Check the fingerprints of gathers finished since the last check (one sync)."""
        if self._unverified:
            handles, self._unverified = self._unverified, []
            verify_fingerprints(handles, self.describe)

    def _announce(
        self, kind: OpKind, gathers: Sequence[tuple[int, GatherLayout]], at: Moment
    ) -> str:
        """Exchange one header for ``gathers`` ((module, layout) pairs, issued back to
        back); returns how their fingerprints are verified. Several gathers (the cuts of
        one prefetch) share one header naming each one's module, parameters and size,
        so the ranks meet once per prefetch, not at every cut (docs/architecture.rst,
        "The collective guard").
        """
        if not self.guard.active:
            return "later"
        (module, layout), *more = gathers
        params, nbytes = layout.param_hash, layout.chunk_bytes
        if more:
            words = array.array("q")
            for index, each in gathers:
                words.extend((index, each.param_hash, each.chunk_bytes))
            params = zlib.crc32(words.tobytes()) & 0x7FFFFFFF
            nbytes = sum(each.chunk_bytes for _, each in gathers)
        self.guard.check(Op(kind, at.step, at.phase, module, params, nbytes))
        return "headers"

    def _check_trace(self, index: int, position: int) -> bool:
        """Record or verify this fetch; return True if prefetching may follow it."""
        trace = self.trace
        if self.diverged:
            return False
        if trace.state is TraceState.RECORD:
            trace.record(index)
            return False
        if trace.state is TraceState.COMPLETE:
            expected = trace.expected(position)
            if expected == index:
                return True
            self.diverged = True
            trace.invalidate()  # the next step records the new order
            wanted = self.describe(expected) if expected is not None else "the end"
            self._count_invalidation(
                f"fetch #{position} of the {trace.kind} step was {self.describe(index)!r}, "
                f"the trace expected {wanted!r}"
            )
        return False

    def _make_available(
        self, params: Sequence[ShardedParam], index: int, at: Moment, traced: bool
    ) -> None:
        need = [sp for sp in params if sp.status is ParamStatus.NOT_AVAILABLE]
        prefetched = any(sp.index in self._prefetched for sp in params)
        if traced and params:
            if need:
                self.stats.current.prefetch_misses += 1
            elif prefetched:
                self.stats.current.prefetch_hits += 1
        if need:
            self._finish(self._issue(need, index, at, prefetch=False))
        for sp in params:
            handle = self._gathering.get(sp.index)
            if handle is not None:
                self._finish(handle)
            self._prefetched.discard(sp.index)

    def _issue(
        self,
        params: list[ShardedParam],
        index: int,
        at: Moment,
        prefetch: bool,
        verify: str | None = None,
    ) -> GatherHandle:
        """Start one gather; ``verify``: its header was exchanged already, with the
        other gathers of its prefetch (:meth:`_announce`).
        """
        layout = self._layout(params)
        if index in _PSEUDO_MODULES:
            kind = OpKind.GATHERED
        else:
            kind = OpKind.PREFETCH if prefetch else OpKind.FETCH
        if verify is None:
            verify = self._announce(kind, [(index, layout)], at)
        handle = GatherHandle(
            self.comm,
            layout,
            index,
            self.describe,
            self.gather_stream,
            self.pool,
            kind="prefetch" if prefetch else "gather",
            step=at.step,
            issued_us=self._now(),
            verify=verify,
        )
        for sp in params:
            self._gathering[sp.index] = handle
        stats = self.stats.current
        numel = sum(sp.numel for sp in params)
        stats.count_gather(
            forward=at.forward, numel=numel, payload=layout.payload_bytes,
            buffer=layout.chunk_bytes, world=self.comm.world_size,
        )  # fmt: skip
        self.live_numel += numel
        self.live_bytes += layout.payload_bytes
        self._high_bytes = max(self._high_bytes, self.live_bytes)
        stats.live_numel_high_water = max(stats.live_numel_high_water, self.live_numel)
        if prefetch:
            stats.prefetch_gathers += 1
            self._prefetched.update(sp.index for sp in params)
            if not self.config.overlap_comm:
                stats.blocking_prefetches += 1
                self._finish(handle)
        return handle

    def _finish(self, handle: GatherHandle) -> None:
        """Wait for a gather on the compute stream and fill its parameters."""
        if handle.finished:
            return
        for sp in handle.layout.params:
            self._gathering.pop(sp.index, None)
        tracer = self.tracer
        waited = self._now()
        with waiting_for(
            lambda: self._waiting_text(handle),
            rank=self.comm.rank,
            during=lambda: (
                f"the {handle.kind} for module {self.describe(handle.module_index)!r} "
                f"(step {handle.step})"
            ),
            after=self.guard.last_words,
        ):
            handle.finish(self.comm.current_stream())
        if handle.verify == "later":
            self._unverified.append(handle)
        if self.edits:
            for sp in handle.layout.params:
                self._reapply_edit(sp)
        if tracer is None:
            return
        end = tracer.now_us()
        name = self.describe(handle.module_index)
        kind = handle.kind
        tracer.complete(
            f"{kind} {name}",
            kind,
            handle.issued_us,
            end,
            lane="gather",
            bytes=handle.layout.chunk_bytes * self.comm.world_size,
        )
        tracer.complete(f"wait {kind} {name}", "wait", waited, end)

    def _waiting_text(self, handle: GatherHandle) -> str:
        what = f"the {handle.kind} for module {self.describe(handle.module_index)!r}"
        return (
            f"rank {self.comm.rank} timed out waiting for {what} (step {handle.step}); "
            f"{self.guard.last_words()}"
        )

    def _now(self) -> float:
        return self.tracer.now_us() if self.tracer is not None else 0.0

    def _layout(self, params: list[ShardedParam]) -> GatherLayout:
        key = tuple(sp.index for sp in params)
        layout = self._layouts.get(key)
        if layout is None:
            layout = GatherLayout.build(params)
            self._layouts[key] = layout
        return layout

    def refresh(self, params: Sequence[ShardedParam], at: Moment) -> None:
        """Re-assemble whole parameters from their (updated) shards in one gather.

        After an optimizer step the parameters that are whole on this rank (persistent
        ones, and gathered ones held across the step) hold stale values. They are
        gathered again like any fetch — fingerprinted, pooled, traced — but counted as
        a refresh; the live-parameter accounting does not change, since they were
        whole before and are whole after.
        """
        if not params:
            return
        layout = self._layout(sorted(params, key=lambda sp: sp.index))
        verify = self._announce(OpKind.REFRESH, [(GATHERED_PARAMETERS, layout)], at)
        handle = GatherHandle(
            self.comm,
            layout,
            GATHERED_PARAMETERS,
            self.describe,
            None,
            self.pool,
            kind="refresh",
            step=at.step,
            issued_us=self._now(),
            verify=verify,
        )
        self._finish(handle)
        self.verify_gathers()
        stats = self.stats.current
        stats.refresh_gathers += 1
        stats.refresh_bytes += layout.chunk_bytes * self.comm.world_size

    def _prefetch(self, position: int, at: Moment) -> None:
        # A prefetch leaves the in-flight count when a fetch consumes it, never when the
        # network happens to finish it: every decision that issues a collective must be
        # the same on every rank, and completion timing is not.
        while self._inflight and all(h.finished for h in self._inflight[0]):
            self._inflight.popleft()
        if sum(1 for hs in self._inflight if not all(h.finished for h in hs)) >= (
            MAX_INFLIGHT_PREFETCHES
        ):
            return
        if self.live_numel >= self._sharded_numel:
            return  # everything is gathered already (a window as large as the model)
        live = self.live_numel - self._kept_numel
        budget = min(self.window.prefetch_numel, self.window.live_numel - live)
        room = None if self.cap_bytes is None else self.cap_bytes - self.live_bytes
        trace = self.trace
        order = trace.param_order
        # Scan from the next fetch on, in trace order. An entry already whole is skipped
        # when it is its parameter's next use; a *later* use of a parameter that is whole
        # now may or may not find it released by then, so the scan stops there rather
        # than reach past it for far-away entries that would sit in the in-flight slots.
        start = trace.first_entry_at[position + 1]
        j = start
        chosen: dict[int, tuple[ShardedParam, int]] = {}
        total = 0
        while j < len(order) and budget > 0:
            entry_position, sp = order[j]
            j += 1
            if sp.index in chosen:
                continue
            if sp.status is not ParamStatus.NOT_AVAILABLE:
                if trace.previous_use[j - 1] >= start:
                    break
                continue
            if total + sp.numel > budget:
                break
            if room is not None:
                room -= sp.numel * sp.itemsize
                if room < 0:
                    break
            chosen[sp.index] = (sp, entry_position)
            total += sp.numel
        if not chosen:
            return
        pieces = [
            (trace.modules[first], piece)
            for first, piece in cut_at_modules(
                list(chosen.values()),
                self.window.chunk_numel if self.config.overlap_comm else None,
            )
        ]
        verify = self._announce(OpKind.PREFETCH, [(m, self._layout(p)) for m, p in pieces], at)
        handles = [
            self._issue(piece, module, at, prefetch=True, verify=verify) for module, piece in pieces
        ]
        if self.config.overlap_comm:
            self._inflight.append(handles)

    def read_ahead(self, position: int) -> None:
        """Start reading offloaded shards (``offload_param``) that the trace gathers
        after fetch ``position`` (-1: from the step's start), past what is gathered or
        in flight already; the shard home bounds how many reads are in flight.
        """
        home, trace = self.shard_home, self.trace
        if home is None or trace.state is not TraceState.COMPLETE or self.diverged:
            return
        order = trace.param_order
        start = trace.first_entry_at[min(position + 1, len(trace.first_entry_at) - 1)]
        # The shards of one prefetch, or of one fetch unit where a prefetch is smaller
        # (the next gather takes a whole unit then): what it takes is read by then.
        window = max(self.window.prefetch_numel, self.window.unit_numel)
        limit = max(1, window // self.comm.world_size)
        upcoming = (sp for _, sp in order[start:] if sp.status is ParamStatus.NOT_AVAILABLE)
        home.read_ahead(upcoming, limit)

    def _release(self, sp: ShardedParam) -> None:
        if self._kept_frozen.pop(sp.index, None) is not None:
            self._kept_numel -= sp.numel
        if sp.persistent or sp.pinned:
            return
        handle = self._gathering.get(sp.index)
        if handle is not None:
            self._finish(handle)
        if sp.status is ParamStatus.AVAILABLE:
            self._keep_edit(sp)
            free_full(sp.param, self.pool)
            sp.set_status(ParamStatus.NOT_AVAILABLE)
            self.live_numel -= sp.numel
            self.live_bytes -= sp.numel * sp.itemsize
        self._prefetched.discard(sp.index)

    def _keep_edit(self, sp: ShardedParam) -> None:
        """An in-place edit of a whole parameter must outlive its release: keep a copy
        until the model state merges it into the shards (ShardedModelState.synchronize).
        """
        if sp.param._version != sp.version and not sp.aliases_param:
            self.edits[sp.index] = sp.param.detach().clone()
            sp.version = sp.param._version

    def _reapply_edit(self, sp: ShardedParam) -> None:
        """A parameter gathered again before its edit was merged shows the edit (this
        rank keeps seeing what it wrote, as in plain PyTorch).
        """
        kept = self.edits.get(sp.index)
        if kept is not None:
            write_full(sp.param, kept.reshape(-1))
