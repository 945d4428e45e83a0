"""Keeping ranks consistent: the same model at ``shard_module``, edits and buffers after.

Every later collective assumes identical models, so ``shard_module`` first compares a
digest of the configuration and every parameter across ranks and raises on every rank
naming the differences. In-place edits of whole parameters (seen by their version
counters) are merged into the shards and masters at each synchronisation point, each
element taking a value some rank wrote; rank 0's persistent buffers win, as under DDP.
The rules and why: docs/architecture.rst, "Keeping ranks consistent".
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zero3.comm import CommBackend, ReduceOp
from zero3.core.config._config import Zero3Config
from zero3.core.diag._guard import (
    CollectiveGuard,
    FingerprintMismatchError,
    Moment,
    Op,
    OpKind,
    Phase,
    waiting_for,
)
from zero3.core.diag._stats import StatsBook
from zero3.core.params._broadcast import broadcast_from_rank0
from zero3.core.params._coordinator import ParamCoordinator
from zero3.core.params._params import ParamStatus, ShardedParam

__all__ = [
    "ModelSync",
    "check_same_model",
    "describe_model",
    "persistent_buffers",
    "whole",
]

#: Configuration fields that may differ between ranks without harm.
_LOCAL_FIELDS = frozenset({"extras", "timeout_s"})
_MAX_DIFFERENCES = 5


def describe_model(
    module: nn.Module, config: Zero3Config, marked: Callable[[nn.Module], bool]
) -> list[str]:
    """``key=value`` lines describing what every rank must agree on."""
    lines = []
    for field in dataclasses.fields(config):
        if field.name not in _LOCAL_FIELDS:
            lines.append(f"Zero3Config.{field.name}={getattr(config, field.name)!r}")
    for name, param in module.named_parameters():
        lines.append(
            f"parameter {name!r}=shape {tuple(param.shape)}, {param.dtype}, "
            f"{'trainable' if param.requires_grad else 'frozen'}"
        )
    for name, sub in module.named_modules():
        if marked(sub):
            lines.append(f"leaf module {name or '<root>'!r}=marked")
    return lines


_SHARD_TITLE = (
    "zero3: shard_module: the ranks sharded different models or configurations "
    "(every rank must build the same model and pass the same Zero3Config):"
)


def check_same_model(
    guard: CollectiveGuard,
    lines: Sequence[str],
    kind: OpKind = OpKind.CHECK,
    title: str = _SHARD_TITLE,
) -> None:
    """Raise on every rank if any rank described a different model (see the Note).

    ``kind`` and ``title`` name the check in headers and in the error (the model at
    ``shard_module``, or the parameters added after it).
    """
    if not guard.active:
        return
    text = "\n".join(lines).encode()
    digest = int.from_bytes(hashlib.sha256(text).digest()[:7], "big")
    try:
        guard.check(Op(kind, params=digest, nbytes=len(text)))
    except FingerprintMismatchError:
        assert guard.channel is not None
        descriptions = _exchange_text(guard.channel, text)
        raise FingerprintMismatchError(_differences(descriptions, title)) from None


def _exchange_text(channel: CommBackend, text: bytes) -> list[str]:
    """Every rank's text, on every rank (lengths first: the sizes differ)."""
    world = channel.world_size
    sizes = torch.empty(world, dtype=torch.int64)
    channel.all_gather(sizes, torch.tensor([len(text)], dtype=torch.int64)).wait()
    longest = int(sizes.max())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    out = torch.empty(world * longest, dtype=torch.uint8)
    channel.all_gather(out, mine).wait()
    rows = out.view(world, longest)
    return [bytes(rows[r, : int(sizes[r])].tolist()).decode() for r in range(world)]


def _differences(descriptions: list[str], title: str) -> str:
    parsed = [dict(line.split("=", 1) for line in text.splitlines()) for text in descriptions]
    keys = list(dict.fromkeys(k for p in parsed for k in p))
    found = []
    for key in keys:
        values = [p.get(key, "(absent)") for p in parsed]
        if len(set(values)) > 1:
            each = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            found.append(f"  {key}: {each}")
    shown = found[:_MAX_DIFFERENCES]
    if len(found) > len(shown):
        shown.append(f"  ... and {len(found) - len(shown)} more")
    return title + "\n" + "\n".join(shown)


def persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Every real (non-meta) buffer that ``state_dict`` saves, in a deterministic order."""
    found = []
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and name not in sub._non_persistent_buffers_set:
                found.append(buf)
    return found


class ModelSync:
    """Merges in-place edits and rank 0's buffers at synchronisation points (the Notes).

    Args:
        module: The root module (its buffers).
        params: Every sharded parameter.
        comm: The parameter backend.
        guard: Headers before the collectives.
        coordinator: Keeps released parameters' edits; refreshes whole copies.
        stats: Where the collective is counted.
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[ShardedParam],
        comm: CommBackend,
        guard: CollectiveGuard,
        coordinator: ParamCoordinator,
        stats: StatsBook,
    ) -> None:
        self.module = module
        self.stats = stats
        self.params = params
        self.comm = comm
        self.guard = guard
        self.coordinator = coordinator

    def synchronize(self, step: int) -> None:
        """Merge every rank's edits of whole parameters into the shards and masters, and
        give every rank rank 0's buffers. A collective (``step``: for the header).
        """
        if self.comm.world_size == 1:
            self._write_own_edits()
            return
        edited = self._edits()
        n = len(self.params)
        # The header carries this rank's count of edits: where no rank edited (every
        # inference step that only reads), the per-parameter flags are not exchanged.
        counts = self.guard.tally(Op(OpKind.SYNC, step, 0, -1, n), len(edited))
        flagged: list[ShardedParam] = []
        with waiting_for(
            lambda: f"rank {self.comm.rank} timed out synchronising step {step}",
            rank=self.comm.rank,
            during=lambda: f"the synchronisation of edits and buffers at step {step}",
            after=self.guard.last_words,
        ):
            if not self.guard.active or any(counts):
                flagged = self._flagged(edited)
            for sp in flagged:
                self._merge(sp, edited.get(sp.index))
            buffers = persistent_buffers(self.module)
            if buffers:
                broadcast_from_rank0(self.comm, buffers)
        self.coordinator.edits.clear()
        for sp in flagged:
            sp.version = sp.param._version
        refresh = [sp for sp in flagged if whole(sp) and not sp.aliases_param]
        self.coordinator.refresh(refresh, Moment(step, Phase.BETWEEN))
        self.stats.current.other_collectives += 1

    def _edits(self) -> dict[int, torch.Tensor | None]:
        """This rank's edits of whole parameters not yet in their shards, by index: kept
        when the parameter was released, or read from the parameter whole now.
        """
        edited: dict[int, torch.Tensor | None] = dict(self.coordinator.edits)
        for sp in self.params:
            if whole(sp) and sp.param._version != sp.version and not sp.aliases_param:
                edited[sp.index] = sp.param.detach()
        return edited

    def _write_own_edits(self) -> None:
        """A world of one: its edits are the values (no buffers to share, nothing to
        merge); only parameter offload keeps shards apart from the parameters.
        """
        if all(sp.aliases_param for sp in self.params):
            return
        for index, values in self._edits().items():
            sp = self.params[index]
            assert values is not None
            sp.write_local(values.reshape(-1)[: sp.local_numel])
            sp.version = sp.param._version
        self.coordinator.edits.clear()

    def _flagged(self, edited: dict[int, torch.Tensor | None]) -> list[ShardedParam]:
        """The parameters some rank edited (a collective: one flag per parameter)."""
        flags = torch.zeros(len(self.params), dtype=torch.uint8)
        for index in edited:
            flags[index] = 1
        on_device = flags.to(self.comm.device())
        self.comm.all_reduce(on_device, op=ReduceOp.MAX).wait()
        return [self.params[int(i)] for i in torch.nonzero(on_device.cpu()).flatten()]

    def _merge(self, sp: ShardedParam, mine: torch.Tensor | None) -> None:
        """Merge every rank's edit of one parameter into its shard (a collective).

        ``mine``: this rank's edited whole values, None where this rank did not edit it.
        """
        comm = self.comm
        world = comm.world_size
        orig = torch.empty(sp.padded_numel, dtype=sp.dtype, device=sp.device)
        comm.all_gather(orig, sp.shard.contiguous()).wait()
        # Rank-major [values | written] per destination rank; MAX over ranks keeps, for
        # each element, the largest value any rank wrote and whether anyone wrote it.
        values = torch.full((sp.padded_numel,), float("-inf"), device=orig.device)
        written = torch.zeros(sp.padded_numel, device=orig.device)
        if mine is not None:
            padded = torch.zeros_like(orig)
            padded[: sp.numel] = mine.reshape(-1)
            changed = padded != orig
            values[changed] = padded[changed].float()
            written[changed] = 1.0
        contrib = torch.stack([values.view(world, -1), written.view(world, -1)], dim=1)
        out = torch.empty(2, sp.shard_numel, dtype=torch.float32, device=orig.device)
        comm.reduce_scatter(out.view(-1), contrib.reshape(-1), op=ReduceOp.MAX).wait()
        local = sp.local_numel
        keep = sp.shard[:local].float()
        merged = torch.where(out[1, :local] > 0, out[0, :local], keep)
        sp.write_local(merged.to(sp.dtype))


def whole(sp: ShardedParam) -> bool:
    """Whether ``sp`` is whole on this rank (so its edits are visible in place)."""
    return sp.persistent or sp.status is ParamStatus.AVAILABLE
