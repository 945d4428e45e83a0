"""A DeepSpeed config under the Trainer: ``"auto"`` filled from TrainingArguments.

Note:
    The same filling as transformers' ``HfTrainerDeepSpeedConfig``, whose two passes
    (``trainer_config_process``, ``trainer_config_finalize``) become
    :func:`fill_from_training_args` (in the constructor, where zero3 already knows the
    model) and :func:`check_scheduler_steps` (when the scheduler is built). The optimizer
    and scheduler sections only supply values: the Trainer's own are always built, so a
    run equals the stock Trainer's (:ref:`hf-deepspeed-config`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from torch import nn
from transformers import TrainingArguments

__all__ = ["check_scheduler_steps", "fill_from_training_args", "warn_unused_sections"]

_log = logging.getLogger("zero3.hf")

AUTO = "auto"
#: Optimizer parameters the Trainer's arguments stand for (the rest are not used).
_OPTIMIZER_VALUES = ("lr", "betas", "eps", "weight_decay")
#: DeepSpeed schedulers and the Trainer's ``lr_scheduler_type`` with the same curve
#: (with ``"warmup_type": "linear"``; DeepSpeed's default warmup is logarithmic).
_SCHEDULER_TWINS = {
    "WarmupDecayLR": "linear",
    "WarmupCosineLR": "cosine",
    "WarmupLR": "constant_with_warmup",
}
#: Scheduler parameters the Trainer's arguments stand for.
_SCHEDULER_VALUES = (
    "warmup_min_lr",
    "warmup_max_lr",
    "warmup_num_steps",
    "total_num_steps",
    "warmup_type",
)
_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


class _Filler:
    """Fills ``"auto"`` in a config copy and records mismatches (transformers' rules)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config: dict[str, Any] = copy.deepcopy(dict(config))
        self.mismatches: list[str] = []

    def node(self, dotted: str) -> tuple[dict[str, Any] | None, str]:
        """The mapping holding the last key of ``dotted`` (None if a parent is missing)."""
        *parents, key = dotted.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return (node, key) if isinstance(node, dict) else (None, key)

    def is_auto(self, dotted: str) -> bool:
        node, key = self.node(dotted)
        return node is not None and node.get(key) == AUTO

    def fill(self, dotted: str, value: Any, source: str | None = None) -> None:
        """Replace an ``"auto"`` by ``value``; with ``source``, another value must
        equal it (else it is recorded as a mismatch).
        """
        node, key = self.node(dotted)
        if node is None or key not in node:
            return
        if node[key] == AUTO:
            node[key] = value
        elif source is not None and node[key] is not None and node[key] != value:
            self.mismatches.append(f"- ds {dotted}={node[key]} vs hf {source}={value}")

    def raise_mismatches(self) -> None:
        if self.mismatches:
            raise ValueError(
                "Please correct the following DeepSpeed config values that mismatch "
                "TrainingArguments values:\n" + "\n".join(self.mismatches) + "\nThe easiest "
                "method is to set these DeepSpeed config values to 'auto'."
            )


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None:
            continue
        if getattr(holder, "hidden_size", None) is not None:
            return int(holder.hidden_size)
        sizes = getattr(holder, "hidden_sizes", None)
        if sizes:
            return int(max(sizes))
    return None


def fill_from_training_args(
    config: Mapping[str, Any], args: TrainingArguments, model: nn.Module
) -> dict[str, Any]:
    """Return a copy of a DeepSpeed config with its ``"auto"`` values filled from
    ``args`` and ``model`` as transformers fills them (see the module Note).

    Raises:
        ValueError: A value that is not ``"auto"`` differs from its argument (every
            mismatch listed), or a hidden-size ``"auto"`` and a model with no
            ``hidden_size`` in its config.
    """
    f = _Filler(config)
    must_batch = not args.auto_find_batch_size
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    f.fill("train_micro_batch_size_per_gpu", micro,
           "per_device_train_batch_size" if must_batch else None)  # fmt: skip
    f.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    f.fill("train_batch_size", args.world_size * micro * accumulation,
           "train_batch_size (calculated)" if must_batch else None)  # fmt: skip
    f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0)
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    f.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    bf16 = bool(args.bf16 or args.bf16_full_eval)
    f.fill("bf16.enabled", bf16, "bf16|bf16_full_eval")
    f.fill("bfloat16.enabled", bf16, "bf16|bf16_full_eval")  # bf16's old name
    auto = [key for key in _HIDDEN_SIZE_KEYS if f.is_auto(key)]
    if auto:
        hidden = _hidden_size(model)
        if hidden is None:
            raise ValueError(
                "The model's config has neither `hidden_size` nor `hidden_sizes`, so the "
                f'"auto" values of {auto} in the DeepSpeed config cannot be filled: replace '
                "them with integers"
            )
        f.fill("zero_optimization.reduce_bucket_size", hidden * hidden)
        f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)
    f.raise_mismatches()
    return f.config


def check_scheduler_steps(
    config: Mapping[str, Any], args: TrainingArguments, num_training_steps: int
) -> None:
    """The second pass: the scheduler section's step counts against the run's.

    Raises:
        ValueError: ``total_num_steps`` or ``warmup_num_steps`` is set and differs from
            the Trainer's.
    """
    f = _Filler(config)
    f.fill("scheduler.params.total_num_steps", num_training_steps,
           "num_training_steps (calculated)")  # fmt: skip
    f.fill("scheduler.params.warmup_num_steps",
           max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")  # fmt: skip
    f.raise_mismatches()


def _optimizer_type_matches(section: Mapping[str, Any], optimizer_cls: type) -> bool:
    kind = str(section.get("type", "")).lower()
    params = section.get("params") or {}
    if optimizer_cls.__name__ == "AdamW":
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
        return kind == "adamw" or (kind == "adam" and params.get("adam_w_mode", True) is True)
    if optimizer_cls.__name__ == "Adam":
        return kind == "adam" and params.get("adam_w_mode", True) is False
    return kind == optimizer_cls.__name__.lower()


def warn_unused_sections(
    config: Mapping[str, Any], args: TrainingArguments, optimizer_cls: type
) -> None:
    """Log at WARNING what the optimizer and scheduler sections ask for that the
    Trainer's own optimizer and scheduler do not do, and what is used instead (rank 0
    only: every rank reads the same config).
    """
    if args.process_index != 0:
        return
    optimizer = config.get("optimizer")
    used = (
        f"the Trainer's own optimizer: {optimizer_cls.__module__}.{optimizer_cls.__name__} "
        f"(optim={_name(args.optim)!r}, learning_rate={args.learning_rate}, "
        f"weight_decay={args.weight_decay} with the Trainer's no-decay groups)"
    )
    if isinstance(optimizer, Mapping):
        if "type" in optimizer and not _optimizer_type_matches(optimizer, optimizer_cls):
            _log.warning(
                "zero3: the DeepSpeed config's optimizer.type %r is not used; Zero3Trainer "
                "builds %s",
                optimizer.get("type"),
                used,
            )
        extra = sorted(set(optimizer.get("params") or {}) - set(_OPTIMIZER_VALUES))
        if extra:
            _log.warning(
                "zero3: the DeepSpeed config's optimizer.params %s are not used; Zero3Trainer "
                "builds %s (set other options with TrainingArguments.optim_args)",
                extra,
                used,
            )
    scheduler = config.get("scheduler")
    if isinstance(scheduler, Mapping) and "type" in scheduler:
        kind = scheduler.get("type")
        params = scheduler.get("params") or {}
        warmup_type = params.get("warmup_type", "log")
        twin = _SCHEDULER_TWINS.get(str(kind))
        if twin != _name(args.lr_scheduler_type) or warmup_type != "linear":
            _log.warning(
                "zero3: the DeepSpeed config's scheduler.type %r (warmup_type %r) is not used; "
                "Zero3Trainer uses the Trainer's own scheduler: lr_scheduler_type=%r with "
                "warmup_steps=%s (linear warmup)",
                kind,
                warmup_type,
                _name(args.lr_scheduler_type),
                args.warmup_steps,
            )
        extra = sorted(set(params) - set(_SCHEDULER_VALUES))
        if extra:
            _log.warning(
                "zero3: the DeepSpeed config's scheduler.params %s are not used; Zero3Trainer "
                "uses lr_scheduler_type=%r (set its options with "
                "TrainingArguments.lr_scheduler_kwargs)",
                extra,
                _name(args.lr_scheduler_type),
            )


def _name(value: Any) -> str:
    """An enum's value (``SchedulerType.LINEAR`` -> ``"linear"``), or the string."""
    return str(getattr(value, "value", value))
