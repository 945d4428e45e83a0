"""Keeping ranks consistent: the same model at ``shard_module``, edits and buffers after.

Note (the same model on every rank):
    Every later collective assumes the ranks sharded identical models with identical
    settings: the bucket plan, the gather layouts and their sizes all follow from them.
    ``shard_module`` therefore first compares a digest of the configuration and of
    every parameter (name, shape, dtype, trainable), leaf marking and registered
    external parameter across ranks, before any collective whose size depends on
    them. On a mismatch the ranks exchange their descriptions and every rank raises an
    error naming the first differences (which field or parameter, each rank's value).

Note (in-place edits of whole parameters):
    A parameter that is whole on a rank — persistent, gathered for a module, or inside
    ``gathered_parameters`` — can be edited in place: ``nn.Embedding(max_norm=...)``
    renormalises the rows it looks up during forward, code re-initialises weights after
    sharding, a user scales a bias between steps. Without care the edit would live only
    in that rank's temporary copy and vanish at the next release or refresh. zero3
    detects edits by the parameter's autograd version counter (its own fills swap
    storages and never move it; ``param.data`` edits bypass the counter and are not
    seen), keeps a copy of an edited parameter that is released, and at the next
    synchronisation point (the end of every step, the optimizer's step and
    construction, state dicts) merges every rank's edits into the shards and the fp32
    masters: each element takes the value a rank wrote to it; where several ranks
    wrote the same element, the largest written value (a written value, never a sum or
    a mean). Whole copies are then refreshed, so every rank sees the merged parameter.

Note (buffers):
    Buffers are not sharded: each rank keeps its own. Like DDP (``broadcast_buffers``),
    zero3 makes rank 0's buffers win: at every synchronisation point rank 0's
    persistent buffers (those ``state_dict`` saves) are broadcast, so running
    statistics (BatchNorm) are identical on every rank and ``full_state_dict`` returns
    the same buffers everywhere. All of them, every time: BatchNorm updates its running
    statistics inside its kernel without moving their version counters, so changes
    cannot be detected. Non-persistent buffers (causal masks, rotary frequencies) are
    computed by the model itself and are left alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zero3.comm import CommBackend, ReduceOp
from zero3.core._config import Zero3Config
from zero3.core._gather import FingerprintMismatchError
from zero3.core._guard import CollectiveGuard, Op, OpKind
from zero3.core._params import ParamStatus, ShardedParam

if TYPE_CHECKING:
    from zero3.core._state import ShardedModelState

__all__ = [
    "check_same_model",
    "describe_model",
    "merge_edits",
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


def check_same_model(guard: CollectiveGuard, lines: Sequence[str]) -> None:
    """Raise on every rank if any rank described a different model (see the Note)."""
    if not guard.active:
        return
    text = "\n".join(lines).encode()
    digest = int.from_bytes(hashlib.sha256(text).digest()[:7], "big")
    try:
        guard.check(Op(OpKind.CHECK, params=digest, nbytes=len(text)))
    except FingerprintMismatchError:
        assert guard.channel is not None
        descriptions = _exchange_text(guard.channel, text)
        raise FingerprintMismatchError(_differences(descriptions)) from None


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


def _differences(descriptions: list[str]) -> str:
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
    return (
        "zero3: shard_module: the ranks sharded different models or configurations "
        "(every rank must build the same model and pass the same Zero3Config):\n" + "\n".join(shown)
    )


def persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Every real (non-meta) buffer that ``state_dict`` saves, in a deterministic order."""
    found = []
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and name not in sub._non_persistent_buffers_set:
                found.append(buf)
    return found


def merge_edits(
    state: ShardedModelState, edited: dict[int, torch.Tensor | None], flagged: list[ShardedParam]
) -> None:
    """Merge every rank's edits of ``flagged`` parameters into their shards (the Note).

    ``edited`` maps a parameter index to this rank's edited whole values (None where
    this rank did not edit it). A collective: every rank passes the same ``flagged``.
    """
    comm = state.comm
    world = comm.world_size
    for sp in flagged:
        orig = torch.empty(sp.padded_numel, dtype=sp.dtype, device=sp.shard.device)
        comm.all_gather(orig, sp.shard.contiguous()).wait()
        # Rank-major [values | written] per destination rank; MAX over ranks keeps, for
        # each element, the largest value any rank wrote and whether anyone wrote it.
        values = torch.full((sp.padded_numel,), float("-inf"), device=orig.device)
        written = torch.zeros(sp.padded_numel, device=orig.device)
        mine = edited.get(sp.index)
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
        state.write_local(sp, merged.to(sp.dtype))


def whole(sp: ShardedParam) -> bool:
    """Whether ``sp`` is whole on this rank (so its edits are visible in place)."""
    return sp.persistent or sp.status is ParamStatus.AVAILABLE
