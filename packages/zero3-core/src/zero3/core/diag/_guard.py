"""Headers before size-dependent collectives: ranks that disagree fail in Python, at once.

Ranks running different code pair collectives of different sizes, which nothing inside the
bytes can catch (gloo aborts a process without a traceback, NCCL may hang). So before such
a collective every rank exchanges a fixed-size header on a host channel of its own and
proceeds only if all agree; otherwise every rank raises, naming each rank's operation and
the likely cause. A timeout names what this rank waited for and the last operation every
rank completed together. docs/architecture.rst, "The collective guard".
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from zero3.comm import CommBackend, CommTimeoutError, PeerGoneError, Work

__all__ = [
    "Ballot",
    "CollectiveGuard",
    "FingerprintMismatchError",
    "Moment",
    "Op",
    "OpKind",
    "Phase",
    "waiting_for",
]

_MAGIC = 0x5A33_4844  # "Z3HD"
_WORDS = 5


class FingerprintMismatchError(RuntimeError):
    """Ranks entered different collectives, or gathered different parameters in one."""


class OpKind(enum.IntEnum):
    """What a guarded collective is for."""

    CHECK = 1  #: comparing the model and configuration at ``shard_module``
    FETCH = 2  #: gathering a module's parameters where it runs
    PREFETCH = 3  #: gathering parameters ahead of use
    GATHERED = 4  #: ``gathered_parameters`` (also full state dicts, loading)
    REFRESH = 5  #: re-assembling whole parameters after an optimizer step
    SYNC = 6  #: merging in-place edits and rank 0's buffers
    FULL_GRAD = 7  #: ``full_grad``
    LOAD = 8  #: ``load_full_state_dict``
    VOTE = 9  #: a vote every rank casts (``generate``'s "all ranks finished?")
    ADOPT = 10  #: comparing parameters and modules added after ``shard_module``

    def describe(self) -> str:
        """Words for messages."""
        return {
            OpKind.CHECK: "compared the model at shard_module",
            OpKind.FETCH: "gathered a module's parameters",
            OpKind.PREFETCH: "prefetched parameters",
            OpKind.GATHERED: "gathered parameters outside forward/backward "
            "(gathered_parameters, full_state_dict, unsharded, iter_full_parameters)",
            OpKind.REFRESH: "refreshed whole parameters after an optimizer step",
            OpKind.SYNC: "synchronised edits and buffers at the end of a step",
            OpKind.FULL_GRAD: "called full_grad",
            OpKind.LOAD: "called load_full_state_dict",
            OpKind.VOTE: "voted whether every rank finished generating (generate)",
            OpKind.ADOPT: "adopted parameters added to the model after shard_module",
        }[self]


class Phase(enum.IntEnum):
    """Where in a step a rank is (carried in every header)."""

    BETWEEN = 0  #: no step is open
    TRAIN_FORWARD = 1  #: the forward of a training step
    BACKWARD = 2  #: a backward
    INFER_FORWARD = 3  #: the forward of an inference step (grad disabled)

    def describe(self) -> str:
        """Words for messages."""
        return _PHASE_WORDS[self]


_PHASE_WORDS = {
    Phase.BETWEEN: "between steps",
    Phase.TRAIN_FORWARD: "training forward",
    Phase.BACKWARD: "backward",
    Phase.INFER_FORWARD: "inference forward",
}


class Moment(NamedTuple):
    """When a collective is issued: the step (steps begun so far) and the phase in it."""

    step: int
    phase: Phase

    @property
    def forward(self) -> bool:
        """Whether parameters are gathered for a forward (not for a backward)."""
        return self.phase is not Phase.BACKWARD


@dataclasses.dataclass(frozen=True)
class Op:
    """One rank's description of the collective it is about to issue.

    Attributes:
        kind: What it is for.
        step: Steps begun so far on this rank (forward passes that opened one).
        phase: 0 outside a step, 1 training forward, 2 backward, 3 inference forward.
        module: Module index (-1: none).
        params: Checksum of the parameter indices (or of the model description).
        nbytes: Bytes this rank contributes.
    """

    kind: OpKind
    step: int = 0
    phase: int = 0
    module: int = -1
    params: int = 0
    nbytes: int = 0

    def encode(self) -> torch.Tensor:
        """The header as five int64 words."""
        head = (_MAGIC << 32) | (int(self.kind) << 8) | self.phase
        words = [head, self.step, self.module, self.params, self.nbytes]
        return torch.tensor(words, dtype=torch.int64)

    @classmethod
    def decode(cls, words: list[int]) -> Op | None:
        """The header back, or None if the words are not a zero3 header."""
        if words[0] >> 32 != _MAGIC:
            return None
        try:
            kind = OpKind((words[0] >> 8) & 0xFF)
        except ValueError:
            return None
        return cls(kind, words[1], words[0] & 0xFF, words[2], words[3], words[4])


@contextlib.contextmanager
def waiting_for(
    what: Callable[[], str],
    *,
    rank: int | None = None,
    during: Callable[[], str] | None = None,
    after: Callable[[], str] | None = None,
) -> Iterator[None]:
    """Re-raise comm failures inside the block saying what this rank was doing.

    Args:
        what: For a timeout: what this rank waited for (a sentence that starts with
            the rank, "rank 0 timed out ...").
        rank: This rank (for a lost peer's message).
        during: For a peer that is gone: the zero3 operation and step this rank was
            in (default: ``what()``).
        after: What every rank completed together (the guard's last agreed operation).
    """
    try:
        yield
    except CommTimeoutError as exc:
        raise CommTimeoutError(f"zero3: {what()}: {exc}") from exc
    except PeerGoneError as exc:
        doing = during() if during is not None else what()
        here = f"rank {rank}" if rank is not None else "this rank"
        known = f" ({after()})" if after is not None else ""
        raise PeerGoneError(
            f"zero3: {exc.who()}, while {here} waited for it in {doing}. Every rank must run "
            "the same zero3 operations to the end: a rank that saves (or evaluates) on rank "
            "0 only, has fewer batches, or leaves the loop early leaves the others "
            f"waiting{known}. [{exc.transport}]",
            exc.gone,
            exc.transport,
        ) from exc


class CollectiveGuard:
    """Exchanges an :class:`Op` header before each size-dependent collective.

    Args:
        channel: A host channel over the same ranks (None: no headers; the in-band
            fingerprints of gathers are then the only check).
        rank: This rank.
        describe_module: Module index → qualified name.
    """

    def __init__(
        self, channel: CommBackend | None, rank: int, describe_module: Callable[[int], str]
    ) -> None:
        self.channel = channel
        self.rank = rank
        self._describe_module = describe_module
        #: The last operation every rank announced identically; None before the first.
        self.last_agreed: Op | None = None
        self.exchanges = 0

    @property
    def active(self) -> bool:
        """Whether headers are exchanged."""
        return self.channel is not None and self.channel.world_size > 1

    def describe(self, op: Op) -> str:
        """One line for messages."""
        text = f"{op.kind.describe()}"
        if op.module >= 0:
            text += f" for module {self._describe_module(op.module)!r}"
        text += f" ({op.nbytes} bytes per rank; step {op.step}, {_phase_words(op.phase)})"
        return text

    def last_words(self) -> str:
        """What every rank is known to have completed together."""
        if self.last_agreed is None:
            return "no zero3 operation was completed by all ranks together yet"
        return "the last operation all ranks completed together: " + self.describe(self.last_agreed)

    def check(self, op: Op) -> None:
        """Exchange ``op`` with every rank; raise on every rank if any differs."""
        self._exchange(op, _WORDS)

    def tally(self, op: Op, value: int) -> list[int]:
        """Exchange ``op`` carrying this rank's ``value`` in its ``nbytes`` word: raise
        on every rank if any announced another ``op``; every rank's value otherwise
        (``[value]`` without headers). One header exchange that is also a small
        all-gather, so a collective that only needs to know whether any rank has work
        skips its payload when none has (``ModelSync``: no rank edited).
        """
        rows = self._exchange(dataclasses.replace(op, nbytes=value), _WORDS - 1)
        return [value] if rows is None else [row[-1] for row in rows]

    def _exchange(self, op: Op, compared: int) -> list[list[int]] | None:
        """All-gather ``op``'s header; raise unless every rank's first ``compared``
        words equal; every rank's words (None without headers).
        """
        channel = self.channel
        if channel is None or channel.world_size == 1:
            return None
        mine = op.encode()
        out = torch.empty(channel.world_size * _WORDS, dtype=torch.int64)
        with waiting_for(
            lambda: (
                f"rank {self.rank} timed out before {self.describe(op)}: a peer never "
                f"issued its next zero3 collective ({self.last_words()})"
            ),
            rank=self.rank,
            during=lambda: f"this zero3 operation: {self.describe(op)}",
            after=self.last_words,
        ):
            channel.all_gather(out, mine).wait()
        self.exchanges += 1
        rows = out.view(channel.world_size, _WORDS).tolist()
        if all(row[:compared] == rows[0][:compared] for row in rows):
            self.last_agreed = op
            return rows
        raise FingerprintMismatchError(self._explain(rows))

    def cast(self, op: Op, value: int) -> Ballot:
        """Start exchanging ``op`` carrying this rank's ``value`` (in its ``nbytes``
        word); :meth:`Ballot.result` waits for every rank's value and checks that all
        ranks announced the same ``op`` otherwise.

        One small host collective that is both the vote and its header, so a rank that
        votes while a peer issues another zero3 collective fails, as :meth:`check` does.
        The caller must know the guard is :attr:`active`.
        """
        channel = self.channel
        assert channel is not None
        out = torch.empty(channel.world_size * _WORDS, dtype=torch.int64)
        work = channel.all_gather(out, dataclasses.replace(op, nbytes=value).encode())
        self.exchanges += 1
        return Ballot(self, op, work, out)

    def _explain(self, rows: list[list[int]]) -> str:
        ops = [Op.decode(row) for row in rows]
        lines = []
        for rank, other in enumerate(ops):
            text = (
                "sent something that is not a zero3 header"
                if other is None
                else (self.describe(other))
            )
            lines.append(f"  rank {rank}: {text}")
        return (
            "zero3: ranks are about to issue different collectives:\n"
            + "\n".join(lines)
            + f"\nLikely cause: {_likely_cause([o for o in ops if o is not None])}\n"
            + f"({self.last_words()}.)"
        )


class Ballot:
    """A vote in flight (:meth:`CollectiveGuard.cast`)."""

    def __init__(self, guard: CollectiveGuard, op: Op, work: Work, out: torch.Tensor) -> None:
        self._guard = guard
        self._op = op
        self._work = work
        self._out = out

    def result(self) -> list[int]:
        """Every rank's value, once all ranks voted.

        Raises:
            FingerprintMismatchError: A rank announced something else.
        """
        guard = self._guard
        with waiting_for(
            lambda: (
                f"rank {guard.rank} timed out in {guard.describe(self._op)}: a peer never "
                f"issued its next zero3 collective ({guard.last_words()})"
            )
        ):
            self._work.wait()
        rows = self._out.view(-1, _WORDS).tolist()
        if all(row[:4] == rows[0][:4] for row in rows):
            guard.last_agreed = self._op
            return [row[4] for row in rows]
        raise FingerprintMismatchError(guard._explain(rows))


def _likely_cause(ops: list[Op]) -> str:
    """What the headers suggest went wrong (every observation that applies)."""
    kinds = {o.kind for o in ops}
    steps = sorted({o.step for o in ops})
    phases = {o.phase for o in ops}
    modules = {o.module for o in ops}
    causes = []
    if kinds == {OpKind.CHECK}:
        causes.append("the ranks sharded different models or configurations.")
    if OpKind.LOAD in kinds and len(kinds) > 1:
        causes.append(
            "load_full_state_dict was called on some ranks only. It is a collective: "
            "call it on every rank, each with the full state dict (torch.load(..., "
            "mmap=True) keeps that cheap)."
        )
    if kinds & {OpKind.GATHERED, OpKind.FULL_GRAD} and len(kinds) > 1:
        causes.append(
            "a collective helper (full_state_dict, gathered_parameters, full_grad, "
            "unsharded, iter_full_parameters) was called on some ranks only, or a rank "
            "stopped iterating iter_full_parameters early; every rank must call it, in the "
            "same order, and consume the whole iterator."
        )
    if OpKind.VOTE in kinds and len(kinds) > 1:
        causes.append(
            "some ranks are generating (generate syncs every rank after each token) while "
            "others run something else: call generate on every rank."
        )
    if len(steps) > 1:
        causes.append(
            f"the ranks are at different steps ({steps[0]} to {steps[-1]}): uneven numbers "
            "of forward passes (a data loader with more batches on some ranks, or an extra "
            "forward on some ranks only). Every rank must run the same forward passes."
        )
    if {1, 3} <= phases:
        causes.append(
            "some ranks run an inference forward (no_grad/eval) while others train: "
            "evaluation on some ranks only? Every rank must run it."
        )
    if OpKind.SYNC in kinds and len(kinds) > 1:
        causes.append(
            "some ranks stepped the optimizer (or ended an inference step) while others did not."
        )
    if not causes and len(modules) > 1:
        causes.append(
            "the ranks ran different modules at the same point: data-dependent control "
            "flow (e.g. MoE routing that runs different experts). Mark the module that "
            "routes as a leaf (zero3.hooks.set_leaf_modules(model, Cls) or "
            "Zero3Config(leaf_modules=...)) so its whole subtree is gathered on every rank."
        )
    if not causes:
        causes.append("the ranks built or configured the model differently.")
    return " Also: ".join(causes)


def _phase_words(phase: int) -> str:
    return Phase(phase).describe() if phase in {int(p) for p in Phase} else "?"
