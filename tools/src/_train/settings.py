"""Command-line flags and DeepSpeed configs turned into one set of training settings."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from _train.launch import CHILD_FLAG
from zero3.core import Zero3Config

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


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
            "its own local ranks (./dev train), or runs unchanged under a launcher: "
            "./dev run torchrun --standalone --nproc-per-node 2 tools/train.py, or "
            "./dev run mpiexec -n 2 python tools/train.py."
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
        "auto: one fetch unit, sized from the model; or the DeepSpeed config's)",
    )
    train.add_argument(
        "--param-persistence-threshold",
        type=float,
        default=None,
        help="Zero3Config.param_persistence_threshold, tensors this small stay whole "
        f"(default: {Zero3Config.param_persistence_threshold:,}, or the DeepSpeed config's)",
    )
    train.add_argument(
        "--offload-optimizer",
        default=None,
        metavar="cpu|nvme:DIR",
        help="keep the fp32 masters and optimizer state in host memory (cpu) or in swap "
        "files under DIR (nvme), stepping one sub-group at a time (default: none, or the "
        "DeepSpeed config's offload_optimizer)",
    )
    train.add_argument(
        "--offload-param",
        default=None,
        metavar="cpu|nvme:DIR",
        help="keep the parameter shards in host memory (cpu) or in a swap file under DIR "
        "(nvme, with max_in_cpu 0: every sharded shard goes there), read back ahead of each "
        "gather (default: none, or the DeepSpeed config's offload_param)",
    )
    ckpt = p.add_argument_group("checkpoints (torch.distributed.checkpoint, any number of ranks)")
    ckpt.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="save a sharded checkpoint to DIR at the end (and every --save-every steps), "
        "replacing the previous one atomically; '{step}' in DIR becomes the step number "
        "(default: none)",
    )
    ckpt.add_argument(
        "--save-every",
        type=int,
        default=None,
        metavar="K",
        help="also save every K steps (default: only at the end)",
    )
    ckpt.add_argument(
        "--save-async", action="store_true", help="write checkpoints while training goes on"
    )
    ckpt.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue from a checkpoint, with any number of ranks (keep --batch x ranks "
        "to see the same global batches; default: a fresh start)",
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


# The command's own optimizer settings; a DeepSpeed "auto" value takes these (as the HF
# Trainer fills "auto" from its TrainingArguments).
DEFAULT_OPTIMIZER: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
}
# Parameters each DeepSpeed scheduler takes (DeepSpeed passes them as keyword arguments).
SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupDecayLR": {
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
    },
    "WarmupCosineLR": {
        "warmup_min_ratio", "warmup_num_steps", "warmup_type", "total_num_steps", "cos_min_ratio",
    },
}  # fmt: skip


def _ds_optimizer(
    spec: Any, lr: float | None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and keyword arguments of a DeepSpeed ``optimizer`` section."""
    kind = spec.get("type", "AdamW")
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZERS:
        raise ValueError(
            f"DeepSpeed optimizer.type {kind!r} is not supported by this command; use one of "
            f"{sorted(OPTIMIZERS)} (any torch optimizer works through the API)"
        )
    params = spec.get("params", {})
    if not isinstance(params, dict):
        raise TypeError(f"DeepSpeed optimizer.params must be a mapping, got {params!r}")
    params = dict(params)
    params.pop("torch_adam", None)
    adam_w_mode = params.pop("adam_w_mode", True)
    if not isinstance(adam_w_mode, bool):
        raise TypeError(
            f"DeepSpeed optimizer.params.adam_w_mode must be true or false, got {adam_w_mode!r}"
        )
    # DeepSpeed runs "Adam" as AdamW (decoupled weight decay) unless adam_w_mode is false.
    optimizer = OPTIMIZERS[kind.lower()]
    if optimizer is torch.optim.Adam and adam_w_mode:
        optimizer = torch.optim.AdamW
    defaults = {**DEFAULT_OPTIMIZER, **({} if lr is None else {"lr": lr})}
    for key, value in params.items():
        if value == "auto":
            if key not in defaults:
                raise ValueError(
                    f'DeepSpeed optimizer.params.{key} is "auto" but this command has no value '
                    f"for it; write a number (it fills lr, betas, eps and weight_decay)"
                )
            params[key] = defaults[key]
    if lr is not None:
        params["lr"] = lr
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    _try_optimizer(optimizer, params)
    return optimizer, params


def _try_optimizer(optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    """Build the optimizer once on a scratch parameter: a bad name or value fails here,
    before any rank starts, with the key in the message."""
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"DeepSpeed optimizer.params {kwargs} are not valid for "
            f"torch.optim.{optimizer.__name__}: {exc}"
        ) from exc


def _ds_scheduler(spec: Any, lr: float, warmup: int, steps: int) -> dict[str, Any]:
    """A DeepSpeed ``scheduler`` section with every ``"auto"`` filled and every value checked."""
    kind = spec.get("type")
    if kind not in SCHEDULER_PARAMS:
        raise ValueError(
            f"DeepSpeed scheduler.type {kind!r} is not supported by this command; use one of "
            f"{sorted(SCHEDULER_PARAMS)}"
        )
    params = spec.get("params", {})
    if not isinstance(params, dict):
        raise TypeError(f"DeepSpeed scheduler.params must be a mapping, got {params!r}")
    # "auto" as the HF Trainer fills it: min lr 0, max lr the optimizer's, warmup and total
    # steps from the run (--warmup, --steps).
    auto = {
        "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": max(1, warmup),
        "total_num_steps": steps, "warmup_min_ratio": 0.0, "cos_min_ratio": 1e-4,
        "warmup_type": "log",
    }  # fmt: skip
    resolved: dict[str, Any] = {}
    for key, value in params.items():
        label = f"DeepSpeed scheduler.params.{key}"
        if key not in SCHEDULER_PARAMS[kind]:
            raise ValueError(
                f"{label} is not a parameter of {kind}: use {sorted(SCHEDULER_PARAMS[kind])}"
            )
        value = auto[key] if value == "auto" else value
        if key == "warmup_type":
            _check(value in ("log", "linear"), f"{label} must be 'log' or 'linear', got {value!r}")
        elif key in ("warmup_num_steps", "total_num_steps"):
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{label} must be an integer >= 1, got {value!r}",
            )
        else:
            _check(
                isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value) and value >= 0,
                f"{label} must be a finite number >= 0, got {value!r}",
            )  # fmt: skip
        resolved[key] = value
    return {"type": kind, "params": resolved}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _batch_sizes(
    args: argparse.Namespace, extras: dict[str, Any], world_size: int
) -> tuple[int, int]:
    """Micro batch and accumulation: flags win, then the DeepSpeed config (filled in as
    DeepSpeed does from train_batch_size), then 8 and 1. "auto" means "not given"."""

    def given(key: str) -> int | None:
        value = extras.get(key)
        return None if value in (None, "auto") else int(value)

    micro = args.batch or given("train_micro_batch_size_per_gpu")
    accumulation = args.accumulation or given("gradient_accumulation_steps")
    total = given("train_batch_size")
    if total is not None and (micro is None or accumulation is None):
        known = (micro or 1) * (accumulation or 1) * world_size
        _check(
            total % known == 0,
            f"DeepSpeed train_batch_size {total} is not a multiple of "
            f"{'micro batch ' + str(micro) if micro else 'accumulation ' + str(accumulation or 1)}"
            f" x world size {world_size}; fix the config or pass --batch/--accumulation",
        )
        if micro is None:
            micro = total // known
        else:
            accumulation = total // known
    micro, accumulation = micro or 8, accumulation or 1
    if total is not None and args.batch is None and args.accumulation is None:
        _check(
            total == micro * accumulation * world_size,
            f"DeepSpeed train_batch_size {total} != micro batch {micro} x accumulation "
            f"{accumulation} x world size {world_size}; fix the config or pass "
            "--batch/--accumulation",
        )
    return micro, accumulation


def launcher_settings(args: argparse.Namespace, world_size: int) -> Settings:
    """``settings_from`` in the launcher, before any rank starts: zero3's notes on the
    DeepSpeed config (each "auto" resolved, each key left to this loop, each setting not
    honoured) are printed here, once, on stdout."""
    notes = logging.StreamHandler(sys.stdout)
    notes.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("zero3.core")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(notes)
    try:
        return settings_from(args, world_size)
    finally:
        logger.removeHandler(notes)
        logger.setLevel(level)


def rank_settings(args: argparse.Namespace, world_size: int) -> Settings:
    """``settings_from`` in a rank. A rank the launcher started reads the config again
    without a word (the launcher printed its notes); under torchrun or mpiexec there was
    no launcher, so rank 0's warnings are the only copy and stay."""
    if os.environ.get(CHILD_FLAG) != "1":
        return settings_from(args, world_size)
    logger = logging.getLogger("zero3.core")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return settings_from(args, world_size)
    finally:
        logger.setLevel(level)


def _offload_flag(flag: str, value: str) -> dict[str, Any]:
    """``cpu``, ``nvme:DIR`` or ``none`` as an offload section."""
    if value in ("cpu", "none"):
        return {"device": value}
    if value.startswith("nvme:") and len(value) > len("nvme:"):
        section: dict[str, Any] = {"device": "nvme", "nvme_path": value[len("nvme:") :]}
        if flag == "--offload-param":
            # DeepSpeed's max_in_cpu default (10⁹ elements) would keep a model this
            # command trains in memory: the flag asks for the shards on disk.
            section["max_in_cpu"] = 0
        return section
    raise ValueError(f"{flag} must be cpu, nvme:DIR or none, got {value!r}")


def settings_from(args: argparse.Namespace, world_size: int) -> Settings:
    """Resolve flags and an optional DeepSpeed config (explicit flags win).

    Everything is checked here, so the launcher can run it once before any rank starts;
    an error names the flag or the DeepSpeed key.
    """
    overrides: dict[str, Any] = {"backend": args.backend}
    if args.max_reuse_distance is not None:
        overrides["max_reuse_distance"] = int(args.max_reuse_distance)
    if args.param_persistence_threshold is not None:
        overrides["param_persistence_threshold"] = int(args.param_persistence_threshold)
    if args.dtype is not None:
        overrides["param_dtype"] = DTYPES[args.dtype]
    for flag, field in (("--offload-optimizer", "offload_optimizer"),
                        ("--offload-param", "offload_param")):  # fmt: skip
        value = getattr(args, field)
        if value is not None:
            overrides[field] = _offload_flag(flag, value)
    extras: dict[str, Any] = {}
    if args.deepspeed_config is not None:
        if not args.deepspeed_config.exists():
            raise ValueError(f"--deepspeed-config {args.deepspeed_config}: no such file")
        config = Zero3Config.from_deepspeed(args.deepspeed_config, **overrides)
        extras = dict(config.extras)
    else:
        config = Zero3Config(**overrides)
    for name, value in (("--steps", args.steps), ("--batch", args.batch),
                        ("--accumulation", args.accumulation)):  # fmt: skip
        _check(value is None or value >= 1, f"{name} must be >= 1, got {value}")
    _check(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    _check(args.lr is None or args.lr > 0, f"--lr must be > 0, got {args.lr}")
    batch, accumulation = _batch_sizes(args, extras, world_size)
    optimizer, kwargs = torch.optim.AdamW, dict(DEFAULT_OPTIMIZER)
    if args.lr is not None:
        kwargs["lr"] = args.lr
    if extras.get("optimizer") not in (None, "auto"):
        optimizer, kwargs = _ds_optimizer(extras["optimizer"], args.lr)
    scheduler = None
    if extras.get("scheduler") not in (None, "auto"):
        peak = kwargs.get("lr", 1e-3)
        scheduler = _ds_scheduler(extras["scheduler"], peak, args.warmup, args.steps)
    dtype = args.dtype or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        config.param_dtype, "fp32"
    )  # type: ignore[arg-type]
    _check(args.save_every is None or args.save_every >= 1, "--save-every must be >= 1")
    _check(args.save_every is None or args.save is not None, "--save-every needs --save DIR")
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
    return _deepspeed_schedule(spec, peak, steps)


def _deepspeed_schedule(spec: dict[str, Any], peak: float, steps: int) -> Any:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR as a multiplier of ``peak``.

    Note:
        DeepSpeed steps its scheduler after each optimizer step, so optimizer step ``k``
        (from 0) runs with the scheduler at iteration ``k - 1``, and iteration ``-1`` is
        the warmup's start (0 for the cosine schedule). Warmup lasts at least 2
        iterations, rising as ``log(i + 1) / log(n)`` ("log", DeepSpeed's default) or
        ``i / n`` ("linear").
    """
    params, kind = spec["params"], spec["type"]
    n_warm = max(2, int(params.get("warmup_num_steps", 1000)))
    total = int(params.get("total_num_steps", steps))
    log_warmup = params.get("warmup_type", "log") == "log"

    def rising(i: int) -> float:
        return math.log(i + 1) / math.log(n_warm) if log_warmup else i / n_warm

    if kind == "WarmupCosineLR":
        low, floor = (
            float(params.get("warmup_min_ratio", 0.0)),
            float(params.get("cos_min_ratio", 1e-4)),
        )

        def cosine(step: int) -> float:
            i = step - 1
            if i < 0:
                return 0.0
            if i < n_warm:
                return low + (1.0 - low) * rising(i)
            progress = min(1.0, (i - n_warm + 1) / max(1, total - n_warm))
            return max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)

        return cosine
    low = float(params.get("warmup_min_lr", 0.0)) / peak
    high = float(params.get("warmup_max_lr", peak)) / peak
    decay = kind == "WarmupDecayLR"

    def warm(step: int) -> float:
        i = step - 1
        if i < 0:
            return low
        if i < n_warm:
            gamma = rising(i)
        elif decay:
            gamma = max(0.0, (total - i) / max(1.0, total - n_warm))
        else:
            gamma = 1.0
        return low + (high - low) * gamma

    return warm
