"""The DeepSpeed keys zero3 knows: how each is checked and what happens to it.

Every key DeepSpeed 0.19 reads is in one of these tables (``deepspeed/runtime/config.py``,
``zero/config.py``, ``precision_config.py``, ``constants.py``), so that an unknown key is
a typo and an error. :mod:`zero3.core.config._deepspeed` reads a config with them; see its
Note for what mapped, honoured, not acted on and refused mean.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

from zero3.core.config._checks import check_bool, check_float, check_int
from zero3.core.config._leaves import LeafTarget, ModulePath

AUTO = "auto"


# -- value checks (each names the dotted DeepSpeed key) ----------------------------------


def _ints(minimum: int) -> Callable[[str, Any], int]:
    return lambda label, value: check_int(label, value, minimum=minimum)


def _size_at_least_one(label: str, value: Any) -> int:
    # DeepSpeed accepts 0 for these sizes and then gives every parameter its own
    # bucket / sub-group; zero3 needs at least one element and spells that 1.
    return max(1, check_int(label, value, minimum=0))


def _positive(label: str, value: Any) -> float:
    return check_float(label, value, positive=True)


def _non_negative(label: str, value: Any) -> float:
    return check_float(label, value, minimum=0.0)


def _optional_int(label: str, value: Any) -> int | None:
    return None if value is None else check_int(label, value, minimum=0)


def _batch(label: str, value: Any) -> int | None:
    return None if value is None else check_int(label, value, minimum=1)


def _string(label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{label} must be a string, got {value!r}")
    return value


def _optional_bool(label: str, value: Any) -> bool | None:
    return None if value is None else check_bool(label, value)


def mapping(label: str, value: Any) -> Mapping[str, Any]:
    """A JSON object; ``null`` is an error naming the key (remove it for the defaults)."""
    if not isinstance(value, Mapping):
        got = "null" if value is None else repr(value)
        raise TypeError(
            f"{label} must be a JSON object (a mapping), got {got}; remove the key to use "
            "DeepSpeed's defaults"
        )
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"{label} has a non-string key {key!r}")
    return value


def _section(label: str, value: Any) -> Mapping[str, Any]:
    """A feature section: a mapping whose ``enabled`` (if any) is a bool or ``"auto"``."""
    section = mapping(label, value)
    if "enabled" in section and section["enabled"] != AUTO:
        check_bool(f"{label}.enabled", section["enabled"])
    return section


def _tensor_parallel(label: str, value: Any) -> Mapping[str, Any]:
    section = _section(label, value)
    if "autotp_size" in section:
        check_int(f"{label}.autotp_size", section["autotp_size"], minimum=0)
    return section


def _optional_section(label: str, value: Any) -> Mapping[str, Any] | None:
    return None if value is None else _section(label, value)


_DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "bfp16": "bf16", "torch.bfloat16": "bf16",
}  # fmt: skip


def dtype_name(label: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in _DTYPE_NAMES:
        raise ValueError(f"{label} must be one of 'fp32', 'fp16', 'bf16' or null, got {value!r}")
    return _DTYPE_NAMES[value.lower()]


def _on(value: Any) -> bool:
    return value is not None and value is not False and value != 0


def _enabled(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is True


def _present(value: Any) -> bool:
    return value is not None and value != {}


def _always(value: Any) -> bool:
    return True


def no_unknown(label: str, section: Mapping[str, Any], known: Collection[str]) -> None:
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else "known keys: " + ", ".join(sorted(known))
            )
            raise ValueError(
                f"{label + '.' if label else ''}{key} is not a DeepSpeed setting zero3 "
                f"knows (a typo?); {hint}"
            )


# -- key tables ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Key:
    """How one DeepSpeed key is read.

    Attributes:
        check: Validates the value (errors name the dotted key) and normalizes it.
        field: The Zero3Config field it sets (mapped keys).
        default: DeepSpeed's default: what ``"auto"`` resolves to.
        auto: Why, in the log line of a resolved ``"auto"``.
        loop: ``"auto"`` is the training loop's to resolve (stays ``"auto"``).
        todo: Not acted on when :attr:`active`: what to do instead (logged, extras).
        refuse: Refused when :attr:`active`: why (the error text).
        active: Whether a value asks for something (else it is honoured as is).
        about: The field a resolved ``"auto"`` decides when it is not :attr:`field`
            (its log line is dropped when a keyword argument sets that field).
        spellings: The names DeepSpeed reads this one setting under (``stage3_`` and
            plain, old names), when it has several: given twice with different values
            it is an error naming both (DeepSpeed would keep one of them silently).
        costs: What not acting on the key changes for the run (``"memory"`` or
            ``"numerics"``); such a key is logged at WARNING, the others at INFO.
    """

    check: Callable[[str, Any], Any]
    field: str | None = None
    default: Any = None
    auto: str = ""
    loop: bool = False
    todo: str = ""
    refuse: str = ""
    active: Callable[[Any], bool] = _on
    about: str | None = None
    spellings: tuple[str, ...] = ()
    costs: str = ""


_NO_OFFLOAD = (
    "ZeRO-1/2's offload switches are not read at stage 3: write "
    'offload_optimizer {"device": "cpu"} (and offload_param) instead'
)
_FULL_PRECISION_COMM = (
    "zero3 gathers and reduces in the tensors' own dtype (reduce_dtype for gradients), "
    "never quantized: the results are the unquantized ones"
)
_ALL_RANKS = "zero3 shards every parameter over all ranks of its group (no sub-groups)"
_FP32_MASTERS = "zero3 always keeps fp32 master weights and optimizer states"
_SAVE_16BIT = (
    "save full weights with zero3.hooks.full_state_dict(model, rank0_only=True) "
    "(a collective: call it on every rank)"
)


def _offload_device(label: str, value: Any) -> str:
    if value == AUTO:  # DeepSpeed reads "auto" as none
        return "none"
    if value not in ("none", "cpu", "nvme"):
        raise ValueError(f"{label} must be 'none', 'cpu' or 'nvme', got {value!r}")
    return str(value)


def _optional_path(label: str, value: Any) -> str | None:
    return None if value is None else _string(label, value)


def _fraction(label: str, value: Any) -> float:
    ratio = check_float(label, value, minimum=0.0)
    if ratio > 1.0:
        raise ValueError(f"{label} is a fraction of the sub-groups (0..1), got {ratio}")
    return ratio


def _stage(label: str, value: Any) -> int:
    stage = check_int(label, value, minimum=0)
    if stage != 3:
        raise ValueError(f'{label} is {stage}: zero3 implements ZeRO stage 3 only (set "stage": 3)')
    return stage


def _leaf_module(label: str, value: Any) -> tuple[LeafTarget, ...]:
    """DeepSpeed's ``leaf_module``: ``classes`` are class names, ``names`` and
    ``name_suffixes`` module paths (each a string or a list of strings).
    """
    if value is None:  # DeepSpeed reads null as "no leaf_module settings"
        return ()
    section = mapping(label, value)
    no_unknown(label, section, frozenset({"classes", "names", "name_suffixes"}))
    lists: dict[str, list[str]] = {}
    for key in ("classes", "names", "name_suffixes"):
        entries = section.get(key, [])
        entries = [entries] if isinstance(entries, str) else entries
        if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
            raise TypeError(
                f"{label}.{key} must be a string or a list of non-empty strings, got "
                f"{section.get(key)!r}"
            )
        lists[key] = entries
    targets: list[LeafTarget] = [
        *lists["classes"],
        *(ModulePath(n) for n in lists["names"]),
        *(ModulePath(s, suffix=True) for s in lists["name_suffixes"]),
    ]
    return tuple(dict.fromkeys(targets))  # DeepSpeed drops repeats too


def _k(*names: str, **spec: Any) -> dict[str, Key]:
    """Several keys read the same way (each its own setting)."""
    key = Key(**spec)
    return dict.fromkeys(names, key)


def _aka(*names: str, **spec: Any) -> dict[str, Key]:
    """One setting under several names (``stage3_prefetch_bucket_size`` and
    ``prefetch_bucket_size``): see :attr:`Key.spellings`.
    """
    key = Key(**spec, spellings=names)
    return dict.fromkeys(names, key)


def same_setting_twice(section: Mapping[str, Any], table: Mapping[str, Key]) -> list[str]:
    """The names under which ``section`` gives one setting different values."""
    for key in section:
        spellings = table[key].spellings if key in table else ()
        given = [name for name in spellings if name in section]
        if len(given) > 1 and any(section[n] != section[given[0]] for n in given[1:]):
            return given
    return []


#: Why an "auto" (or absent) gather-window key is not DeepSpeed's absolute default.
_WINDOW_AUTO = (
    "zero3 sizes the gather window from the model when it is sharded instead of "
    "DeepSpeed's absolute default; see GatherWindow"
)


_PIPELINED = dict(check=check_bool, default=False, active=lambda v: False)
_NOT_APPLICABLE = (
    "not applicable: zero3 steps offloaded state with the wrapped torch optimizer "
    "(no DeepSpeed CPU-Adam or SuperOffload kernel)"
)

#: ``zero_optimization.offload_optimizer``: fields of Zero3Config.offload_optimizer.
OFFLOAD_OPTIMIZER: dict[str, Key] = {
    **_k("device", check=_offload_device, field="offload_optimizer.device", default="none"),
    **_k("nvme_path", check=_optional_path, field="offload_optimizer.nvme_path"),
    **_k("pin_memory", check=check_bool, field="offload_optimizer.pin_memory", default=False),
    **_k("buffer_count", check=_ints(2), field="offload_optimizer.buffer_count", default=4),
    **_k("ratio", check=_fraction, field="offload_optimizer.ratio", default=1.0),
    # zero3 always reads ahead and writes behind; fast_init has no effect on its files.
    **_k("pipeline_read", "pipeline_write", "fast_init", **_PIPELINED),
    **_k("super_offload", check=check_bool, default=False, todo=_NOT_APPLICABLE,
         costs="speed"),
    **_k("cpuadam_cores_perc", check=_non_negative, default=0.8, active=lambda v: True,
         todo=_NOT_APPLICABLE + "; set torch.set_num_threads for the CPU step",
         costs="speed"),
}  # fmt: skip

#: ``zero_optimization.offload_param``: fields of Zero3Config.offload_param.
OFFLOAD_PARAM: dict[str, Key] = {
    **_k("device", check=_offload_device, field="offload_param.device", default="none"),
    **_k("nvme_path", check=_optional_path, field="offload_param.nvme_path"),
    **_k("pin_memory", check=check_bool, field="offload_param.pin_memory", default=False),
    **_k("buffer_count", check=_ints(1), field="offload_param.buffer_count", default=5),
    **_k("buffer_size", check=_ints(1), field="offload_param.buffer_size",
         default=100_000_000),
    **_k("max_in_cpu", check=_ints(0), field="offload_param.max_in_cpu",
         default=1_000_000_000),
}  # fmt: skip

_AIO_NA = "not applicable: zero3's I/O threads submit each request on its own (no libaio)"

#: ``aio``: fields of Zero3Config.aio (zero3's direct-I/O thread pool).
AIO: dict[str, Key] = {
    **_k("block_size", check=_ints(4096), field="aio.block_size", default=1_048_576),
    **_k("queue_depth", check=_ints(1), field="aio.queue_depth", default=8),
    **_aka("intra_op_parallelism", "thread_count", check=_ints(1), field="aio.thread_count",
           default=1),
    **_k("single_submit", check=check_bool, default=False, todo=_AIO_NA, costs="speed"),
    **_k("overlap_events", check=check_bool, default=True, active=lambda v: v is False,
         todo=_AIO_NA, costs="speed"),
    **_k("use_gds", check=check_bool, default=False,
         todo="not applicable: zero3 reads swap files into host buffers (no GPUDirect "
         "Storage)", costs="speed"),
}  # fmt: skip


ZERO: dict[str, Key] = {
    **_k("stage", check=_stage, default=0, active=_always),
    **_aka(
        "stage3_prefetch_bucket_size", "prefetch_bucket_size",
        check=_ints(0), field="prefetch_bucket_size", default=None, auto=_WINDOW_AUTO,
    ),
    **_aka(
        "stage3_param_persistence_threshold", "param_persistence_threshold",
        check=_ints(0), field="param_persistence_threshold", default=100_000,
        auto="the HF Trainer would use 10 * hidden_size of the model",
    ),
    **_aka(
        "stage3_max_live_parameters", "max_live_parameters",
        check=_ints(0), field="max_live_parameters", default=None, auto=_WINDOW_AUTO,
    ),
    **_aka(
        "stage3_max_reuse_distance", "max_reuse_distance",
        check=_ints(0), field="max_reuse_distance", default=None, auto=_WINDOW_AUTO,
    ),
    **_k(
        "reduce_bucket_size", check=_size_at_least_one, field="reduce_bucket_size",
        default=500_000_000, auto="the HF Trainer would use hidden_size**2 of the model",
    ),
    **_k("sub_group_size", check=_size_at_least_one, field="sub_group_size",
         default=1_000_000_000),
    **_k("contiguous_gradients", check=check_bool, field="contiguous_gradients", default=True),
    **_k("overlap_comm", check=check_bool, field="overlap_comm", default=True),
    **_k("reduce_scatter", check=check_bool, field="grad_reduce_op", default=True),
    **_k("leaf_module", check=_leaf_module, field="leaf_modules", default=None),
    # Stage 1/2 settings, or behaviour zero3 always has: nothing to do at stage 3.
    **_k(
        "allgather_partitions", "use_multi_rank_bucket_allreduce", "round_robin_gradients",
        "ignore_unused_parameters", "elastic_checkpoint", "legacy_stage1",
        "memory_efficient_linear", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
        check=check_bool, default=False, active=lambda v: False,
    ),
    **_k("allgather_bucket_size", check=_ints(0), default=500_000_000, active=lambda v: False),
    **_k(
        "load_from_fp32_weights", check=check_bool, default=True, active=lambda v: v is False,
        todo="zero3's optimizer checkpoints always restore the fp32 masters themselves",
        costs="numerics",
    ),
    **_aka(
        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        check=check_bool, default=False, todo=_SAVE_16BIT,
    ),
    **_aka(
        "stage3_model_persistence_threshold", "model_persistence_threshold",
        check=_ints(0), default=sys.maxsize, active=lambda v: v < sys.maxsize,
        todo="zero3 puts no total cap on persistent parameters: lower "
        "stage3_param_persistence_threshold to keep fewer of them whole",
        costs="memory",
    ),
    **_aka(
        "stage3_module_granularity_threshold", "module_granularity_threshold",
        check=_ints(0), default=0,
        todo="mark fine-grained modules as leaves instead (leaf_module / "
        "Zero3Config.leaf_modules): each is then gathered in one collective",
        costs="memory",
    ),
    **_aka(
        "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
        check=check_bool, default=False,
        todo="zero3 gathers parameters with its own bucketed all-gathers (same values)",
    ),
    **_aka(
        "stage3_allgather_sequential", "allgather_sequential",
        check=check_bool, default=False,
        todo="zero3 gathers parameters with its own bucketed all-gathers (same values)",
    ),
    **_k(
        "override_module_apply", check=check_bool, default=True,
        todo="zero3 does not gather inside model.apply(): wrap weight edits of a sharded "
        "model in zero3.core.gathered_parameters(params, modifier_rank=0)",
    ),
    **_k(
        "pipeline_loading_checkpoint", check=check_bool, default=False,
        todo="load weights with zero3.hooks.load_full_state_dict",
    ),
    **_k(
        "log_trace_cache_warnings", check=check_bool, default=False,
        todo="zero3 warns on the 'zero3.core' logger at the first trace invalidation and "
        "counts them in zero3.hooks.stats(model).trace_invalidations",
    ),
    # Memory placement and compressed communication: same training, other costs.
    # Read key by key with OFFLOAD_PARAM / OFFLOAD_OPTIMIZER (null: DeepSpeed's "off").
    **_k("offload_param", "offload_optimizer", check=_optional_section,
         active=lambda v: False),
    **_k(
        "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
        check=_optional_bool, todo=_NO_OFFLOAD,
        costs="memory",
    ),
    **_k(
        "zenflow", check=_optional_section, active=lambda v: v is not None,
        todo="zero3 applies every gradient at every step (no ZenFlow selection or offload)",
        costs="memory",
    ),
    **_k(
        "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        check=check_bool, default=False, todo=_FULL_PRECISION_COMM,
        costs="numerics",
    ),
    **_k(
        "zeropp_loco_param", check=_optional_section, active=lambda v: v is not None,
        todo=_FULL_PRECISION_COMM,
        costs="numerics",
    ),
    **_k(
        "zero_hpz_partition_size", check=_ints(0), default=1, active=lambda v: v > 1,
        todo=_ALL_RANKS,
        costs="memory",
    ),
    **_k(
        "mics_shard_size", check=lambda label, v: check_int(label, v, minimum=-1),
        default=-1, active=lambda v: v > 0, todo=_ALL_RANKS,
        costs="memory",
    ),
    **_k("mics_hierarchical_params_gather", check=check_bool, default=False, todo=_ALL_RANKS,
         costs="memory"),
}  # fmt: skip

FP16: dict[str, Key] = {
    **_k(
        "enabled", check=check_bool, default=False, active=lambda v: False,
        about="param_dtype",
        auto='precision stays off unless set: write true, or pass param_dtype="fp16"',
    ),
    **_k("loss_scale", check=_non_negative, field="loss_scale", default=0.0),
    **_k("initial_scale_power", check=_ints(0), field="initial_scale_power", default=16),
    **_k("loss_scale_window", check=_ints(1), field="loss_scale_window", default=1000),
    **_k("hysteresis", check=_ints(1), field="hysteresis", default=2),
    **_k("min_loss_scale", check=_positive, field="min_loss_scale", default=1.0),
    **_k(
        "auto_cast", check=check_bool, default=False,
        todo="zero3 casts parameters (param_dtype), not inputs: cast the batch to "
        "torch.float16 in the training loop",
        costs="numerics",
    ),
    **_k(
        "consecutive_hysteresis", check=check_bool, default=False,
        todo="zero3's dynamic loss scaler does not refill hysteresis after clean steps",
        costs="numerics",
    ),
    **_k("fp16_master_weights_and_grads", check=check_bool, default=False, todo=_FP32_MASTERS,
         costs="memory"),
}  # fmt: skip

BF16: dict[str, Key] = {
    **_k(
        "enabled", check=check_bool, default=False, active=lambda v: False,
        about="param_dtype",
        auto='precision stays off unless set: write true, or pass param_dtype="bf16"',
    ),
    # DeepSpeed's stage 3 checks overflow with fp16 only, as zero3 does, and
    # immediate_grad_update belongs to its stage 0/1 bf16 optimizer.
    **_k(
        "check_grad_overflow", "immediate_grad_update",
        check=check_bool, default=False, active=lambda v: False,
    ),
    **_k(
        "bf16_master_weights_and_grads", "bf16_optimizer_states", check=check_bool,
        default=False, todo=_FP32_MASTERS,
        costs="memory",
    ),
}  # fmt: skip

DATA_TYPES: dict[str, Key] = {
    **_k("grad_accum_dtype", check=dtype_name, active=lambda v: False),
    **_k("param_dtype", check=dtype_name, active=lambda v: False),
    **_k(
        "buffer_dtype", check=dtype_name,
        todo="zero3 keeps buffers in their dtype: cast them (module.to) before shard_module",
        costs="numerics",
    ),
}  # fmt: skip

_LOOP = dict(check=_section, loop=True, active=_always)
_OFF = dict(check=_section, active=_enabled)
_NOTHING = "nothing to set in zero3"

TOP: dict[str, Key] = {
    **_k(
        "train_batch_size", check=_batch, loop=True, active=_always,
        todo="the loop sets the batch: micro batch x accumulation x world size",
    ),
    **_k(
        "train_micro_batch_size_per_gpu", check=_batch, loop=True, active=_always,
        todo="the loop feeds this many samples per rank per micro-step",
    ),
    **_k(
        "gradient_accumulation_steps", check=_batch, loop=True, active=_always,
        todo="the loop runs this many forward/backward passes per optimizer.step()",
    ),
    **_k(
        "managed_gradient_accumulation", check=check_bool, loop=True, active=_always,
        todo="the loop decides when to call optimizer.step()",
    ),
    **_k(
        "optimizer", **_LOOP,
        todo="build it in the loop: PartitionedOptimizer(model, torch.optim.<type>, **params)",
    ),
    **_k(
        "scheduler", **_LOOP,
        todo="build a torch.optim.lr_scheduler on the PartitionedOptimizer",
    ),
    **_k("steps_per_print", check=_optional_int, loop=True, active=_always,
         todo="print from the loop"),
    **_k(
        "prescale_gradients", check=check_bool, default=False,
        todo="zero3 averages gradients with the backend's AVG reduction (same mean; "
        "for fp16 overflow in the sum use communication_data_type fp32)",
        costs="numerics",
    ),
    **_k(
        "gradient_predivide_factor", check=_positive, default=1.0, active=lambda v: v != 1.0,
        todo="zero3 averages gradients with the backend's AVG reduction (same mean; "
        "for fp16 overflow in the sum use communication_data_type fp32)",
        costs="numerics",
    ),
    **_k(
        "gradient_allreduce_op", check=_string, default="mean",
        active=lambda v: v.lower() != "mean",
        refuse="must be 'mean' (DeepSpeed refuses 'sum' at ZeRO stage 3 too): zero3 "
        "averages gradients over the ranks",
    ),
    **_k("activation_checkpointing", **_LOOP,
         todo="checkpoint inside the model with torch.utils.checkpoint (use_reentrant=False)",
         costs="memory"),
    **_k("checkpoint", **_LOOP,
         todo="save and load with zero3's checkpoints (full_state_dict, optimizer state)"),
    **_k("tensorboard", "wandb", "csv_monitor", "comet", **_OFF, todo="log from the loop"),
    **_k("comms_logger", **_OFF,
         todo="zero3.hooks.stats(model) counts collectives and bytes per step"),
    **_k("flops_profiler", **_OFF, todo="use torch.profiler"),
    **_k("wall_clock_breakdown", check=check_bool, default=False,
         todo="time steps in the loop; zero3.core.Tracer records a trace per rank"),
    **_k("memory_breakdown", check=check_bool, default=False,
         todo="read torch.cuda.memory_stats() / process RSS in the loop"),
    **_k("dump_state", check=check_bool, default=False, todo="print(config) in the loop"),
    **_k("dataloader_drop_last", check=check_bool, default=False,
         todo="pass drop_last to the loop's DataLoader"),
    **_k("log_level", check=_string, loop=True, active=_always,
         todo="set logging levels in the loop (zero3 logs on 'zero3.*' loggers)"),
    **_k("data_efficiency", "curriculum_learning", **_OFF,
         todo="the loop owns data sampling", costs="numerics"),
    **_k("progressive_layer_drop", **_OFF, todo="the model must implement layer drop",
         costs="numerics"),
    **_k("eigenvalue", "quantize_training", "compression_training", "weight_quantization",
         check=_section, active=_present,
         todo="DeepSpeed's compression library is not part of zero3", costs="numerics"),
    **_k("sparse_attention", check=_section, active=_present,
         todo="sparse attention belongs to the model's code", costs="numerics"),
    **_k("pipeline", check=_section, active=_present,
         todo="settings of DeepSpeed's PipelineModule, which zero3 does not have"),
    **_k("torch_autocast", **_OFF,
         todo="wrap the forward in torch.autocast(device_type, dtype) in the loop",
         costs="numerics"),
    **_k("amp", **_OFF,
         todo="Apex AMP is not used: set param_dtype (bf16/fp16 sections) or wrap the "
         "forward in torch.autocast", costs="numerics"),
    **_k("graph_harvesting", check=check_bool, default=False, todo=_NOTHING),
    **_k("sparse_gradients", check=check_bool, default=False,
         todo="zero3 reduces dense gradients (same values)"),
    **_k("hybrid_engine", **_OFF, todo="zero3 has no RLHF hybrid inference engine"),
    **_k("compile", check=_section, active=lambda v: bool(v.get("deepcompile")),
         todo="zero3 does not run DeepCompile"),
    **_k("timers", "nebula", "datastates_ckpt", check=_section, active=_present,
         todo=_NOTHING + " (DeepSpeed engine internals)"),
    **_k("elasticity", **_OFF, todo="the loop sets batch sizes for the world it runs on"),
    **_k("vocabulary_size", check=_optional_int, active=lambda v: False),
    **_k("seq_parallel_communication_data_type", check=dtype_name, active=lambda v: False),
    **_k("use_data_before_expert_parallelism", check=check_bool, default=False,
         active=lambda v: False),
    **_k("zero_allow_untested_optimizer", "disable_allgather",
         check=check_bool, default=False, active=lambda v: False),
    **_k("zero_force_ds_cpu_optimizer", check=check_bool, default=True,
         active=lambda v: False),
    **_k("tensor_parallel", check=_tensor_parallel,
         active=lambda v: v.get("autotp_size", 0) > 1,
         refuse="zero3 is data parallel only (every rank holds a 1/N shard of every "
         "parameter): remove the section or set autotp_size to 0"),
    **_k("expert_parallel", check=_section, active=_enabled,
         refuse="zero3 is data parallel only: remove the section or set enabled false"),
    **_k("sequence_parallel_size", check=_ints(1), default=1, active=lambda v: v > 1,
         refuse="zero3 is data parallel only: set it to 1"),
}  # fmt: skip

# Top-level keys with their own readers below (sections or cross-key rules).
SPECIAL = ("zero_optimization", "fp16", "bf16", "bfloat16", "data_types", "aio",
            "communication_data_type", "gradient_clipping")  # fmt: skip


def known_keys() -> dict[str, tuple[str, ...]]:
    """Every DeepSpeed key the reader knows, by section (for docs and tests)."""
    return {
        "": tuple(sorted({*TOP, *SPECIAL})),
        "zero_optimization": tuple(sorted(ZERO)),
        "fp16": tuple(sorted(FP16)),
        "bf16": tuple(sorted(BF16)),
        "data_types": tuple(sorted(DATA_TYPES)),
        "zero_optimization.offload_optimizer": tuple(sorted(OFFLOAD_OPTIMIZER)),
        "zero_optimization.offload_param": tuple(sorted(OFFLOAD_PARAM)),
        "aio": tuple(sorted(AIO)),
    }
