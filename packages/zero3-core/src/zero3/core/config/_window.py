"""GatherWindow: how much of a sharded model is gathered at once, sized from the model.

Note (the rule):
    DeepSpeed's absolute defaults (prefetch 5·10⁷ elements, 10⁹ live, reuse 10⁹) keep a
    model of under a billion parameters gathered from forward through backward, so a
    30-60M-parameter model sharded with them held more memory than under DDP. zero3's
    defaults are instead sized from the model when it is sharded, from ``U``, the most
    elements one module fetch gathers (its largest fetch unit: a module's own sharded
    parameters, a leaf's whole subtree), floored at :data:`FLOOR_NUMEL`:

    * ``prefetch_bucket_size = max(U, FLOOR)``: one fetch unit ahead;
    * ``max_live_parameters = 2 · max(prefetch, U, FLOOR)``: the running unit plus one in
      flight (prefetching stops there);
    * ``max_reuse_distance = max(U, FLOOR)``: a unit is kept on exit only if its next
      use is within one unit ahead, which keeps what the turn from forward into
      backward uses again at once (the head, or the last block);
    * ``overlap_chunk_size = min(4_194_304, max(U, FLOOR) // 4)``: the four gradient
      reductions in flight hold at most one unit of bucket buffers.

    Each but the reuse distance (which counts the trace's elements, forward and backward:
    twice the model) is also capped at the model's sharded elements. A value set in
    :class:`~zero3.core.Zero3Config` (or a DeepSpeed config) wins over its rule. The floor
    keeps models whose whole gathered size is a few MiB behaving as before (gathered
    once per step): below it, memory is not worth a collective. What the window
    implies for memory (the bound on gathered bytes, the buffer pool's bound) is on
    :class:`GatherWindow`; docs/configuration.rst, "The gather window", shows the values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from zero3.core.config._config import Zero3Config

__all__ = ["FLOOR_NUMEL", "MAX_CHUNK_NUMEL", "GatherWindow", "resolve_window"]

#: Auto window sizes never go below this many elements (4 MiB of fp32).
FLOOR_NUMEL = 1 << 20
#: Auto ``overlap_chunk_size`` never goes above this (the earlier fixed default).
MAX_CHUNK_NUMEL = 4_194_304
#: Gradient reductions in flight at once (GradReducer's limit): the chunk rule's divisor.
_REDUCTIONS_IN_FLIGHT = 4
#: The window's fields and the Zero3Config field each one resolves.
FIELDS = {
    "prefetch_numel": "prefetch_bucket_size",
    "live_numel": "max_live_parameters",
    "reuse_numel": "max_reuse_distance",
    "chunk_numel": "overlap_chunk_size",
}


@dataclasses.dataclass(frozen=True)
class GatherWindow:
    """The resolved gather window of one sharded model (:func:`resolve_window`).

    Attributes:
        prefetch_numel: Most elements one prefetch gathers (``prefetch_bucket_size``).
        live_numel: Prefetching stops at this many gathered elements
            (``max_live_parameters``).
        reuse_numel: On exit a module keeps parameters the trace uses again within this
            many elements (``max_reuse_distance``).
        chunk_numel: Most elements of one overlapped collective (``overlap_chunk_size``).
        unit_numel: The largest fetch unit's elements (``U`` of the rule).
        sharded_numel: The model's non-persistent (gathered) elements.
        element_size: Bytes per element of the largest gathered dtype.
        world_size: Ranks the model is sharded over.
        shard_bytes: Parameter plus gradient shard bytes this rank holds (the pool's cap).
        auto: The window fields (names as in ``FIELDS``) sized from the model.
    """

    prefetch_numel: int
    live_numel: int
    reuse_numel: int
    chunk_numel: int
    unit_numel: int
    sharded_numel: int
    element_size: int
    world_size: int
    shard_bytes: int
    auto: frozenset[str] = frozenset()

    @property
    def bound_numel(self) -> int:
        """The most elements gathered at once during a step.

        What prefetching may reach, plus the kept reuse window and the unit running (and
        one more unit for a parameter that crosses a bound), never more than the model.
        """
        return min(self.sharded_numel, self.live_numel + self.reuse_numel + 2 * self.unit_numel)

    @property
    def bound_bytes(self) -> int:
        """:attr:`bound_numel` in bytes."""
        return self.bound_numel * self.element_size

    @property
    def pool_bytes(self) -> int:
        """The buffer pool's bound, in bytes.

        The receive buffers of two prefetch windows (each the largest fetch unit at least)
        and one send buffer (``1/N`` of a window), never more than the parameter and
        gradient shards this rank holds.
        """
        window = max(self.prefetch_numel, self.unit_numel) * self.element_size
        two = 2 * window + window // max(1, self.world_size) + (1 << 20)
        return min(two, self.shard_bytes)

    def describe(self) -> str:
        """One line naming the chosen values (for logs and summaries)."""
        parts = []
        for name, field in FIELDS.items():
            how = "auto" if name in self.auto else "set"
            parts.append(f"{field}={getattr(self, name):,} ({how})")
        mib = 2**20
        return (
            ", ".join(parts)
            + f"; largest fetch unit {self.unit_numel:,} elements; gathered at most "
            f"{self.bound_bytes / mib:.1f} MiB, buffer pool at most {self.pool_bytes / mib:.1f} MiB"
        )


def resolve_window(
    config: Zero3Config,
    unit_numels: Iterable[int],
    *,
    sharded_numel: int,
    element_size: int,
    world_size: int,
    shard_bytes: int,
) -> GatherWindow:
    """The gather window for a model (the rule of the module Note).

    Args:
        config: The model's configuration (its ``None`` window fields are auto).
        unit_numels: The elements each module fetch gathers (fetch units).
        sharded_numel: The model's non-persistent elements.
        element_size: Bytes per gathered element (the largest dtype's).
        world_size: Ranks.
        shard_bytes: Parameter plus gradient shard bytes per rank.
    """
    unit = max((n for n in unit_numels), default=0)
    base = max(unit, FLOOR_NUMEL)
    cap = max(1, sharded_numel)
    auto: set[str] = set()

    def pick(name: str, rule: int, minimum: int = 0, limit: int | None = cap) -> int:
        given = getattr(config, FIELDS[name])
        if given is not None:
            return int(given)
        auto.add(name)
        return max(minimum, rule if limit is None else min(rule, limit))

    prefetch = pick("prefetch_numel", base)
    live = pick("live_numel", 2 * max(prefetch, base))
    # Not capped at the model: the reuse distance counts trace elements, forward and
    # backward (twice the model), so a model under the floor stays whole into backward.
    reuse = pick("reuse_numel", base, limit=None)
    chunk = pick("chunk_numel", min(MAX_CHUNK_NUMEL, base // _REDUCTIONS_IN_FLIGHT), minimum=1)
    return GatherWindow(
        prefetch_numel=prefetch,
        live_numel=live,
        reuse_numel=reuse,
        chunk_numel=chunk,
        unit_numel=unit,
        sharded_numel=sharded_numel,
        element_size=element_size,
        world_size=world_size,
        shard_bytes=shard_bytes,
        auto=frozenset(auto),
    )
