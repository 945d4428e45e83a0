"""Per-step counters: what was gathered, prefetched, reduced, and at what cost."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero3.core.diag._memory import MemoryStats

__all__ = ["StatsBook", "StepStats"]


@dataclasses.dataclass
class StepStats:
    """Counters for one step (forward, backward, and the optimizer step after it).

    Byte counters hold the bytes of the collective *buffers*, split by what the bytes
    are: real parameter/gradient data (``payload``), padding that makes every shard
    the same length, the gather fingerprints, and the got-gradient flags. Each rank
    sends (and receives) ``(N-1)/N`` of a ring collective's buffer; the ``*_wire_bytes``
    properties apply that factor so results compare directly with the theory
    (``3·Ψ·(N-1)/N`` per step with full release).

    Attributes:
        world_size: Ranks in the group (N).
        forward_gathers: Gather collectives issued while running forward.
        backward_gathers: Gather collectives issued while running backward.
        forward_gathered_numel: Parameter elements gathered in forward.
        backward_gathered_numel: Parameter elements gathered in backward.
        gather_payload_bytes: Parameter bytes in gather buffers.
        gather_padding_bytes: Padding bytes in gather buffers.
        gather_fingerprint_bytes: Fingerprint bytes in gather buffers.
        prefetch_gathers: Gathers issued ahead of use by the trace.
        blocking_prefetches: Prefetches waited for at once (``overlap_comm=False``).
        prefetch_hits: Module fetches whose parameters a prefetch had already started.
        prefetch_misses: Module fetches (with a complete trace) that had to gather
            on demand.
        live_numel_high_water: Most gathered non-persistent parameter elements at once.
        trace_invalidations: Times the recorded module order did not match this step.
        reduce_collectives: Gradient reductions issued (one per bucket, more on the
            late path).
        reduce_payload_bytes: Gradient bytes in reduction buffers (twice for the
            all-reduce path: it moves twice the bytes).
        reduce_padding_bytes: Padding bytes in reduction buffers (same factor).
        reduce_fingerprint_bytes: Fingerprint bytes in reduction buffers (same factor).
        grad_flag_bytes: Bytes of the got-gradient flags collective.
        late_reductions: Extra reductions for gradients that arrived after their
            bucket left (reentrant checkpointing).
        refresh_gathers: Persistent-parameter refresh gathers after optimizer steps.
        refresh_bytes: Bytes in those refresh buffers.
        other_collectives: Small collectives outside the above (norms, overflow flags).
        memory: Model-state bytes this rank holds against one unsharded process, the
            gathered-parameter and resident-set peaks (``zero3.hooks.stats`` fills it
            when called; None in the counters the engine keeps).
    """

    world_size: int = 1
    forward_gathers: int = 0
    backward_gathers: int = 0
    forward_gathered_numel: int = 0
    backward_gathered_numel: int = 0
    gather_payload_bytes: int = 0
    gather_padding_bytes: int = 0
    gather_fingerprint_bytes: int = 0
    prefetch_gathers: int = 0
    blocking_prefetches: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    live_numel_high_water: int = 0
    trace_invalidations: int = 0
    reduce_collectives: int = 0
    reduce_payload_bytes: int = 0
    reduce_padding_bytes: int = 0
    reduce_fingerprint_bytes: int = 0
    grad_flag_bytes: int = 0
    late_reductions: int = 0
    refresh_gathers: int = 0
    refresh_bytes: int = 0
    other_collectives: int = 0
    memory: MemoryStats | None = None

    def _wire(self, nbytes: int) -> float:
        return nbytes * (self.world_size - 1) / self.world_size

    @property
    def gathers(self) -> int:
        """All parameter gather collectives of the step (forward + backward)."""
        return self.forward_gathers + self.backward_gathers

    @property
    def gather_wire_bytes(self) -> float:
        """Parameter payload bytes each rank receives through gathers."""
        return self._wire(self.gather_payload_bytes)

    @property
    def reduce_wire_bytes(self) -> float:
        """Gradient payload bytes each rank sends through reductions."""
        return self._wire(self.reduce_payload_bytes)

    @property
    def overhead_wire_bytes(self) -> float:
        """Padding, fingerprint and flag bytes each rank moves on top of the payload."""
        return self._wire(
            self.gather_padding_bytes
            + self.gather_fingerprint_bytes
            + self.reduce_padding_bytes
            + self.reduce_fingerprint_bytes
            + self.grad_flag_bytes
        )

    @property
    def prefetch_hit_rate(self) -> float:
        """Share of traced module fetches served by a prefetch (0 with no such fetch)."""
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 0.0

    def count_gather(
        self, *, forward: bool, numel: int, payload: int, buffer: int, world: int
    ) -> None:
        """Count one gather of ``numel`` elements (``payload`` bytes of them) through a
        ``buffer``-byte chunk per rank (fingerprint included); a world of one fills its
        parameters from their shards, through no buffer.
        """
        if forward:
            self.forward_gathers += 1
            self.forward_gathered_numel += numel
        else:
            self.backward_gathers += 1
            self.backward_gathered_numel += numel
        self.gather_payload_bytes += payload
        if world > 1:
            self.gather_fingerprint_bytes += 16 * world
            self.gather_padding_bytes += buffer * world - payload - 16 * world

    def copy(self) -> StepStats:
        """A snapshot of these counters."""
        return dataclasses.replace(self)


class StatsBook:
    """The counters of the step in progress and of the step before it.

    The coordinator rotates it when a step begins; the gradient reducer and the
    optimizer add to :attr:`current`, so after ``opt.step()`` the current counters
    describe the whole step just taken.

    Attributes:
        world_size: Ranks in the group (copied into every :class:`StepStats`).
        current: Counters of the step in progress (or just finished).
        last: Counters of the step before :attr:`current`.
        total_invalidations: Trace invalidations since the model was sharded.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.current = StepStats(world_size=world_size)
        self.last = StepStats(world_size=world_size)
        self.total_invalidations = 0
        self._peak_live_numel = 0

    @property
    def peak_live_numel(self) -> int:
        """Most gathered non-persistent parameter elements at once since sharding."""
        return max(self._peak_live_numel, self.current.live_numel_high_water)

    def rotate(self) -> None:
        """Start counting a new step."""
        self._peak_live_numel = self.peak_live_numel
        self.last = self.current
        self.current = StepStats(world_size=self.world_size)
