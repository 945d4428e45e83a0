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
from torch import nn

__all__ = ["Zero3Config"]

_log = logging.getLogger(__name__)

LeafTarget = type[nn.Module] | str

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

    ZeRO fields keep DeepSpeed's names and defaults; :meth:`from_deepspeed` maps a
    DeepSpeed JSON config onto them. Sizes count elements, not bytes.

    Attributes:
        prefetch_bucket_size: Most elements one prefetch gathers ahead of use.
        max_live_parameters: Prefetching never raises the elements of gathered
            (non-persistent) parameters above this; only the module being run may.
        max_reuse_distance: On module exit, parameters used again within this many
            elements ahead in the trace (forward *and* backward) stay gathered. With the
            default, a small model stays whole from forward through backward, as in
            DeepSpeed; ``0`` releases every module's parameters on exit.
        param_persistence_threshold: Parameters with at most this many elements stay
            whole on every rank ("persistent"); they are refreshed after each step.
        reduce_bucket_size: Elements per gradient bucket (one collective each).
        contiguous_gradients: Gradients are copied into rank-major flat bucket buffers
            on arrival (one collective per bucket); False keeps them as a list until the
            bucket is reduced (the discrete path).
        overlap_comm: Gathers and reductions run asynchronously alongside compute.
        overlap_chunk_size: With :attr:`overlap_comm`, most elements one overlapped
            collective carries: a gradient bucket is reduced in chunks of this size as
            its gradients arrive, and a prefetch is issued as gathers of this size split
            at module boundaries, so compute waits for the first chunk only, not for
            the whole bucket (see :ref:`overlap chunks <overlap-chunks>`). Not a DeepSpeed field.
        sub_group_size: Elements per optimizer sub-group (fp32 master chunk).
        backend: Comm backend name for :func:`zero3.comm.create_backend` (``"auto"``).
        leaf_modules: Module classes or qualified class names whose whole subtree is
            gathered on entry and released on exit (MoE blocks with routing).
        param_dtype: Parameters are cast to this dtype when sharded (None: keep).
        reduce_dtype: Gradients are reduced and accumulated in this dtype (None: the
            parameters' own).
        grad_reduce_op: ``"reduce_scatter"`` or ``"all_reduce"`` (the seed's §5.2 path:
            all-reduce then slice, twice the bytes; for comparison).
        gradient_clipping: Clip the global gradient norm to this value in the
            optimizer's step (None: no clipping).
        loss_scale: fp16 static loss scale; 0 selects dynamic scaling.
        initial_scale_power: Dynamic scaling starts at ``2**initial_scale_power``.
        loss_scale_window: Successful steps before the dynamic scale doubles.
        hysteresis: Overflows tolerated before the dynamic scale halves.
        min_loss_scale: The dynamic scale never drops below this.
        timeout_s: Timeout of every collective (a stuck peer raises after this long) of
            the backend zero3 creates from :attr:`backend`; a backend passed to
            ``shard_module(comm=...)`` keeps its own ``timeout_s``.
        sync_module_states: Broadcast rank 0's parameters and buffers when sharding,
            so ranks that initialized differently still train one model (as DDP does).
            Meta parameters that ``shard_module`` initialises are broadcast module by
            module; with this off they are checked instead (ranks that initialised them
            differently raise an error).
        extras: Read-only mapping of settings zero3 does not use itself (batch sizes,
            optimizer, scheduler... from a DeepSpeed config), kept for the caller.
    """

    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    reduce_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool = True
    overlap_chunk_size: int = 4_194_304
    sub_group_size: int = 1_000_000_000
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
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (
            "prefetch_bucket_size",
            "max_live_parameters",
            "max_reuse_distance",
            "param_persistence_threshold",
        ):
            self._set(name, self._int(name, getattr(self, name), minimum=0))
        for name in (
            "reduce_bucket_size",
            "overlap_chunk_size",
            "sub_group_size",
            "loss_scale_window",
            "hysteresis",
        ):
            self._set(name, self._int(name, getattr(self, name), minimum=1))
        self._set(
            "initial_scale_power",
            self._int("initial_scale_power", self.initial_scale_power, minimum=0),
        )
        for name in ("contiguous_gradients", "overlap_comm", "sync_module_states"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Zero3Config.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise TypeError(f"Zero3Config.backend must be a backend name, got {self.backend!r}")
        self._set("leaf_modules", self._leaf_targets(self.leaf_modules))
        self._set("param_dtype", _parse_dtype("param_dtype", self.param_dtype))
        self._set("reduce_dtype", _parse_dtype("reduce_dtype", self.reduce_dtype))
        if self.grad_reduce_op not in ("reduce_scatter", "all_reduce"):
            raise ValueError(
                "Zero3Config.grad_reduce_op must be 'reduce_scatter' or 'all_reduce', "
                f"got {self.grad_reduce_op!r}"
            )
        if self.gradient_clipping is not None:
            clip = self._float("gradient_clipping", self.gradient_clipping)
            if clip <= 0:
                raise ValueError(
                    "Zero3Config.gradient_clipping must be > 0 (None turns clipping off), "
                    f"got {clip}"
                )
            self._set("gradient_clipping", clip)
        self._set("loss_scale", self._float("loss_scale", self.loss_scale, minimum=0.0))
        self._set("min_loss_scale", self._float("min_loss_scale", self.min_loss_scale, minimum=0.0))
        timeout = self._float("timeout_s", self.timeout_s)
        if timeout <= 0:
            raise ValueError(f"Zero3Config.timeout_s must be > 0, got {timeout}")
        self._set("timeout_s", timeout)
        if not isinstance(self.extras, Mapping):
            raise TypeError(
                f"Zero3Config.extras must be a mapping, got {type(self.extras).__name__}"
            )
        self._set("extras", MappingProxyType(dict(self.extras)))

    # -- validation helpers ---------------------------------------------------------

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @staticmethod
    def _int(name: str, value: object, *, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"Zero3Config.{name} must be an integer, got {value!r}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"Zero3Config.{name} must be a whole number, got {value}")
        if value < minimum:
            raise ValueError(f"Zero3Config.{name} must be >= {minimum}, got {value}")
        return int(value)

    @staticmethod
    def _float(name: str, value: object, *, minimum: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"Zero3Config.{name} must be a number, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"Zero3Config.{name} must be >= {minimum}, got {value}")
        return float(value)

    @staticmethod
    def _leaf_targets(targets: object) -> tuple[LeafTarget, ...]:
        if isinstance(targets, str | type):
            targets = (targets,)
        if not isinstance(targets, list | tuple):
            raise TypeError(
                "Zero3Config.leaf_modules must be a tuple of nn.Module classes or qualified "
                f"class names, got {targets!r}"
            )
        for target in targets:
            ok = isinstance(target, str) or (
                isinstance(target, type) and issubclass(target, nn.Module)
            )
            if not ok:
                raise TypeError(
                    "Zero3Config.leaf_modules entries must be nn.Module subclasses or class "
                    f"names like 'transformers.models.mixtral.modeling_mixtral."
                    f"MixtralSparseMoeBlock', got {target!r}"
                )
        return tuple(targets)

    # -- DeepSpeed ------------------------------------------------------------------

    @classmethod
    def from_deepspeed(
        cls, config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
    ) -> Zero3Config:
        """Build a config from a DeepSpeed JSON config (a dict or a path to the file).

        The ``zero_optimization`` section maps onto the ZeRO fields (``stage`` must be
        3; an unknown key is an error naming it; an offload or ZeRO++ setting is an error
        saying zero3 lacks it; ``"auto"`` keeps zero3's default). ``bf16`` /
        ``fp16`` select ``param_dtype`` and fp16 loss scaling, ``gradient_clipping``
        maps directly. Every other top-level key (batch sizes, optimizer, scheduler,
        logging...) is kept untouched in :attr:`extras`.

        Args:
            config: The DeepSpeed config as a mapping, or a path to its JSON file.
            **overrides: Zero3Config fields that win over the DeepSpeed values.

        Raises:
            ValueError: Unsupported stage, unknown key, or a feature zero3 lacks.
        """
        from zero3.core._deepspeed import fields_from_deepspeed

        if isinstance(config, str | os.PathLike):
            config = json.loads(Path(config).read_text())
        if not isinstance(config, Mapping):
            raise TypeError(
                f"a DeepSpeed config must be a mapping or a path, got {type(config).__name__}"
            )
        fields = fields_from_deepspeed(config)
        fields.update(overrides)
        return cls(**fields)
