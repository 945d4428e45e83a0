"""The fixed benchmark workload: a small GPT (the same one for every system), synthetic tokens."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from _train.model import GPT, GPTConfig


@dataclasses.dataclass(frozen=True)
class Workload:
    """8 layers, d_model 512, 8 heads, vocab 8192, seq 256, batch 4 per rank, fp32, AdamW 1e-3."""

    layers: int = 8
    d_model: int = 512
    heads: int = 8
    vocab: int = 8192
    seq: int = 256
    batch: int = 4
    lr: float = 1e-3
    seed: int = 0

    @property
    def layer_numel(self) -> int:
        """Parameters of one block (four linears with biases, two layer norms)."""
        return 12 * self.d_model**2 + 13 * self.d_model


class GPTShape(Protocol):
    """What the benchmark GPT is built from (a :class:`Workload`, or tools/gpu_check.py's shape)."""

    @property
    def layers(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def seq(self) -> int: ...


def gpt_config(w: GPTShape) -> GPTConfig:
    """The benchmark GPT's configuration for shape ``w``: ``_train.model``'s ``"flat"``
    layout, untied head, each layer's own initialisation (33.7M parameters at the default
    size)."""
    return GPTConfig(
        w.vocab, w.layers, w.d_model, w.heads, w.seq, tied=False, layout="flat", init="torch"
    )


def gpt(w: GPTShape) -> GPT:
    """The benchmark GPT of shape ``w``; ``model(idx, targets)`` returns the loss."""
    return GPT(gpt_config(w))


def build(w: Workload) -> GPT:
    """The model, identical on every rank and in every system."""
    torch.manual_seed(w.seed)
    return gpt(w)


def batch(w: Workload, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch (world * batch sequences)."""
    g = torch.Generator().manual_seed(w.seed * 7919 + step)
    tokens = torch.randint(0, w.vocab, (world * w.batch, w.seq + 1), generator=g)
    rows = tokens[rank * w.batch : (rank + 1) * w.batch]
    return rows[:, :-1], rows[:, 1:]
