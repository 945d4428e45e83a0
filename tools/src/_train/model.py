"""The GPT of the main job, the benchmarks and the tests, and sampling from it.

One definition in three layouts. Every layout builds the same modules in the same order
(so a seed gives the same weights) and computes the same function; they differ in the
parameter names and in which parts are modules of their own (hooks run per module),
which the checkpoints and the figures made with each depend on:

- ``"job"``: ``tools/train.py``'s model (``tok``, ``pos``, ``blocks.N.attn.qkv``,
  ``blocks.N.fc``, ``head``): attention is a module of its own;
- ``"flat"``: ``tools/bench.py``'s benchmark GPT (``blocks.N.qkv``): a block has no
  submodules besides its layers;
- ``"gpt2"``: ``zero3.testing.models.TinyGPT`` (``wte``, ``wpe``, ``blocks.N.mlp.fc``,
  ``lm_head``): GPT-2's names, attention and MLP each a module.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Layout = Literal["job", "flat", "gpt2"]

#: Per layout: the names of the token embedding, the position embedding and the head,
#: and whether a block's attention and its MLP are modules of their own.
LAYOUTS: dict[str, tuple[tuple[str, str, str], bool, bool]] = {
    "job": (("tok", "pos", "head"), True, False),
    "flat": (("tok", "pos", "head"), False, False),
    "gpt2": (("wte", "wpe", "lm_head"), True, True),
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape and layout.

    Attributes:
        vocab_size: Tokens.
        n_layer: Transformer blocks.
        d_model: Hidden size.
        n_head: Attention heads (they divide ``d_model``).
        seq_len: Positions.
        tied: The head uses the token embedding's weight (one ``nn.Parameter``).
        layout: Parameter names (module docstring).
        init: ``"normal"``: :meth:`GPT.init_weights` (std 0.02, zero biases);
            ``"torch"``: each layer's own ``reset_parameters`` (construction order).
    """

    vocab_size: int
    n_layer: int = 3
    d_model: int = 384
    n_head: int = 6
    seq_len: int = 128
    tied: bool = True
    layout: Layout = "job"
    init: Literal["normal", "torch"] = "normal"

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"--d-model {self.d_model} must be divisible by --heads {self.n_head}")
        for name in ("n_layer", "d_model", "n_head", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")
        if self.init not in ("normal", "torch"):
            raise ValueError(f"init must be 'normal' or 'torch', got {self.init!r}")


def attend(owner: nn.Module, n_head: int, x: torch.Tensor) -> torch.Tensor:
    """Causal self-attention through ``owner.qkv`` and ``owner.proj``."""
    b, t, d = x.shape
    q, k, v = owner.qkv(x).view(b, t, 3, n_head, d // n_head).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return owner.proj(y.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


def feed_forward(owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP through ``owner.fc`` and ``owner.out``."""
    return owner.out(F.gelu(owner.fc(x)))  # type: ignore[no-any-return]


class Attention(nn.Module):
    """Causal multi-head self-attention as a module of its own."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attend(self, self.n_head, x)


class MLP(nn.Module):
    """Two linear layers with a GELU, as a module of its own."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return feed_forward(self, x)


class Block(nn.Module):
    """Pre-norm transformer block (``hidden``: the MLP's width, default ``4 * d_model``)."""

    def __init__(
        self, d_model: int, n_head: int, layout: Layout = "job", hidden: int | None = None
    ) -> None:
        super().__init__()
        _, self.attention_module, self.mlp_module = LAYOUTS[layout]
        hidden = hidden or 4 * d_model
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        if self.attention_module:
            self.attn = Attention(d_model, n_head)
        else:
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        if self.mlp_module:
            self.mlp = MLP(d_model, hidden)
        else:
            self.fc = nn.Linear(d_model, hidden)
            self.out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + (self.attn(h) if self.attention_module else attend(self, self.n_head, h))
        h = self.ln2(x)
        return x + (self.mlp(h) if self.mlp_module else feed_forward(self, h))


def init_weights(module: nn.Module) -> None:
    """Initialise one module's own parameters the ``"normal"`` way (also zero3's
    ``param_init_fn``)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def add_gpt_layers(model: nn.Module, cfg: GPTConfig) -> None:
    """Give ``model``, a module just initialised, the GPT's layers for ``cfg`` (named as its
    layout says) and keep ``cfg`` as ``model.cfg``: what :class:`GPT` is made of, for a
    class of its own (``zero3.testing.models.TinyGPT``) to build the same model."""
    model.cfg = cfg
    tok, pos, head = LAYOUTS[cfg.layout][0]
    model.add_module(tok, nn.Embedding(cfg.vocab_size, cfg.d_model))
    model.add_module(pos, nn.Embedding(cfg.seq_len, cfg.d_model))
    model.blocks = nn.ModuleList(
        Block(cfg.d_model, cfg.n_head, cfg.layout) for _ in range(cfg.n_layer)
    )
    model.ln_f = nn.LayerNorm(cfg.d_model)
    model.add_module(head, nn.Linear(cfg.d_model, cfg.vocab_size, bias=False))
    if cfg.tied:
        model.get_submodule(head).weight = model.get_submodule(tok).weight
    if cfg.init == "normal":
        model.apply(init_weights)


def gpt_forward(
    model: nn.Module,
    idx: torch.Tensor,
    targets: torch.Tensor | None = None,
    last_position: bool = False,
) -> torch.Tensor:
    """The forward of a model built by :func:`add_gpt_layers`: logits, or with
    ``targets`` the cross-entropy loss (in fp32, inside the model's forward);
    ``last_position``: the last position's logits only, ``(batch, vocab)`` (decoding)."""
    tok, pos, head = (model.get_submodule(name) for name in LAYOUTS[model.cfg.layout][0])
    x = tok(idx) + pos(torch.arange(idx.shape[1], device=idx.device))
    for block in model.blocks:
        x = block(x)
    if last_position:
        return head(model.ln_f(x[:, -1:]))[:, -1]  # type: ignore[no-any-return]
    logits: torch.Tensor = head(model.ln_f(x))
    if targets is None:
        return logits
    logits = logits.float()  # the loss in fp32 for bf16 models
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """A GPT of pre-norm blocks; ``model(idx)`` gives logits, ``model(idx, targets)`` the
    cross-entropy loss."""

    init_weights = staticmethod(init_weights)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        add_gpt_layers(self, cfg)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return gpt_forward(self, idx, targets)


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
