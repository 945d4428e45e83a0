"""Zero3Config: every knob of the engine in one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import torch

from zero3.core.config._checks import (
    check_bool,
    check_clipping,
    check_float,
    check_int,
    check_timeout,
)
from zero3.core.config._deepspeed import fields_from_deepspeed
from zero3.core.config._leaves import LeafTarget, check_leaf_targets
from zero3.core.config._offload import (
    OFFLOAD_SUB_GROUP_SIZE,
    AioConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    as_section,
)

__all__ = ["Zero3Config", "is_persistent"]

_log = logging.getLogger(__name__)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _parse_dtype(field: str, value: object) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if value is not None and not value.is_floating_point:
            raise ValueError(f"Zero3Config.{field} must be a floating dtype, got {value}")
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ValueError(
        f"Zero3Config.{field} must be None, a torch floating dtype or one of "
        f"{sorted(_DTYPE_NAMES)}, got {value!r}"
    )


@dataclasses.dataclass(frozen=True)
class Zero3Config:
    """Configuration of a sharded model and its optimizer.

    ZeRO fields keep DeepSpeed's names and, except for the gather window, its
    defaults; :meth:`from_deepspeed` maps a DeepSpeed JSON config onto them. Sizes count
    elements, not bytes.

    The gather window (:attr:`prefetch_bucket_size`, :attr:`max_live_parameters`,
    :attr:`max_reuse_distance`, :attr:`overlap_chunk_size`) defaults to ``None``:
    "auto", sized from the sharded model when it is sharded (its largest fetch unit;
    the rule is :func:`~zero3.core.engine.resolve_window`), so that a model of any size
    keeps a bounded window gathered. A value given here (or in a DeepSpeed config) wins.

    Attributes:
        prefetch_bucket_size: Most elements one prefetch gathers ahead of use
            (None: auto).
        max_live_parameters: Prefetching never raises the elements of gathered
            (non-persistent) parameters above this; only the module being run may
            (None: auto).
        max_reuse_distance: On module exit, parameters used again within this many
            elements ahead in the trace (forward *and* backward) stay gathered
            (None: auto, one fetch unit: what the turn from forward into backward
            reuses at once). DeepSpeed's 10**9 keeps a small model whole from forward
            through backward; ``0`` releases every module's parameters on exit.
        param_persistence_threshold: Parameters with at most this many elements stay
            whole on every rank ("persistent"); they are refreshed after each step.
        frozen_params: What a training step does with frozen (``requires_grad=False``)
            partitioned parameters between their forward and backward use.
            ``"regather"`` (the default, the window rule): released on module exit like
            any other and gathered again for backward. ``"keep"``: kept whole from their
            forward to their module's backward, then released: one gather per step
            instead of two (adapter fine-tuning on a frozen base moves about half the
            bytes), at the cost of holding every frozen weight the forward used until
            backward reaches it (up to the whole frozen model, as DDP holds it). The
            live-parameter bound then applies to the rest. ``"replicate"``: kept whole
            from their first gather on, across steps (frozen weights cost their full
            size on every rank, as under DDP, and are never gathered again; an
            in-place edit still reaches the shards at the end of the step); a
            parameter unfrozen later is released again. Not a DeepSpeed field.
        reduce_bucket_size: Elements per gradient bucket (one collective each).
        contiguous_gradients: Gradients are copied into rank-major flat bucket buffers
            on arrival (one collective per bucket); False keeps them as a list until the
            bucket is reduced (the discrete path).
        overlap_comm: Gathers and reductions run asynchronously alongside compute.
        overlap_chunk_size: With :attr:`overlap_comm`, most elements one overlapped
            collective carries (None: auto, from the largest fetch unit): a gradient
            bucket is reduced in chunks of this size as its gradients arrive, and a
            prefetch is issued as gathers of this size split at module boundaries, so
            compute waits for the first chunk only, not for the whole bucket (see
            :ref:`overlap chunks <overlap-chunks>`). Not a DeepSpeed field.
        sub_group_size: Elements per optimizer sub-group (fp32 master chunk). Left
            unset (None) it is 10⁹ (DeepSpeed's default), or 2,097,152 with optimizer
            offload on, so that swapping one sub-group overlaps stepping another (logged).
        backend: Comm backend name for :func:`zero3.comm.create_backend` (``"auto"``).
        leaf_modules: Modules whose whole subtree is gathered on entry and released on
            exit (MoE blocks with routing): module classes, class names (bare or
            qualified) or :class:`~zero3.core.ModulePath` places in the model (DeepSpeed's
            ``leaf_module`` ``classes``, ``names`` and ``name_suffixes``). Every target
            must match a module of the model it shards.
        param_dtype: Parameters are cast to this dtype when sharded (None: keep).
        reduce_dtype: Gradients are reduced and accumulated in this dtype (None: the
            parameters' own).
        grad_reduce_op: ``"reduce_scatter"`` or ``"all_reduce"`` (all-reduce then
            keep this rank's slice: twice the bytes; for comparison).
        gradient_clipping: Clip the global gradient norm to this value in the
            optimizer's step. None or 0 (DeepSpeed's "off") do not clip; it is stored as
            None. Negative, NaN or infinite values are errors.
        loss_scale: fp16 static loss scale; 0 selects dynamic scaling.
        initial_scale_power: Dynamic scaling starts at ``2**initial_scale_power``.
        loss_scale_window: Successful steps before the dynamic scale doubles.
        hysteresis: Overflows tolerated before the dynamic scale halves.
        min_loss_scale: The dynamic scale never drops below this (> 0).
        timeout_s: Timeout of every collective (a stuck peer raises after this long) of
            the backend zero3 creates from :attr:`backend`; a backend passed to
            ``shard_module(comm=...)`` keeps its own ``timeout_s``.
        sync_module_states: Broadcast rank 0's parameters and buffers when sharding,
            so ranks that initialized differently still train one model (as DDP does).
            Meta parameters that ``shard_module`` initialises are broadcast module by
            module; with this off they are checked instead (ranks that initialised them
            differently raise an error).
        offload_optimizer: Where the fp32 masters and optimizer state live between
            steps (:class:`~zero3.core.OffloadOptimizerConfig`; a mapping of its fields
            is accepted). See the Offload guide.
        offload_param: Where parameter shards live
            (:class:`~zero3.core.OffloadParamConfig`).
        aio: How swap files are read and written (:class:`~zero3.core.AioConfig`).
        trim_host_heap: When a backward is half done (the forward's activations it
            freed), when each optimizer step begins (the rest are free) and when it
            ends, hand the host heap's free pages back to the kernel (glibc's
            ``malloc_trim``; nothing with another C library). glibc
            otherwise keeps the heap a step's activations grew to, and what offload
            moves out of memory is refilled by that heap rather than returned.
            None (auto): on when either offload section uses ``"nvme"`` (a user who
            swaps to disk asks for host memory over speed), off otherwise.
            The next step pages the memory it touches in again (page faults; see the
            Offload guide's measurements). Not a DeepSpeed field.
        extras: Read-only mapping of settings zero3 does not act on, kept for the
            training loop: the DeepSpeed keys :meth:`from_deepspeed` leaves to it (batch
            sizes, optimizer, scheduler, offload...) by dotted name (``"optimizer"``,
            ``"zero_optimization.offload_param"``), with the file's values.
    """

    prefetch_bucket_size: int | None = None
    max_live_parameters: int | None = None
    max_reuse_distance: int | None = None
    param_persistence_threshold: int = 100_000
    frozen_params: Literal["regather", "keep", "replicate"] = "regather"
    reduce_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool = True
    overlap_chunk_size: int | None = None
    sub_group_size: int = None  # type: ignore[assignment]  # None: chosen in __post_init__
    backend: str = "auto"
    leaf_modules: tuple[LeafTarget, ...] = ()
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    grad_reduce_op: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    gradient_clipping: float | None = None
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    timeout_s: float = 300.0
    sync_module_states: bool = True
    offload_optimizer: OffloadOptimizerConfig = dataclasses.field(
        default_factory=OffloadOptimizerConfig
    )
    offload_param: OffloadParamConfig = dataclasses.field(default_factory=OffloadParamConfig)
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    trim_host_heap: bool | None = None
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"):
            value = getattr(self, name)
            if value is not None:  # None: auto (sized from the model when sharded)
                self._set(name, check_int(f"Zero3Config.{name}", value, minimum=0))
        if self.overlap_chunk_size is not None:
            self._set(
                "overlap_chunk_size",
                check_int("Zero3Config.overlap_chunk_size", self.overlap_chunk_size, minimum=1),
            )
        for name in ("param_persistence_threshold", "initial_scale_power"):
            self._set(name, check_int(f"Zero3Config.{name}", getattr(self, name), minimum=0))
        self._offload_sections()
        for name in (
            "reduce_bucket_size",
            "sub_group_size",
            "loss_scale_window",
            "hysteresis",
        ):
            self._set(name, check_int(f"Zero3Config.{name}", getattr(self, name), minimum=1))
        for name in ("contiguous_gradients", "overlap_comm", "sync_module_states"):
            check_bool(f"Zero3Config.{name}", getattr(self, name))
        if self.trim_host_heap is not None:
            check_bool("Zero3Config.trim_host_heap", self.trim_host_heap)
        if not isinstance(self.backend, str) or not self.backend:
            raise TypeError(f"Zero3Config.backend must be a backend name, got {self.backend!r}")
        self._set("leaf_modules", check_leaf_targets("Zero3Config.leaf_modules", self.leaf_modules))
        self._set("param_dtype", _parse_dtype("param_dtype", self.param_dtype))
        self._set("reduce_dtype", _parse_dtype("reduce_dtype", self.reduce_dtype))
        if self.frozen_params not in ("regather", "keep", "replicate"):
            raise ValueError(
                "Zero3Config.frozen_params must be 'regather' (release frozen parameters on "
                "module exit, gather them again for backward), 'keep' (keep them whole "
                "until their backward) or 'replicate' (keep them whole across steps), got "
                f"{self.frozen_params!r}"
            )
        if self.grad_reduce_op not in ("reduce_scatter", "all_reduce"):
            raise ValueError(
                "Zero3Config.grad_reduce_op must be 'reduce_scatter' or 'all_reduce', "
                f"got {self.grad_reduce_op!r}"
            )
        self._set(
            "gradient_clipping",
            check_clipping("Zero3Config.gradient_clipping", self.gradient_clipping),
        )
        self._set("loss_scale", check_float("Zero3Config.loss_scale", self.loss_scale, minimum=0))
        self._set(
            "min_loss_scale",
            check_float("Zero3Config.min_loss_scale", self.min_loss_scale, positive=True),
        )
        self._set("timeout_s", check_timeout("Zero3Config.timeout_s", self.timeout_s))
        if not isinstance(self.extras, Mapping):
            raise TypeError(
                f"Zero3Config.extras must be a mapping, got {type(self.extras).__name__}"
            )
        self._set("extras", MappingProxyType(dict(self.extras)))

    def _offload_sections(self) -> None:
        for name, cls in (
            ("offload_optimizer", OffloadOptimizerConfig),
            ("offload_param", OffloadParamConfig),
            ("aio", AioConfig),
        ):
            self._set(name, as_section(f"Zero3Config.{name}", cls, getattr(self, name)))  # type: ignore[type-var]
        if self.sub_group_size is not None:
            return
        if not self.offload_optimizer.enabled:
            self._set("sub_group_size", 1_000_000_000)
        else:
            # One sub-group per model would leave nothing to overlap with the I/O.
            self._set("sub_group_size", OFFLOAD_SUB_GROUP_SIZE)
            _log.info(
                "zero3: optimizer offload with sub_group_size at its default: stepping "
                "sub-groups of %s elements so that swapping overlaps stepping (set "
                "sub_group_size to choose)",
                f"{OFFLOAD_SUB_GROUP_SIZE:,}",
            )

    @property
    def trims_host_heap(self) -> bool:
        """Whether the host heap is trimmed half way through each backward and as each
        optimizer step begins and ends (:attr:`trim_host_heap`, with auto resolved).
        """
        if self.trim_host_heap is not None:
            return self.trim_host_heap
        optimizer, param = self.offload_optimizer, self.offload_param
        return (optimizer.enabled and optimizer.device == "nvme") or param.device == "nvme"

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # The read-only extras (a MappingProxyType) cannot be pickled or deep-copied
        # as they are: rebuild from the fields, which checks them again.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["extras"] = dict(self.extras)
        return _rebuild, (fields,)

    # -- DeepSpeed ------------------------------------------------------------------

    @classmethod
    def from_deepspeed(
        cls, config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
    ) -> Zero3Config:
        """Build a config from a DeepSpeed JSON config (a dict or a path to the file).

        Every key DeepSpeed reads is known (the table in the configuration docs): ZeRO
        keys map onto the fields of the same meaning (``zero_optimization.stage`` must
        be 3, ``leaf_module`` fills :attr:`leaf_modules`), ``bf16`` / ``fp16`` select
        :attr:`param_dtype` and fp16 loss scaling, ``gradient_clipping`` and
        ``communication_data_type`` map directly. ``"auto"`` is resolved as the HF
        Trainer does without TrainingArguments (precision off, clipping 1.0, batch
        sizes, optimizer and scheduler left to the training loop, anything else
        DeepSpeed's default) and each resolution is logged. Keys zero3 does not act on
        (batch sizes, optimizer, scheduler, offload...) are logged once at INFO with what
        to do instead and kept in :attr:`extras` under their dotted names. A wrong type
        or value, an unknown key (a typo), a ``null`` section or a setting zero3 cannot
        run is an error naming the key.

        Args:
            config: The DeepSpeed config as a mapping, or a path to its JSON file.
            **overrides: Zero3Config fields that win over the file's values (the file is
                still checked, but the keys these fields replace are not refused for
                contradicting each other: ``param_dtype=`` settles bf16 vs fp16).

        Raises:
            ValueError: Unreadable file, unsupported stage, unknown key, a bad value or a
                setting zero3 cannot run.
            TypeError: A value of the wrong type.
        """
        if isinstance(config, str | os.PathLike):
            config = _load_json(Path(config))
        if not isinstance(config, Mapping):
            raise TypeError(
                f"a DeepSpeed config must be a mapping or a path, got {type(config).__name__}"
            )
        fields = fields_from_deepspeed(config, overrides=overrides.keys())
        fields.update(overrides)
        return cls(**fields)


def _rebuild(fields: dict[str, Any]) -> Zero3Config:
    """A pickled or deep-copied :class:`Zero3Config` back (see ``__reduce__``)."""
    return Zero3Config(**fields)


def _load_json(path: Path) -> Any:
    """Parse a JSON file; a repeated key is an error (JSON would keep the last silently)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"DeepSpeed config {path}: key {key!r} appears twice")
            seen[key] = value
        return seen

    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"DeepSpeed config {path}: cannot read it ({exc})") from exc
    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {exc}") from exc


def is_persistent(
    numel: int, world_size: int, config: Zero3Config, *, offloaded: bool = False
) -> bool:
    """Whether a parameter stays whole on every rank.

    A world of one keeps everything whole, unless parameter shards are ``offloaded``
    (:meth:`~zero3.core.OffloadParamConfig.moves_shards`): then the parameters above the threshold
    live off the device as at any world size, each "shard" a whole parameter, fetched
    for its module and let go after it, which is what lets one device train a model
    larger than its memory.
    """
    if numel <= config.param_persistence_threshold:
        return True
    return world_size == 1 and not offloaded
