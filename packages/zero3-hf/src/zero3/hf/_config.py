"""The Zero3Config a Trainer run shards with, from what the user passed and the
TrainingArguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from zero3.core import Zero3Config
from zero3.hf._deepspeed import fill_from_training_args, warn_unused_sections

__all__ = [
    "Zero3ConfigLike",
    "args_dtype",
    "check_clipping",
    "filled_sections",
    "read_deepspeed_json",
    "resolve_config",
]

#: What ``zero3_config=`` accepts: a Zero3Config, a DeepSpeed config dict or JSON path.
Zero3ConfigLike = Zero3Config | Mapping[str, Any] | str | os.PathLike[str]
#: DeepSpeed keys the training loop owns (kept in Zero3Config.extras by from_deepspeed).
_LOOP_KEYS = (
    "optimizer",
    "scheduler",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)


def args_dtype(args: TrainingArguments) -> torch.dtype | None:
    """The parameter dtype the DeepSpeed integration gives these arguments (its
    ``bf16.enabled`` / ``fp16.enabled`` "auto"), None for fp32.
    """
    if args.bf16 or args.bf16_full_eval:
        return torch.bfloat16
    if args.fp16 or args.fp16_full_eval:
        return torch.float16
    return None


def read_deepspeed_json(path: Path) -> dict[str, Any]:
    """A DeepSpeed JSON file; a repeated key is an error (JSON keeps the last silently)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ValueError(f"DeepSpeed config {path}: key(s) {repeated} appear twice")
        return dict(pairs)

    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"DeepSpeed config {path}: cannot read it ({exc})") from exc
    try:
        data = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {path} must hold a JSON object")
    return data


def check_clipping(clip: float | None, args: TrainingArguments) -> None:
    """A Zero3Config's clipping must be off or equal ``max_grad_norm`` (the Trainer
    clips with ``max_grad_norm``; two different norms would both apply).
    """
    wanted = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    if clip is not None and clip != wanted:
        raise ValueError(
            f"Zero3Trainer: Zero3Config.gradient_clipping is {clip} but "
            f"TrainingArguments.max_grad_norm is {args.max_grad_norm}; the Trainer clips "
            "with max_grad_norm: set gradient_clipping to None (or equal)"
        )


def _optimizer_cls(args: TrainingArguments, model: nn.Module, chosen: Any) -> type:
    cls = chosen[0] if chosen else Trainer.get_optimizer_cls_and_kwargs(args, model)[0]
    return cls if isinstance(cls, type) else type(cls)


def filled_sections(
    extras: Mapping[str, Any], args: TrainingArguments, model: nn.Module, chosen: Any = None
) -> dict[str, Any] | None:
    """A Zero3Config's DeepSpeed leftovers (batch sizes, optimizer, scheduler) filled and
    checked against ``args`` as a DeepSpeed config is (None when it has none).
    """
    sections = {key: extras[key] for key in _LOOP_KEYS if key in extras}
    if not sections:
        return None
    filled = fill_from_training_args(sections, args, model)
    warn_unused_sections(filled, args, _optimizer_cls(args, model, chosen))
    return filled


def resolve_config(
    source: Zero3ConfigLike | None, args: TrainingArguments, model: nn.Module, chosen: Any = None
) -> tuple[Zero3Config, dict[str, Any] | None]:
    """The Zero3Config to shard ``model`` with, and the filled DeepSpeed config (if any).

    Args:
        source: ``zero3_config`` as passed (None: ``Zero3Config()``).
        args: The run's arguments: their bf16/fp16 choose the parameter dtype, their
            values fill a DeepSpeed config's ``"auto"``.
        model: The model (its ``hidden_size`` fills the bucket-size ``"auto"``).
        chosen: ``optimizer_cls_and_kwargs`` if the Trainer was given one.

    Raises:
        ValueError: A DeepSpeed value contradicts ``args``; a Zero3Config's
            ``param_dtype`` or ``gradient_clipping`` contradicts them.
        TypeError: ``source`` is none of the accepted kinds.
    """
    dtype = args_dtype(args)
    if source is None:
        return Zero3Config(param_dtype=dtype), None
    if isinstance(source, Zero3Config):
        check_clipping(source.gradient_clipping, args)
        if source.param_dtype is not None and dtype is not None and source.param_dtype != dtype:
            raise ValueError(
                f"Zero3Trainer: Zero3Config.param_dtype is {source.param_dtype} but the "
                f"TrainingArguments ask for {dtype} (bf16/fp16); make them agree"
            )
        sections = filled_sections(source.extras, args, model, chosen)
        # The Trainer clips with max_grad_norm (checked equal above).
        config = dataclasses.replace(
            source, param_dtype=source.param_dtype or dtype, gradient_clipping=None
        )
        return config, sections
    if isinstance(source, str | os.PathLike):
        raw = read_deepspeed_json(Path(source))
    elif isinstance(source, Mapping):
        raw = dict(source)
    else:
        raise TypeError(
            "Zero3Trainer: zero3_config must be a Zero3Config, a DeepSpeed config dict or the "
            f"path of its JSON file, got {type(source).__name__}"
        )
    filled = fill_from_training_args(raw, args, model)
    warn_unused_sections(filled, args, _optimizer_cls(args, model, chosen))
    # The Trainer clips with max_grad_norm (the file's value was checked against it).
    return Zero3Config.from_deepspeed(filled, gradient_clipping=None), filled
