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
    #: LoRA rank (0: full training). With it every system trains peft LoRA adapters of
    #: this rank on the four linears of each block; the base is frozen.
    lora: int = 0

    @property
    def layer_numel(self) -> int:
        """Parameters of one block (four linears with biases, two layer norms)."""
        return 12 * self.d_model**2 + 13 * self.d_model

    @property
    def lora_numel(self) -> int:
        """LoRA parameters of the model: ``r·(in + out)`` for each of the four linears
        of every block (qkv d→3d, proj d→d, fc d→4d, out 4d→d)."""
        return self.layers * self.lora * 16 * self.d_model


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


#: The linears LoRA adapts in every block (the "flat" layout's names).
LORA_TARGETS = ["qkv", "proj", "fc", "out"]


def with_lora(model: torch.nn.Module, w: Workload) -> torch.nn.Module:
    """peft's LoRA on ``model`` (rank ``w.lora``; ``model`` as it is when not LoRA), with
    the same adapter values in every system and on every rank."""
    if not w.lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(w.seed + 1)
    config = LoraConfig(r=w.lora, lora_alpha=2 * w.lora, target_modules=LORA_TARGETS)
    return get_peft_model(model, config)  # type: ignore[no-any-return]


def batch(w: Workload, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch (world * batch sequences)."""
    g = torch.Generator().manual_seed(w.seed * 7919 + step)
    tokens = torch.randint(0, w.vocab, (world * w.batch, w.seq + 1), generator=g)
    rows = tokens[rank * w.batch : (rank + 1) * w.batch]
    return rows[:, :-1], rows[:, 1:]
