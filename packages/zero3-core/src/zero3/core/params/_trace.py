"""Trace: the module fetch order of one kind of step, recorded once and then followed.

A trace is recorded over one whole step (forward *and* backward for training, forward
only for inference). Once COMPLETE the coordinator (``params._coordinator``) checks each
fetch against it, prefetches in its order and keeps on release what it uses again soon;
a step that departs from it invalidates it (the next step records again).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from zero3.core.params._params import ShardedParam

__all__ = ["Trace", "TraceState"]


class TraceState(enum.Enum):
    """Lifecycle of a trace: INVALID → RECORD → COMPLETE (→ INVALID on a mismatch)."""

    #: No usable order; the next step records one.
    INVALID = "invalid"
    #: The step in progress records its fetch order.
    RECORD = "record"
    #: The order is known. Fetches are checked against it; prefetching and the reuse
    #: window follow it.
    COMPLETE = "complete"


class Trace:
    """Module fetch order of one kind of step, frozen once recorded."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.state = TraceState.INVALID
        self.modules: list[int] = []  # module indices in fetch order
        # Parameter order derived from the module order: (position, param) per use.
        self.param_order: list[tuple[int, ShardedParam]] = []
        self.first_entry_at: list[int] = []  # position -> index into param_order
        self.previous_use: list[int] = []  # entry -> the same parameter's previous entry, or -1
        self._release_cache: dict[tuple[int, int], frozenset[int]] = {}

    def start_recording(self) -> None:
        """Begin recording a fresh order (called at the start of a step)."""
        self._clear()
        self.state = TraceState.RECORD

    def invalidate(self) -> None:
        """Forget the order; the next step records again."""
        self._clear()
        self.state = TraceState.INVALID

    def _clear(self) -> None:
        self.modules = []
        self.param_order = []
        self.first_entry_at = []
        self.previous_use = []
        self._release_cache.clear()

    def record(self, module_index: int) -> None:
        """Append a fetch to the recording."""
        self.modules.append(module_index)

    def expected(self, position: int) -> int | None:
        """The module index expected at ``position``, or None past the end."""
        return self.modules[position] if position < len(self.modules) else None

    def freeze(self, params_of: Callable[[int], Sequence[ShardedParam]]) -> None:
        """Turn the recorded module order into the parameter order; state → COMPLETE."""
        self.param_order = []
        self.first_entry_at = []
        for position, module_index in enumerate(self.modules):
            self.first_entry_at.append(len(self.param_order))
            for sp in params_of(module_index):
                if not sp.persistent:
                    self.param_order.append((position, sp))
        self.first_entry_at.append(len(self.param_order))
        last_seen: dict[int, int] = {}
        self.previous_use = []
        for j, (_, sp) in enumerate(self.param_order):
            self.previous_use.append(last_seen.get(sp.index, -1))
            last_seen[sp.index] = j
        self._release_cache.clear()
        self.state = TraceState.COMPLETE

    def reused_within(self, position: int, module_index: int, window: int) -> frozenset[int]:
        """Indices of parameters used within ``window`` elements from ``position`` on.

        ``position`` is the next fetch to come, so everything from there counts as
        "ahead". Cached: the answer is fixed once the trace is frozen.
        """
        key = (position, module_index)
        cached = self._release_cache.get(key)
        if cached is not None:
            return cached
        kept: set[int] = set()
        traversed = 0
        start = self.first_entry_at[min(position, len(self.first_entry_at) - 1)]
        for _, sp in self.param_order[start:]:
            if traversed >= window:
                break
            kept.add(sp.index)
            traversed += sp.numel
        result = frozenset(kept)
        self._release_cache[key] = result
        return result
