"""Offload sections of :class:`~zero3.core.Zero3Config`: where optimizer state and
parameter shards live, and how the swap files are read and written.

Each section is a frozen dataclass with DeepSpeed's key names and defaults
(``zero_optimization.offload_optimizer``, ``zero_optimization.offload_param``, ``aio``),
so :meth:`Zero3Config.from_deepspeed <zero3.core.Zero3Config.from_deepspeed>` maps them
one to one. A mapping given for a section (a parsed JSON object) is checked and
converted with :func:`as_section`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from zero3.core.config._checks import check_bool, check_float, check_int

__all__ = [
    "OFFLOAD_SUB_GROUP_SIZE",
    "AioConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "as_section",
]

#: Elements per optimizer sub-group when optimizer offload is on and ``sub_group_size``
#: was left at its default: small enough that the benchmark GPTs (a few million elements
#: per rank) are several sub-groups, so reading one overlaps stepping another (the
#: default of 10⁹ makes any model one sub-group and nothing pipelines). See the Offload
#: guide (docs/offload.rst) for the arithmetic.
OFFLOAD_SUB_GROUP_SIZE = 2_097_152

Device = Literal["none", "cpu", "nvme"]


def _device(label: str, value: object) -> Device:
    if value == "auto":  # DeepSpeed reads "auto" as no offload
        return "none"
    if value not in ("none", "cpu", "nvme"):
        raise ValueError(f"{label} must be 'none', 'cpu' or 'nvme', got {value!r}")
    return value


def _path(label: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{label} must be a directory path (a string), got {value!r}")
    return value


def _check_nvme(label: str, device: str, nvme_path: str | None) -> None:
    if device == "nvme" and nvme_path is None:
        raise ValueError(
            f"{label}.device is 'nvme' but {label}.nvme_path is not set: give the directory "
            "the swap files go to (a local disk; it is created if missing)"
        )


@dataclasses.dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where the optimizer's fp32 masters and state live between steps
    (``zero_optimization.offload_optimizer``).

    Attributes:
        device: ``"none"`` (with the parameters), ``"cpu"`` (host memory) or ``"nvme"``
            (swap files under :attr:`nvme_path`).
        nvme_path: Directory of the swap files (``nvme``). Several ranks and both offload
            sections may share it: each rank of each run gets its own files.
        pin_memory: Page-lock the host buffers (faster device copies). Only possible with
            an accelerator; without one it is a no-op, logged once.
        buffer_count: Host buffer bytes in flight at once (``nvme``), in records of a
            full sub-group (``sub_group_size`` elements; a larger parameter's record
            counts as several): the read-ahead plus write-behind depth; at least 2 (one
            stepping, one in I/O).
        ratio: Fraction of the sub-groups offloaded (the first ones); the rest stay where
            the parameters are, as in DeepSpeed's partial offload.
    """

    device: Device = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    ratio: float = 1.0

    def __post_init__(self) -> None:
        label = "Zero3Config.offload_optimizer"
        object.__setattr__(self, "device", _device(f"{label}.device", self.device))
        object.__setattr__(self, "nvme_path", _path(f"{label}.nvme_path", self.nvme_path))
        check_bool(f"{label}.pin_memory", self.pin_memory)
        count = check_int(f"{label}.buffer_count", self.buffer_count, minimum=2)
        object.__setattr__(self, "buffer_count", count)
        ratio = check_float(f"{label}.ratio", self.ratio, minimum=0.0)
        if ratio > 1.0:
            raise ValueError(f"{label}.ratio is a fraction of the sub-groups (0..1), got {ratio}")
        object.__setattr__(self, "ratio", ratio)
        _check_nvme(label, self.device, self.nvme_path)

    @property
    def enabled(self) -> bool:
        """Whether any optimizer state is offloaded."""
        return self.device != "none" and self.ratio > 0


@dataclasses.dataclass(frozen=True)
class OffloadParamConfig:
    """Where parameter shards live between uses (``zero_optimization.offload_param``).

    With ``nvme`` each rank's shards of sharded (not persistent) parameters live in one
    swap file and are read back ahead of each gather, in trace order (see the Offload
    guide, docs/offload.rst).

    Attributes:
        device: ``"none"``, ``"cpu"`` (host memory: where a CPU run keeps them anyway)
            or ``"nvme"``.
        nvme_path: Directory of the swap files (``nvme``; may be the optimizer's).
        pin_memory: Page-lock the host buffers (no-op without an accelerator, logged).
        buffer_count: Shards read ahead at once (reads in flight).
        buffer_size: Elements per read-ahead buffer: at most ``buffer_count *
            buffer_size`` elements are read ahead at once (one shard always may be).
        max_in_cpu: Shard elements kept in host memory for good (``nvme``): the first
            shards in parameter order up to this many stay out of the swap file.
            DeepSpeed's default, 10⁹, keeps every shard of a model with fewer elements
            per rank in memory (logged at shard time); 0 moves them all.
    """

    device: Device = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    def __post_init__(self) -> None:
        label = "Zero3Config.offload_param"
        object.__setattr__(self, "device", _device(f"{label}.device", self.device))
        object.__setattr__(self, "nvme_path", _path(f"{label}.nvme_path", self.nvme_path))
        check_bool(f"{label}.pin_memory", self.pin_memory)
        for name, minimum in (("buffer_count", 1), ("buffer_size", 1), ("max_in_cpu", 0)):
            value = check_int(f"{label}.{name}", getattr(self, name), minimum=minimum)
            object.__setattr__(self, name, value)
        _check_nvme(label, self.device, self.nvme_path)

    @property
    def enabled(self) -> bool:
        """Whether parameter shards are offloaded."""
        return self.device != "none"

    def moves_shards(self, device_type: str) -> bool:
        """Whether shards of a model on ``device_type`` leave where the model is:
        ``nvme`` always, ``cpu`` only from an accelerator (a CPU run's shards are in
        host memory already).
        """
        return self.device == "nvme" or (self.device == "cpu" and device_type != "cpu")


@dataclasses.dataclass(frozen=True)
class AioConfig:
    """How swap files are read and written (DeepSpeed's ``aio`` section, mapped onto
    zero3's pure-Python I/O layer: direct I/O from a small pool of threads).

    Attributes:
        block_size: Bytes per read or write call (a large request is split into these).
        queue_depth: Requests one I/O thread may have queued.
        thread_count: I/O threads (DeepSpeed's ``intra_op_parallelism``; its
            ``thread_count`` is the same setting under its newer name).
        use_direct_io: Open swap files with ``O_DIRECT`` where the filesystem allows it,
            so the page cache does not hold what was moved out. Not a DeepSpeed key (it
            always uses direct I/O).
    """

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    use_direct_io: bool = True

    def __post_init__(self) -> None:
        label = "Zero3Config.aio"
        for name in ("block_size", "queue_depth", "thread_count"):
            value = check_int(f"{label}.{name}", getattr(self, name), minimum=1)
            object.__setattr__(self, name, value)
        if self.block_size % 4096:
            raise ValueError(
                f"{label}.block_size must be a multiple of 4096 (direct I/O moves whole "
                f"pages), got {self.block_size}"
            )
        check_bool(f"{label}.use_direct_io", self.use_direct_io)


_S = TypeVar("_S", OffloadOptimizerConfig, OffloadParamConfig, AioConfig)


def as_section(label: str, cls: type[_S], value: object) -> _S:
    """``value`` as a ``cls`` section: an instance as is, a mapping checked key by key."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{label}: unknown key(s) {unknown}; the section has {sorted(known)}")
        fields: dict[str, Any] = dict(value)
        return cls(**fields)
    raise TypeError(
        f"{label} must be a {cls.__name__} or a mapping of its fields, got {type(value).__name__}"
    )
