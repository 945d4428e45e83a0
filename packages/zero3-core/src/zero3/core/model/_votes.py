"""``generate``'s stopping vote: whether every rank has finished, cast once per decoding
step through zero3's own comm.

Note (votes left in flight):
    A rank still generating knows the answer ("no"): it casts its vote and returns,
    leaving up to ``VOTES_IN_FLIGHT`` in flight; a rank that is done waits for all of its
    votes. The answer is "yes" only when every rank voted done, and then every rank
    waited for that vote, so all decide alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero3.comm import CommBackend, ReduceOp
from zero3.core.diag._guard import CollectiveGuard, Op, OpKind, waiting_for
from zero3.core.diag._stats import StatsBook
from zero3.core.model._step import TrainingStep

__all__ = ["VOTES_IN_FLIGHT", "StopVotes"]

#: Votes a rank still generating may leave in flight.
VOTES_IN_FLIGHT = 4


class StopVotes:
    """The ranks' votes on stopping generation (see the module Note).

    Args:
        comm: The model's comm backend (the vote is a one-element all-reduce on it).
        guard: The collective guard; when active it carries the vote in its header.
        step: The model's step (its number and phase label the vote for the guard).
        stats: Where the vote is counted (``other_collectives``).
    """

    def __init__(
        self, comm: CommBackend, guard: CollectiveGuard, step: TrainingStep, stats: StatsBook
    ) -> None:
        self._comm = comm
        self._guard = guard
        self._step = step
        self._stats = stats
        self._ballots: list[Callable[[], bool]] = []  # votes left in flight

    def all_finished(self, done: bool) -> bool:
        """Whether every rank is ``done``: a collective every rank casts once per
        decoding step.
        """
        if self._comm.world_size == 1:
            return done
        ballot = self._cast(done)
        self._stats.current.other_collectives += 1
        if not done:
            self._ballots.append(ballot)
            while len(self._ballots) > VOTES_IN_FLIGHT:
                self._ballots.pop(0)()
            return False
        self.settle()
        return ballot()

    def settle(self) -> None:
        """Wait for (and check) the votes :meth:`all_finished` left in flight."""
        ballots, self._ballots = self._ballots, []
        for ballot in ballots:
            ballot()

    def _cast(self, done: bool) -> Callable[[], bool]:
        if self._guard.active:
            op = Op(OpKind.VOTE, self._step.number, int(self._step.moment().phase))
            ballot = self._guard.cast(op, int(done))
            return lambda: all(ballot.result())
        comm = self._comm
        flag = torch.tensor([1.0 if done else 0.0], device=comm.device())
        work = comm.all_reduce(flag, op=ReduceOp.SUM)

        def result() -> bool:
            with waiting_for(lambda: f"rank {comm.rank} timed out in generate's vote"):
                work.wait()
            return float(flag.item()) == comm.world_size

        return result
