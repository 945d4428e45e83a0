"""A GPT-style model (pre-norm blocks, tied embeddings) and sampling."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape."""

    vocab_size: int
    n_layer: int = 3
    d_model: int = 384
    n_head: int = 6
    seq_len: int = 128

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"--d-model {self.d_model} must be divisible by --heads {self.n_head}")
        for name in ("n_layer", "d_model", "n_head", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class SelfAttention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT with tied token embedding / output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self.init_weights)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        """Initialise one module's own parameters (also zero3's ``param_init_fn``)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: list[int],
    length: int,
    seq_len: int,
    seed: int,
    temperature: float = 0.8,
) -> list[int]:
    """Sample ``length`` tokens after ``prompt`` (same seed on every rank: same text)."""
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(length):
        context = torch.tensor([ids[-seq_len:]])
        logits = model(context)[0, -1].float() / temperature
        probs = torch.softmax(logits, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return ids[len(prompt) :]
