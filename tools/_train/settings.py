"""Command-line flags and DeepSpeed configs turned into one set of training settings."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from zero3.core import Zero3Config

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


@dataclasses.dataclass
class Settings:
    """Everything a rank needs to train."""

    config: Zero3Config
    steps: int
    batch: int
    accumulation: int
    optimizer: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    scheduler: dict[str, Any] | None
    dtype: str
    seed: int


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default; a ``None`` default means "not given" (a DeepSpeed
    config or zero3's own default applies), and the flag's help names the real one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    """The command's flags (``None`` defaults mark "not given", so a DeepSpeed config's
    values apply unless a flag overrides them)."""
    p = argparse.ArgumentParser(
        prog="tools/train.py",
        description=(
            "Train a small GPT on Shakespeare (character tokens) with zero3: every "
            "parameter, gradient and optimizer state sharded across the ranks. Launches "
            "its own local ranks, or runs unchanged under torchrun / mpiexec."
        ),
        formatter_class=_HelpFormatter,
    )
    run = p.add_argument_group("launch")
    run.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to start (default: one per usable core, at most 4); "
        "ignored under torchrun/mpiexec",
    )
    run.add_argument(
        "--backend",
        default="auto",
        help="comm backend: auto, gloo, mpi, nccl, hccl, cupy-nccl, or a plugin's",
    )
    run.add_argument(
        "--deepspeed-config",
        type=Path,
        default=None,
        metavar="DS.JSON",
        help="a DeepSpeed config: ZeRO keys, batch, optimizer and scheduler (default: none)",
    )
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=int, default=3, help="transformer blocks")
    model.add_argument("--d-model", type=int, default=384, help="width of the residual stream")
    model.add_argument("--heads", type=int, default=6, help="attention heads per block")
    model.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    model.add_argument(
        "--init",
        choices=["eager", "empty"],
        default="eager",
        help="eager: every rank builds the whole model, then shards it; empty: build under "
        "zero3.hooks.empty_init() and initialise one module at a time straight into the "
        "shards (the model is never whole on any rank)",
    )
    model.add_argument(
        "--from",
        dest="from_weights",
        type=Path,
        default=None,
        metavar="DIR",
        help="start from safetensors weights of the same model (a .safetensors file or a "
        "transformers-layout directory), each rank reading only its shards; implies "
        "--init empty (default: none, random initialisation)",
    )
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=150, help="optimizer steps")
    train.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per rank per micro-step (default: 8, or the DeepSpeed config's "
        "train_micro_batch_size_per_gpu)",
    )
    train.add_argument(
        "--accumulation",
        type=int,
        default=None,
        help="micro-steps per step (default: 1, or the DeepSpeed config's "
        "gradient_accumulation_steps)",
    )
    train.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: 1e-3, or the DeepSpeed config's optimizer lr)",
    )
    train.add_argument(
        "--warmup", type=int, default=10, help="linear warmup steps (cosine decay after)"
    )
    train.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="parameter dtype (default: fp32, or the DeepSpeed config's bf16/fp16 section)",
    )
    train.add_argument(
        "--seed", type=int, default=0, help="seed of the initial weights and of the batches"
    )
    train.add_argument(
        "--max-reuse-distance",
        type=float,
        default=None,
        help="Zero3Config.max_reuse_distance, 0 releases every module on exit (default: "
        f"{Zero3Config.max_reuse_distance:,}, or the DeepSpeed config's)",
    )
    train.add_argument(
        "--param-persistence-threshold",
        type=float,
        default=None,
        help="Zero3Config.param_persistence_threshold, tensors this small stay whole "
        f"(default: {Zero3Config.param_persistence_threshold:,}, or the DeepSpeed config's)",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="write a Chrome/Perfetto trace (one track per rank) of the last steps (default: none)",
    )
    out.add_argument("--trace-steps", type=int, default=2, help="steps to trace")
    out.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="plot loss and step time per step (default: none)",
    )
    out.add_argument("--samples", type=int, default=2, help="text samples printed at the end")
    out.add_argument("--sample-length", type=int, default=160, help="characters per sample")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _ds_optimizer(spec: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    kind = str(spec.get("type", "AdamW")).lower()
    if kind not in OPTIMIZERS:
        raise ValueError(
            f"DeepSpeed optimizer type {spec.get('type')!r} is not supported by this command; "
            f"use one of {sorted(OPTIMIZERS)} (any torch optimizer works through the API)"
        )
    params = dict(spec.get("params", {}))
    params.pop("torch_adam", None)
    params.pop("adam_w_mode", None)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return OPTIMIZERS[kind], params


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def settings_from(args: argparse.Namespace, world_size: int) -> Settings:
    """Resolve flags and an optional DeepSpeed config (explicit flags win)."""
    overrides: dict[str, Any] = {"backend": args.backend}
    if args.max_reuse_distance is not None:
        overrides["max_reuse_distance"] = int(args.max_reuse_distance)
    if args.param_persistence_threshold is not None:
        overrides["param_persistence_threshold"] = int(args.param_persistence_threshold)
    if args.dtype is not None:
        overrides["param_dtype"] = DTYPES[args.dtype]
    extras: dict[str, Any] = {}
    if args.deepspeed_config is not None:
        if not args.deepspeed_config.exists():
            raise ValueError(f"--deepspeed-config {args.deepspeed_config}: no such file")
        config = Zero3Config.from_deepspeed(args.deepspeed_config, **overrides)
        extras = dict(config.extras)
    else:
        config = Zero3Config(**overrides)
    batch = args.batch or int(extras.get("train_micro_batch_size_per_gpu", 8))
    accumulation = args.accumulation or int(extras.get("gradient_accumulation_steps", 1))
    total = extras.get("train_batch_size")
    if total not in (None, "auto") and args.batch is None and args.accumulation is None:
        _check(
            int(total) == batch * accumulation * world_size,
            f"DeepSpeed train_batch_size {total} != micro batch {batch} x accumulation "
            f"{accumulation} x world size {world_size}; fix the config or pass "
            "--batch/--accumulation",
        )
    optimizer, kwargs = torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}
    if "optimizer" in extras:
        optimizer, kwargs = _ds_optimizer(extras["optimizer"])
    if args.lr is not None:
        kwargs["lr"] = args.lr
    scheduler = extras.get("scheduler")
    if scheduler is not None and scheduler.get("type") not in SCHEDULERS:
        raise ValueError(
            f"DeepSpeed scheduler {scheduler.get('type')!r} is not supported; "
            f"use one of {SCHEDULERS}"
        )
    dtype = args.dtype or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        config.param_dtype, "fp32"
    )  # type: ignore[arg-type]
    for name, value in (
        ("--steps", args.steps),
        ("--batch", batch),
        ("--accumulation", accumulation),
    ):
        _check(value >= 1, f"{name} must be >= 1, got {value}")
    _check(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    _check(kwargs.get("lr", 1.0) > 0, f"the learning rate must be > 0, got {kwargs.get('lr')}")
    return Settings(
        config, args.steps, batch, accumulation, optimizer, kwargs, scheduler, dtype, args.seed
    )


def lr_lambda(settings: Settings, warmup: int) -> Any:
    """A multiplier of the peak lr per step: DeepSpeed's scheduler if configured, else
    linear warmup then cosine decay to 10%."""
    peak = settings.optimizer_kwargs.get("lr", 1e-3)
    spec = settings.scheduler
    steps = settings.steps
    if spec is None:

        def default(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, steps - warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        return default
    params = spec.get("params", {})
    kind = spec["type"]
    n_warm = int(params.get("warmup_num_steps", 1000))
    total = int(params.get("total_num_steps", steps))
    low = float(params.get("warmup_min_lr", 0.0)) / peak
    high = float(params.get("warmup_max_lr", peak)) / peak

    def warm(step: int) -> float:
        return low + (high - low) * min(1.0, (step + 1) / max(1, n_warm))

    if kind == "WarmupLR":
        return warm
    if kind == "WarmupDecayLR":
        return lambda step: (
            warm(step)
            if step < n_warm
            else high * max(0.0, (total - step) / max(1, total - n_warm))
        )
    ratio = float(params.get("cos_min_ratio", 1e-4))
    return lambda step: (
        warm(step)
        if step < n_warm
        else ratio
        + (1 - ratio)
        * 0.5
        * (1 + math.cos(math.pi * min(1.0, (step - n_warm) / max(1, total - n_warm))))
    )
