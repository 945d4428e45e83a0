"""Mapping of a DeepSpeed JSON config onto Zero3Config fields."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["fields_from_deepspeed"]

_log = logging.getLogger("zero3.core")

# zero_optimization key (both DeepSpeed spellings) -> Zero3Config field.
_ZERO_FIELDS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "reduce_bucket_size": "reduce_bucket_size",
    "contiguous_gradients": "contiguous_gradients",
    "overlap_comm": "overlap_comm",
    "sub_group_size": "sub_group_size",
}

# Keys DeepSpeed accepts that change nothing for zero3 (stage 1/2 settings, or
# behaviour zero3 always has). Accepted so real configs load; listed so typos do not.
_HARMLESS = {
    "allgather_partitions",
    "allgather_bucket_size",
    "round_robin_gradients",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "ignore_unused_parameters",
    "elastic_checkpoint",
    "load_from_fp32_weights",
    "memory_efficient_linear",
    "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings",
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "override_module_apply",
    "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params",
}


def _offload_on(value: Any) -> bool:
    if isinstance(value, Mapping):
        return str(value.get("device", "none")).lower() not in ("none", "")
    return bool(value)


# Features zero3 lacks: key -> predicate "is it switched on".
_MISSING_FEATURES: dict[str, tuple[str, Any]] = {
    "offload_param": ("parameter offload (ZeRO-Infinity)", _offload_on),
    "offload_optimizer": ("optimizer offload (ZeRO-Offload)", _offload_on),
    "cpu_offload": ("optimizer offload (ZeRO-Offload)", bool),
    "cpu_offload_params": ("parameter offload", bool),
    "cpu_offload_use_pin_memory": ("offload", bool),
    "zero_quantized_weights": ("ZeRO++ quantized weights (qwZ)", bool),
    "zero_quantized_nontrainable_weights": ("ZeRO++ quantized weights", bool),
    "zero_quantized_gradients": ("ZeRO++ quantized gradients (qgZ)", bool),
    "zero_hpz_partition_size": ("ZeRO++ hierarchical partitioning (hpZ)", lambda v: int(v) > 1),
    "mics_shard_size": ("MiCS sharding", lambda v: int(v) > 0),
    "mics_hierarchical_params_gather": ("MiCS hierarchical gather", bool),
}

_FP16_KEYS = {
    "loss_scale": "loss_scale",
    "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
}
_FP16_IGNORED = {"enabled", "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}
_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16", "float32": "fp32"}


def _zero_section(section: Mapping[str, Any]) -> dict[str, Any]:
    stage = section.get("stage", 0)
    if stage != 3:
        raise ValueError(
            f"zero_optimization.stage is {stage!r}: zero3 implements ZeRO stage 3 only "
            '(set "stage": 3)'
        )
    fields: dict[str, Any] = {}
    for key, value in section.items():
        if key == "stage" or key in _HARMLESS:
            continue
        if key in _MISSING_FEATURES:
            feature, is_on = _MISSING_FEATURES[key]
            if is_on(value):
                raise ValueError(
                    f"zero_optimization.{key}: zero3 does not implement {feature}; remove the "
                    "key (or switch it off) to train fully sharded without it"
                )
            continue
        if key == "reduce_scatter":
            fields["grad_reduce_op"] = "reduce_scatter" if value else "all_reduce"
            continue
        field = _ZERO_FIELDS.get(key)
        if field is None:
            known = sorted(
                {*_ZERO_FIELDS, *_HARMLESS, *_MISSING_FEATURES, "stage", "reduce_scatter"}
            )
            raise ValueError(
                f"zero_optimization.{key} is not a DeepSpeed ZeRO-3 setting zero3 knows "
                f"(a typo?). Known keys: {', '.join(known)}"
            )
        if value != "auto":  # "auto" keeps zero3's (= DeepSpeed's) default
            fields[field] = value
    return fields


def _precision(config: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    fp16 = config.get("fp16") or {}
    bf16_on = bool(bf16.get("enabled", False)) if isinstance(bf16, Mapping) else False
    fp16_on = bool(fp16.get("enabled", False)) if isinstance(fp16, Mapping) else False
    if bf16_on and fp16_on:
        raise ValueError("the DeepSpeed config enables both bf16 and fp16; enable one")
    if bf16_on:
        fields["param_dtype"] = "bf16"
    if fp16_on:
        fields["param_dtype"] = "fp16"
        for key, value in fp16.items():
            if key in _FP16_KEYS:
                if value != "auto":
                    fields[_FP16_KEYS[key]] = value
            elif key not in _FP16_IGNORED:
                warnings.warn(f"fp16.{key} is not used by zero3 and is ignored", stacklevel=4)
    comm_dtype = config.get("communication_data_type")
    if comm_dtype is not None:
        if str(comm_dtype).lower() not in _DTYPES:
            raise ValueError(
                f"communication_data_type {comm_dtype!r} must be one of {sorted(_DTYPES)}"
            )
        fields["reduce_dtype"] = _DTYPES[str(comm_dtype).lower()]
    return fields


def fields_from_deepspeed(config: Mapping[str, Any]) -> dict[str, Any]:
    """Return Zero3Config keyword arguments for a DeepSpeed config mapping."""
    if "zero_optimization" not in config:
        raise ValueError(
            "the DeepSpeed config has no zero_optimization section; zero3 needs "
            '{"zero_optimization": {"stage": 3, ...}}'
        )
    fields = _zero_section(config["zero_optimization"])
    fields.update(_precision(config))
    clip = config.get("gradient_clipping")
    if clip is None:
        _log.warning(
            "zero3: the DeepSpeed config sets no gradient_clipping, so zero3 does not clip "
            "(DeepSpeed >= 0.19 would clip at 1.0 by default)"
        )
    elif clip != "auto":
        fields["gradient_clipping"] = float(clip) if float(clip) > 0 else None
    mapped = {
        "zero_optimization",
        "bf16",
        "bfloat16",
        "fp16",
        "gradient_clipping",
        "communication_data_type",
    }
    fields["extras"] = {k: v for k, v in config.items() if k not in mapped}
    return fields
