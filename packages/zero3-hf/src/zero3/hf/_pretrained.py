"""``from_pretrained``, sharded: a transformers model whose full weights never exist on
any rank.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

from zero3.core import Zero3Config
from zero3.hf._config import Zero3ConfigLike, resolve_config
from zero3.hooks import empty_init, shard_module

__all__ = ["sharded_from_pretrained"]


def sharded_from_pretrained(
    path: str | os.PathLike[str],
    model_class: Any = None,
    *,
    zero3_config: Zero3ConfigLike | None = None,
    args: TrainingArguments | None = None,
) -> nn.Module:
    """Build a transformers model from a ``save_pretrained`` directory, already sharded:
    ``from_pretrained`` without the whole model on any rank (DeepSpeed's
    ``zero.Init`` path of ``from_pretrained``).

    The model is built from ``config.json`` under :func:`zero3.hooks.empty_init`
    (parameters take no memory), then :func:`zero3.hooks.shard_module` reads each rank's
    slices of the safetensors weights (``model.safetensors`` or several files and an
    index). Pass the result to :class:`Zero3Trainer` as its model, with
    ``zero3_config=None``. A collective: every rank calls it.

    Args:
        path: The directory (``config.json`` and safetensors weights), e.g. what
            ``save_pretrained`` or ``Zero3Trainer.save_model`` wrote.
        model_class: The model class, or an auto class with ``from_config``; default
            ``AutoModelForCausalLM``.
        zero3_config: As for :class:`Zero3Trainer`: a Zero3Config, or a DeepSpeed config
            (path or dict) whose ``"auto"`` values are filled from ``args``.
        args: The run's ``TrainingArguments`` (sets up torch.distributed from the
            launcher; bf16/fp16 choose the parameter dtype; they fill a DeepSpeed
            config's ``"auto"``). Without them a DeepSpeed config is read as
            :meth:`Zero3Config.from_deepspeed <zero3.core.Zero3Config.from_deepspeed>`
            reads it, and the Trainer checks its values later.

    Returns:
        The sharded model.
    """
    cls = AutoModelForCausalLM if model_class is None else model_class
    config = AutoConfig.from_pretrained(path)
    if args is not None:
        _ = args.device  # sets up torch.distributed from the launcher
    with empty_init():
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    if args is not None:
        zero3, _ = resolve_config(zero3_config, args, model)
    elif isinstance(zero3_config, Zero3Config) or zero3_config is None:
        zero3 = zero3_config or Zero3Config()
    else:
        zero3 = Zero3Config.from_deepspeed(zero3_config)
    sharded: nn.Module = shard_module(model, zero3, checkpoint=path)
    return sharded
