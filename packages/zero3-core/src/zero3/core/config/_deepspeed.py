"""Mapping of a DeepSpeed JSON config onto Zero3Config fields.

Note (what happens to each key):
    Every key DeepSpeed reads is listed in one of the tables below, so a typo is an
    error that names it instead of a setting silently lost. A key is

    - *mapped*: its value sets a :class:`Zero3Config` field;
    - *honoured*: zero3 already does what the value asks (or the key has no effect at
      ZeRO stage 3 in DeepSpeed either): accepted, nothing to do;
    - *not acted on*: the value asks for something zero3 itself does not do. The
      training loop owns most of these (batch sizes, optimizer, scheduler, logging);
      the others only change where memory lives or how communication is compressed
      (offload, ZeRO++, MiCS), and zero3 computes the same training in full precision
      with everything on the training device. They are logged once per config with what
      to do instead, and kept in :attr:`Zero3Config.extras` under their dotted key
      (``"zero_optimization.stage3_gather_16bit_weights_on_model_save"``). Those whose
      absence changes the run's memory or numerics (offload, quantized communication,
      autocast, ...: ``Key.costs``) are logged at WARNING, the others at INFO, and only
      by rank 0 of a launched job (every rank reads the same config);
    - *refused*: zero3 cannot run what it asks (another ZeRO stage, tensor/expert/
      sequence parallelism, a summed gradient reduction) or it contradicts another key.

    ``"auto"`` is resolved as the Hugging Face Trainer does when it has no
    TrainingArguments to fill it from: precision stays off unless set, gradient
    clipping is 1.0 (the Trainer's ``max_grad_norm`` default), batch sizes,
    accumulation, optimizer and scheduler values are left to the training loop (they
    stay ``"auto"`` in ``extras``), and any other key takes DeepSpeed's default (what
    DeepSpeed's own config classes do with ``"auto"``). Each resolution is logged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection, Mapping
from typing import Any

import torch.distributed as dist

from zero3.core.config._checks import check_clipping
from zero3.core.config._deepspeed_keys import (
    AIO,
    AUTO,
    BF16,
    DATA_TYPES,
    FP16,
    OFFLOAD_OPTIMIZER,
    OFFLOAD_PARAM,
    SPECIAL,
    TOP,
    ZERO,
    Key,
    dtype_name,
    mapping,
    no_unknown,
    same_setting_twice,
)
from zero3.core.config._offload import (
    AioConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)

__all__ = ["fields_from_deepspeed", "first_rank"]

_log = logging.getLogger("zero3.core")


# -- reading --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Reading:
    """What reading one DeepSpeed config found."""

    overrides: Collection[str]
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    chosen: list[str] = dataclasses.field(default_factory=list)
    unused: list[str] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)  # memory or numerics

    def choose(self, label: str, field: str | None, text: str) -> None:
        if field is None or field not in self.overrides:
            self.chosen.append(f"{label}: {text}")

    def leave(self, label: str, value: Any, todo: str, costs: str = "") -> None:
        self.extras[label] = value
        if costs:
            self.ignored.append(f"{label} (changes {costs}): {todo}")
        else:
            self.unused.append(f"{label}: {todo}")


def first_rank() -> bool:
    """Whether this process is rank 0 of its job, or in none (warnings about a config
    every rank reads are shown once).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value) == 0
    return True


def _fmt(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return repr(value)


def _read(reading: _Reading, prefix: str, section: Mapping[str, Any],
          table: Mapping[str, Key]) -> dict[str, Any]:  # fmt: skip
    """Check every key of a section against its table; returns the normalized values."""
    no_unknown(prefix.rstrip("."), section, table)
    twice = same_setting_twice(section, table)
    if twice:
        given = ", ".join(f"{prefix}{name}={section[name]!r}" for name in twice)
        raise ValueError(
            f"the DeepSpeed config gives one setting under {len(twice)} names with different "
            f"values ({given}); they are spellings of the same key (DeepSpeed would keep one "
            "of them without a word): keep one"
        )
    values: dict[str, Any] = {}
    for key, raw in section.items():
        spec, label = table[key], prefix + key
        value = raw
        if raw == AUTO:
            if spec.loop:
                reading.leave(label, AUTO, "left to the training loop; " + spec.todo, spec.costs)
                continue
            value = spec.default
            why = spec.auto or "DeepSpeed's default"
            if value is None and spec.field is not None:
                shown = "sized from the model"  # the gather window (GatherWindow)
            else:
                shown = "its defaults (off)" if value is None else _fmt(value)
            reading.choose(label, spec.field or spec.about, f'"auto" -> {shown} ({why})')
            if value is None:  # a section (DeepSpeed drops an "auto" one), or auto
                continue
        values[key] = value = spec.check(label, value)
        if isinstance(raw, int | float) and value != raw and spec.field is not None:
            reading.choose(label, spec.field, f"{raw} -> {value} (DeepSpeed's {raw} gives "
                           "every parameter its own bucket/sub-group; zero3 spells that "
                           f"{value})")  # fmt: skip
        if spec.field is not None:
            reading.fields[spec.field] = value
        elif spec.refuse and spec.active(value):
            raise ValueError(f"{label}: {spec.refuse}")
        elif spec.todo and spec.active(value):
            reading.leave(label, raw, spec.todo, spec.costs)
    return values


def _zero_section(reading: _Reading, config: Mapping[str, Any]) -> None:
    if "zero_optimization" not in config:
        raise ValueError(
            "the DeepSpeed config has no zero_optimization section; zero3 needs "
            '{"zero_optimization": {"stage": 3, ...}}'
        )
    section = config["zero_optimization"]
    if isinstance(section, bool):
        raise ValueError(
            'zero_optimization: the old true/false form means ZeRO stage 1; write {"stage": 3}'
        )
    section = mapping("zero_optimization", section)
    if "stage" not in section:
        raise ValueError(
            "zero_optimization.stage is missing (DeepSpeed's default is 0): zero3 implements "
            'ZeRO stage 3 only (set "stage": 3)'
        )
    _read(reading, "zero_optimization.", section, ZERO)
    for name, table in (("offload_optimizer", OFFLOAD_OPTIMIZER), ("offload_param", OFFLOAD_PARAM)):
        if section.get(name) is not None and section[name] != AUTO:
            label = f"zero_optimization.{name}"
            _read(reading, f"{label}.", mapping(label, section[name]), table)
    if "grad_reduce_op" in reading.fields:
        on = reading.fields["grad_reduce_op"]
        reading.fields["grad_reduce_op"] = "reduce_scatter" if on else "all_reduce"


_SECTIONS = {
    "offload_optimizer": (OffloadOptimizerConfig, "zero_optimization.offload_optimizer"),
    "offload_param": (OffloadParamConfig, "zero_optimization.offload_param"),
    "aio": (AioConfig, "aio"),
}


def _gather_sections(reading: _Reading) -> None:
    """Turn the dotted fields (``offload_optimizer.device``) into their sections."""
    for name, (cls, label) in _SECTIONS.items():
        prefix = name + "."
        values = {k[len(prefix) :]: v for k, v in reading.fields.items() if k.startswith(prefix)}
        for key in values:
            del reading.fields[prefix + key]
        if not values or name in reading.overrides:
            continue
        try:
            reading.fields[name] = cls(**values)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from exc
        if name != "aio" and reading.fields[name].enabled:
            reading.choose(label, name, f"offloaded to {reading.fields[name].device}")


def _precision(reading: _Reading, config: Mapping[str, Any]) -> None:
    if "bf16" in config and "bfloat16" in config:
        raise ValueError(
            "the DeepSpeed config has both bf16 and bfloat16 (its old name): keep bf16"
        )
    bf16_key = "bfloat16" if "bfloat16" in config else "bf16"
    fp16 = _read(reading, "fp16.", mapping("fp16", config.get("fp16", {})), FP16)
    bf16 = _read(reading, f"{bf16_key}.", mapping(bf16_key, config.get(bf16_key, {})), BF16)
    on = [name for name, sec in (("bf16", bf16), ("fp16", fp16)) if sec.get("enabled") is True]
    if "param_dtype" in reading.overrides:
        return
    if len(on) == 2:
        raise ValueError(
            f"{bf16_key}.enabled and fp16.enabled are both true: enable one (or pass "
            "param_dtype= to choose)"
        )
    if on:
        reading.fields["param_dtype"] = on[0]


def _data_types(reading: _Reading, config: Mapping[str, Any]) -> None:
    types = _read(
        reading, "data_types.", mapping("data_types", config.get("data_types", {})), DATA_TYPES
    )
    comm = dtype_name("communication_data_type", config.get("communication_data_type"))
    accum = types.get("grad_accum_dtype")
    if "reduce_dtype" not in reading.overrides:
        if comm is not None and accum is not None and comm != accum:
            raise ValueError(
                f"communication_data_type {comm!r} and data_types.grad_accum_dtype {accum!r} "
                "differ: zero3 reduces and accumulates gradients in one dtype "
                "(Zero3Config.reduce_dtype); make them equal or drop one"
            )
        if comm or accum:
            reading.fields["reduce_dtype"] = comm or accum
    wanted = types.get("param_dtype")
    mode = reading.fields.get("param_dtype", "fp32")
    if wanted is not None and wanted != mode and "param_dtype" not in reading.overrides:
        raise ValueError(
            f"data_types.param_dtype {wanted!r} conflicts with the precision the bf16/fp16 "
            f"sections select ({mode}): set the matching enabled flag or drop param_dtype"
        )


def _clipping(reading: _Reading, config: Mapping[str, Any]) -> None:
    if "gradient_clipping" in reading.overrides:
        return
    clip = config.get("gradient_clipping")
    if clip == AUTO:
        reading.choose(
            "gradient_clipping", None, '"auto" -> 1.0 (the HF Trainer\'s max_grad_norm default)'
        )
        clip = 1.0
    if "gradient_clipping" not in config and first_rank():
        _log.warning(
            "zero3: the DeepSpeed config sets no gradient_clipping, so zero3 does not clip "
            "(DeepSpeed >= 0.19 would clip at 1.0 by default)"
        )
    reading.fields["gradient_clipping"] = check_clipping("gradient_clipping", clip)


def fields_from_deepspeed(
    config: Mapping[str, Any], overrides: Collection[str] = ()
) -> dict[str, Any]:
    """Return Zero3Config keyword arguments for a DeepSpeed config mapping.

    Args:
        config: The parsed DeepSpeed JSON.
        overrides: Zero3Config fields the caller sets itself: the file's values for
            them are still checked but never refused for contradicting each other.
    """
    reading = _Reading(overrides=frozenset(overrides))
    no_unknown("", config, {*TOP, *SPECIAL})
    _zero_section(reading, config)
    _precision(reading, config)
    _data_types(reading, config)
    _clipping(reading, config)
    _read(reading, "", {k: v for k, v in config.items() if k in TOP}, TOP)
    if config.get("aio") is not None:
        _read(reading, "aio.", mapping("aio", config["aio"]), AIO)
    _gather_sections(reading)
    if reading.chosen:
        _log.info(
            "zero3: values chosen for the DeepSpeed config:\n  %s", "\n  ".join(reading.chosen)
        )
    if reading.ignored and first_rank():
        _log.warning(
            "zero3: DeepSpeed settings zero3 does not honour, which changes this run's "
            "memory, numerics or speed against DeepSpeed's (kept in Zero3Config.extras):\n  %s",
            "\n  ".join(reading.ignored),
        )
    if reading.unused:
        _log.info(
            "zero3: DeepSpeed keys zero3 does not act on (kept in Zero3Config.extras):\n  %s",
            "\n  ".join(reading.unused),
        )
    reading.fields["extras"] = reading.extras
    return reading.fields
