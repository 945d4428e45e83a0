"""What a ``zero3.hooks.unsharded`` block gathers, and which hooks it can do without.

Note (the hooks go with the gathers):
    With every parameter gathered but the hooks installed, a tiny GPT-2 generated 2-4x
    slower than unsharded; without them at its speed (:ref:`fact-generate-hook-cost`).
    So a block takes out the forward hooks of every module whose parameters it keeps.

Note (a budget):
    With ``max_bytes`` a block keeps a prefix of the trace order within ``cap`` (the
    budget less the widest module's fetch beyond its largest parameter); the other
    modules gather per use, prefetching within ``cap``, releasing on exit. The bound
    and its one exception: docs/generation.rst, "The memory budget".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from zero3.core.params._coordinator import ParamCoordinator
from zero3.core.params._params import ShardedParam
from zero3.core.params._trace import TraceState

__all__ = ["UnshardedPlan", "chunks", "plan_unsharded", "trace_order"]


@dataclasses.dataclass(frozen=True)
class UnshardedPlan:
    """What one ``unsharded`` block gathers and which modules' hooks it takes out.

    Attributes:
        pinned: The parameters it keeps gathered until it exits.
        bypass: Indices of the modules whose forward needs nothing from zero3 inside
            the block (every parameter they gather is pinned).
        complete: Every sharded parameter is pinned (no hook is needed at all).
        cap_bytes: The bound on gathered bytes for per-use gathers (None: complete).
        max_bytes: The budget the block was given (None: everything).
    """

    pinned: tuple[ShardedParam, ...]
    bypass: frozenset[int]
    complete: bool
    cap_bytes: int | None
    max_bytes: int | None


def _nbytes(sp: ShardedParam) -> int:
    return sp.numel * sp.itemsize


def trace_order(
    coordinator: ParamCoordinator, params: Sequence[ShardedParam]
) -> list[ShardedParam]:
    """The sharded (non-persistent) parameters in the order forwards use them: the
    inference trace's, else the training trace's, then any the traces do not hold in
    ``named_parameters()`` order (a model that never ran: registration order).
    """
    used: list[ShardedParam] = []
    for kind in ("infer", "train"):
        trace = coordinator.traces[kind]
        if trace.state is TraceState.COMPLETE:
            used = [sp for _, sp in trace.param_order]
            break
    seen: dict[int, ShardedParam] = {}
    for sp in (*used, *params):
        if not sp.persistent:
            seen.setdefault(sp.index, sp)
    return list(seen.values())


def plan_unsharded(
    coordinator: ParamCoordinator, params: Sequence[ShardedParam], max_bytes: int | None
) -> UnshardedPlan:
    """Choose what a block keeps gathered (see the module Note "a budget")."""
    order = trace_order(coordinator, params)
    hooked = coordinator.hooked_modules()
    cap: int | None = None
    if max_bytes is None:
        pinned = order
    else:
        largest = max((_nbytes(sp) for sp in order), default=0)
        widest = max((sum(map(_nbytes, coordinator.fetch_set(i))) for i in hooked), default=0)
        cap = max(0, max_bytes - max(0, widest - largest))
        pinned, total = [], 0
        for sp in order:
            total += _nbytes(sp)
            if total > cap:
                break
            pinned.append(sp)
    complete = len(pinned) == len(order)
    kept = {sp.index for sp in pinned}
    if complete:  # every module, those inside leaves too (their parameter-read dicts)
        bypass = set(range(len(coordinator.names)))
    else:
        bypass = {i for i in hooked if all(sp.index in kept for sp in coordinator.fetch_set(i))}
        bypass.discard(0)  # the root keeps its hooks: one step per forward, not per module
    cap_bytes = None if complete else cap
    return UnshardedPlan(tuple(pinned), frozenset(bypass), complete, cap_bytes, max_bytes)


def chunks(params: Sequence[ShardedParam], numel: int) -> list[list[ShardedParam]]:
    """``params`` cut into runs of at most ``numel`` elements (one parameter at least)."""
    out: list[list[ShardedParam]] = []
    size = 0
    for sp in params:
        if not out or size + sp.numel > numel:
            out.append([])
            size = 0
        out[-1].append(sp)
        size += sp.numel
    return out
