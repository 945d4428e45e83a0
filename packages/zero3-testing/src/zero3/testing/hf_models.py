"""Tiny transformers models built from configs (no download): Llama, GPT-2, ALBERT, Mixtral.

transformers is a test-only dependency; importing this module imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "HF_MODELS",
    "build_hf",
    "leaf_classes",
    "lm_rows",
    "save_tiny",
    "tiny_tokenizer",
    "trainer_arguments",
    "words",
]

VOCAB = 64
SEQ = 12


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def _albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    return AlbertForMaskedLM(
        AlbertConfig(
            vocab_size=VOCAB,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        )
    )


HF_MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "albert": _albert,
    "mixtral": _mixtral,
}


def leaf_classes(name: str) -> tuple[str, ...]:
    """Leaf modules to mark for a model (Mixtral's MoE block)."""
    return ("MixtralSparseMoeBlock",) if name == "mixtral" else ()


def build_hf(name: str, seed: int = 0) -> nn.Module:
    """A tiny model of the family, identical on every rank, dropout off."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = HF_MODELS[name]()
    model.config.use_cache = False
    return model


def tokens(batch: int, seed: int) -> torch.Tensor:
    """A deterministic batch of token ids."""
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def lm_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` language-modelling samples (``input_ids`` = ``labels``) for the models here."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def trainer_arguments(output_dir: str | Path, **overrides: Any) -> Any:
    """``TrainingArguments`` on the CPU with what the Trainer tests compare: accumulation 2,
    clipping 1.0, linear warmup over 2 steps, weight decay, lr 1e-2, seed 0, 3 steps, a
    loss logged every step, no saves, no reports. ``overrides`` replace any of them.
    """
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_steps=3,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


#: The special tokens of :func:`tiny_tokenizer` (the other ids are words ``w4``...).
PAD, EOS, BOS = 0, 1, 2


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over ``VOCAB`` ids, built in memory (no download): ``<pad>``,
    ``<eos>``, ``<bos>``, ``<unk>`` and the words ``w4`` ... ``w63``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>",
    )  # fmt: skip


def words(n: int, seed: int) -> str:
    """``n`` random words of :func:`tiny_tokenizer`'s vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(4, VOCAB, (n,), generator=g))


def save_tiny(name: str, directory: str | Path) -> Path:
    """Save a tiny model of the family and :func:`tiny_tokenizer` to ``directory`` (what
    ``from_pretrained(directory)`` loads; TRL builds reference models from that path).
    """
    model = build_hf(name)
    model.config.use_cache = True
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id, config.bos_token_id = PAD, EOS, BOS
    directory = Path(directory)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory
