"""Small models that exercise every awkward case of a ZeRO-3 engine.

Each model is tiny (so tests set ``param_persistence_threshold=0`` to shard it) and
deterministic given ``torch.manual_seed``. ``ZOO`` maps a name to a builder returning
``(model, make_input)`` where ``make_input(batch, seed)`` builds an input batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _train.model import Block, GPTConfig, add_gpt_layers, gpt_forward
from torch import nn

from zero3.core import ParamOffloadError
from zero3.core.engine import sharded_state

__all__ = [
    "OPTIMIZERS",
    "ZOO",
    "AlbertLike",
    "BiasReturning",
    "Block",
    "Checkpointed",
    "FrozenAndUnused",
    "MoE",
    "ParentUsesChildWeight",
    "Routed",
    "TinyGPT",
    "build",
    "routed_input",
    "step_past_a_broken_swap",
    "token_batch",
    "train_beside",
]


class TinyGPT(nn.Module):
    """GPT with tied input/output embeddings (one ``nn.Parameter`` in two modules).

    The job's and the benchmarks' GPT (``_train.model``, from zero3-tools: its layers and
    its forward) at a tiny size, in GPT-2's layout: ``wte``, ``wpe``, ``blocks.N.attn``
    and ``blocks.N.mlp`` modules, ``lm_head``, each layer initialised by its own
    ``reset_parameters``. A class of its own, directly under ``nn.Module``, as user
    models are.
    """

    def __init__(
        self, vocab: int = 61, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16
    ) -> None:
        super().__init__()
        cfg = GPTConfig(vocab, layers, dim, heads, seq, tied=True, layout="gpt2", init="torch")
        add_gpt_layers(self, cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return gpt_forward(self, idx)


class AlbertLike(nn.Module):
    """One block applied three times (ALBERT's shared layers): one module whose hooks
    fire three times per forward and per backward.
    """

    def __init__(self, dim: int = 24, repeats: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.shared = Block(dim, 4, layout="gpt2", hidden=2 * dim)
        self.repeats = repeats
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(self.repeats):
            x = self.shared(x)
        return self.head(x)


class WithBias(nn.Module):
    """Returns its bias as a second output instead of adding it (a dangling param)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.weight.t(), self.bias


class BiasReturning(nn.Module):
    """A caller that adds the bias a child returns: a "dangling" parameter, which leaves
    its module through the output and is used by the caller.
    """

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = WithBias(dim)
        self.b = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, bias = self.a(x)
        return self.b(torch.tanh(y + bias))


class ParentUsesChildWeight(nn.Module):
    """A parent whose forward reads a child's weight directly (an external param)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.child = nn.Linear(dim, dim)
        self.other = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.child(x))
        h = self.other(h)
        h = h + F.linear(x, self.child.weight)  # the parent reads child.weight itself
        return self.out(h)


class FrozenAndUnused(nn.Module):
    """Frozen first layers and a submodule that forward never calls."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.train_me = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.train_me(self.frozen(x))))


class Expert(nn.Module):
    """One MoE expert: its own module, so routing changes which modules run."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class MoEBlock(nn.Module):
    """Top-1 routing over experts that are separate ``nn.Module`` objects.

    Only experts that receive tokens run, so ranks with different data run different
    modules: sharded, this block must be a leaf.
    """

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gates = torch.softmax(self.router(flat), dim=-1)
        weight, choice = gates.max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if bool(mask.any()):
                out[mask] = expert(flat[mask]) * weight[mask, None]
        return out.view_as(x)


class MoE(nn.Module):
    """A dense layer, an MoE block and a head."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = MoEBlock(dim, experts)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.head(h + self.moe(h))


class Checkpointed(nn.Module):
    """Blocks run under ``torch.utils.checkpoint``; ``shared`` is used inside and outside.

    With reentrant checkpointing the inner backward (the recomputed region) and the
    outer one each deliver a part of ``shared``'s gradient: its post-accumulate-grad
    hook fires twice in one backward (:ref:`fact-reentrant-double-hook`). The parts must
    accumulate, never reduce twice.
    """

    def __init__(self, reentrant: bool, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.shared = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, 3)

    def _region(self, x: torch.Tensor, block: nn.Module) -> torch.Tensor:
        return block(x) + self.shared(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.shared(x)
        for block in self.blocks:
            h = h + checkpoint(self._region, h, block, use_reentrant=self.reentrant)
        return self.head(h)


class Routed(nn.Module):
    """An MoE block whose router sends rank r's tokens to expert r (see ``routed_input``)."""

    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.moe = MoEBlock(dim, experts)
        with torch.no_grad():
            self.moe.router.weight.zero_()
            self.moe.router.weight[:, :experts] = torch.eye(experts) * 10
            self.moe.router.bias.zero_()
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


def routed_input(rank: int, dim: int = 8, n: int = 5, seed: int = 0) -> torch.Tensor:
    """Tokens the ``Routed`` router sends to expert ``rank`` (nothing to the others)."""
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(1000 * seed + rank)) * 0.1
    x[:, rank] = 5.0
    return x


def token_batch(vocab: int, seq: int) -> Callable[[int, int], torch.Tensor]:
    """An input builder for token models."""

    def make(batch: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, seq), generator=g)

    return make


def float_batch(dim: int, seq: int | None = None) -> Callable[[int, int], torch.Tensor]:
    """An input builder for float models (``(batch, dim)`` or ``(batch, seq, dim)``)."""

    def make(batch: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        shape = (batch, dim) if seq is None else (batch, seq, dim)
        return torch.randn(*shape, generator=g)

    return make


ZOO: dict[str, Callable[[], tuple[nn.Module, Callable[[int, int], torch.Tensor]]]] = {
    "gpt_tied": lambda: (TinyGPT(), token_batch(61, 16)),
    "albert_reused": lambda: (AlbertLike(), float_batch(24, seq=6)),
    "bias_returning": lambda: (BiasReturning(), float_batch(16)),
    "parent_uses_child_weight": lambda: (ParentUsesChildWeight(), float_batch(16)),
    "frozen_and_unused": lambda: (FrozenAndUnused(), float_batch(16)),
    "moe": lambda: (MoE(), float_batch(16, seq=5)),
    "checkpoint_reentrant": lambda: (Checkpointed(reentrant=True), float_batch(16)),
    "checkpoint_non_reentrant": lambda: (Checkpointed(reentrant=False), float_batch(16)),
}


#: Stateful optimizers the offload tests step (AdamW and two with other state), by name.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, Callable[[int, int], torch.Tensor]]:
    """Build a zoo model with a fixed seed (identical on every rank)."""
    torch.manual_seed(seed)
    return ZOO[name]()


def loss_of(output: Any) -> torch.Tensor:
    """A scalar loss that touches every output element (mean of squares)."""
    return output.float().pow(2).mean()


def train_beside(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    make: Callable[[int, int], torch.Tensor],
    comm: Any,
    steps: int,
    local: int,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> list[float]:
    """Train a sharded model and a one-process reference side by side.

    Each step the sharded model sees this rank's ``local`` rows of the global batch
    ``make(local * world, step)`` and the reference sees all of it. Returns, per step,
    ``|mean of the ranks' losses - reference loss|`` (equal losses: ~0).

    Args:
        model: The sharded model.
        opt: Its optimizer.
        reference: The same model in one process.
        ref_opt: The reference's optimizer.
        make: ``make(rows, seed)``: a batch of ``rows`` samples.
        comm: The ranks (for the mean loss).
        steps: Optimizer steps.
        local: Samples per rank per step.
        loss: ``loss(model, batch)``; default ``loss_of(model(batch))``.
    """
    loss = loss or (lambda m, x: loss_of(m(x)))
    n, r = comm.world_size, comm.rank
    diffs = []
    for step in range(steps):
        x = make(local * n, step)
        mine = loss(model, x[r * local : (r + 1) * local])
        mine.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss(reference, x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = mine.detach().clone()
        comm.all_reduce(mean).wait()
        diffs.append(abs(float(mean) / n - float(ref_loss.detach())))
    return diffs


def step_past_a_broken_swap(
    model: nn.Module,
    opt: Any,
    make: Callable[[int, int], torch.Tensor],
    *,
    rank: int,
    world: int,
    local: int,
    size: int = 0,
    device: torch.device | None = None,
    breaker: Callable[[Any], None] | None = None,
) -> str:
    """Train two steps of a model whose shards ``offload_param: nvme`` keeps in a swap
    file; before the second, the last rank's file is cut to ``size`` bytes (or
    ``breaker`` is called with its ``ParamSwap``). Returns the
    :class:`~zero3.core.ParamOffloadError` the second step raised on this rank (every
    rank must raise), or ``"no error"``.
    """
    swap = sharded_state(model).param_swap
    assert swap is not None, "the model keeps no parameter swap file"
    for step in range(2):
        if step == 1 and rank == world - 1:
            if breaker is not None:
                breaker(swap)
            else:
                os.truncate(swap.path, size)
        x = make(local * world, step)
        if device is not None:
            x = x.to(device)
        try:
            loss_of(model(x[rank * local : (rank + 1) * local])).backward()
            opt.step()
        except ParamOffloadError as exc:
            return str(exc)
        opt.zero_grad()
    return "no error"
