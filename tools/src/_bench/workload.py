"""The fixed benchmark workload: a small GPT (the same one for every system), synthetic tokens."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


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
    """What :class:`GPT` is built from (a :class:`Workload`, or tools/gpu_check.py's shape)."""

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


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, w: GPTShape) -> None:
        super().__init__()
        self.heads = w.heads
        self.ln1 = nn.LayerNorm(w.d_model)
        self.qkv = nn.Linear(w.d_model, 3 * w.d_model)
        self.proj = nn.Linear(w.d_model, w.d_model)
        self.ln2 = nn.LayerNorm(w.d_model)
        self.fc = nn.Linear(w.d_model, 4 * w.d_model)
        self.out = nn.Linear(4 * w.d_model, w.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Untied embeddings and head (33.7M parameters at the default size)."""

    def __init__(self, w: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(w.vocab, w.d_model)
        self.pos = nn.Embedding(w.seq, w.d_model)
        self.blocks = nn.ModuleList(Block(w) for _ in range(w.layers))
        self.ln_f = nn.LayerNorm(w.d_model)
        self.head = nn.Linear(w.d_model, w.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()  # the loss in fp32 for bf16 models
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def build(w: Workload) -> GPT:
    """The model, identical on every rank and in every system."""
    torch.manual_seed(w.seed)
    return GPT(w)


def batch(w: Workload, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch (world * batch sequences)."""
    g = torch.Generator().manual_seed(w.seed * 7919 + step)
    tokens = torch.randint(0, w.vocab, (world * w.batch, w.seq + 1), generator=g)
    rows = tokens[rank * w.batch : (rank + 1) * w.batch]
    return rows[:, :-1], rows[:, 1:]
