"""Model-state memory: what a rank holds (measured) and will hold (estimated).

ZeRO-3's promise is arithmetic: with N ranks each holds 1/N of the parameters, the
gradients and the optimizer state. For fp32 AdamW that is ``16·Ψ/N`` bytes (4 for the
parameter, which is also the optimizer's master copy, 4 for its gradient, 8 for the two
moments) against ``16·Ψ`` in one process. :func:`memory_stats` counts what a sharded
model and its optimizer really hold; :func:`estimate_model_states` answers the same
question before anything is built, from a model on the meta device or a parameter count.
Neither counts activations, communication buffers or allocator slack: the process's
peak resident set (also reported) holds those on top.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import resource
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from zero3.core.config._config import Zero3Config, is_persistent
from zero3.core.config._window import GatherWindow, resolve_window

__all__ = [
    "MemoryStats",
    "ModelStatesEstimate",
    "estimate_model_states",
    "peak_rss_bytes",
    "storage_bytes",
    "storages",
    "trim_heap",
]

#: fp32 state values per parameter element of common optimizers.
OPTIMIZER_STATES: dict[str, float] = {
    "adamw": 2,
    "adam": 2,
    "lion": 1,
    "adagrad": 1,
    "sgd-momentum": 1,
    "sgd": 0,
    "none": 0,
}


def peak_rss_bytes() -> int:
    """This process's peak resident set size: the kernel's high-water mark.

    Read as ``VmHWM`` where /proc has it: ``ru_maxrss`` is the same counter but also
    keeps the peak of the image before ``exec``, so a rank spawned by a large Python
    parent would report the parent's RSS as its own peak.
    """
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): freed memory is the allocator's business
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim(0)``).

    glibc keeps freed blocks below its mmap threshold resident, and the threshold rises
    to the size of each large block freed, so after a step the activations' memory is
    still in the resident set (docs/facts.rst, "glibc's mmap threshold rises with what is
    freed"). Nothing is done where the C library has no ``malloc_trim``.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def storage_bytes(tensors: Iterable[torch.Tensor], skip: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and (skip is None or storage.data_ptr() not in skip):
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Model-state bytes held by this rank, against one unsharded process.

    Attributes:
        world_size: Ranks the model is sharded over.
        numel: Parameter elements of the whole model (Ψ).
        param_bytes: Parameter shards plus whole persistent parameters.
        grad_bytes: Gradient shards (zero until the first backward; a world of one
            keeps its gradients only until the optimizer step).
        master_bytes: fp32 master shards that are not the parameter shards themselves
            (none for fp32 parameters).
        optimizer_bytes: Optimizer state tensors (zero until the first step).
        unsharded_bytes: What one process would hold for the same state: every
            parameter, gradient, master and optimizer value (the optimizer's bytes per
            element as measured here).
        gathered_bytes: Full parameters gathered right now (non-persistent ones).
        peak_gathered_bytes: Most full-parameter bytes gathered at once since sharding.
        pool_bytes: Communication and parameter buffers cached for reuse.
        peak_rss_bytes: The process's peak resident set (everything: model state,
            activations, buffers, the interpreter and libraries).
        window: The model's resolved gather window (its chosen sizes and bounds).
        peak_pool_bytes: Most bytes the buffer pool cached at once since sharding.
        peak_gather_buffer_bytes: Most bytes of gather receive buffers in use at once.
        peak_bucket_bytes: Most bytes of gradient bucket buffers in use at once.
        peak_full_grad_bytes: The largest full gradient autograd handed to zero3 before
            its reduction (each is copied into its bucket and dropped on arrival).
        peak_engine_bytes: Most bytes zero3's transient memory held at once: gathered
            parameters, gather and bucket buffers in use and the pool's cache together
            (counted by zero3, independent of the allocator). With :attr:`held_bytes`
            this is what zero3 holds at its peak; the rest of the resident set is
            activations, autograd's gradients, the interpreter and allocator slack.
        nvme_master_bytes: fp32 master bytes optimizer offload keeps in swap files now
            (``offload_optimizer: nvme``; in memory they are empty, so not in
            :attr:`master_bytes`).
        nvme_optimizer_bytes: Optimizer state bytes in swap files now (likewise).
        nvme_param_bytes: Parameter shard bytes parameter offload keeps in its swap file
            now (``offload_param: nvme``; not in :attr:`param_bytes`).
        peak_grad_shard_bytes: Most bytes this rank's gradient shards held at once
            (:attr:`grad_bytes` is what they hold now: none between windows, the buffer
            is freed at the optimizer step).
        host_param_bytes: Parameter shard bytes in host memory while the model is on
            an accelerator (``offload_param: cpu``); not in :attr:`param_bytes`.
        host_master_bytes: fp32 master bytes in host memory while the shards are on an
            accelerator (``offload_optimizer: cpu``, or an nvme record read back);
            not in :attr:`master_bytes`. Zero on a CPU run, where host memory is where
            everything is.
        host_optimizer_bytes: Optimizer state bytes in host memory likewise.

    Where it lives: :attr:`held_bytes` is in the memory of the device the shards are on
    (host memory on a CPU run), :attr:`nvme_bytes` in this rank's swap files.
    """

    world_size: int
    numel: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int
    gathered_bytes: int
    peak_gathered_bytes: int
    pool_bytes: int
    peak_rss_bytes: int
    window: GatherWindow | None = None
    peak_pool_bytes: int = 0
    peak_gather_buffer_bytes: int = 0
    peak_bucket_bytes: int = 0
    peak_full_grad_bytes: int = 0
    peak_engine_bytes: int = 0
    nvme_master_bytes: int = 0
    nvme_optimizer_bytes: int = 0
    nvme_param_bytes: int = 0
    peak_grad_shard_bytes: int = 0
    host_param_bytes: int = 0
    host_master_bytes: int = 0
    host_optimizer_bytes: int = 0

    @property
    def nvme_bytes(self) -> int:
        """Model state in this rank's swap files (parameter shards, masters, optimizer
        state).
        """
        return self.nvme_param_bytes + self.nvme_master_bytes + self.nvme_optimizer_bytes

    def breakdown(self) -> dict[str, int]:
        """Where this rank's memory goes, in bytes: the model state, then each part of
        zero3's transient memory at its own peak (they need not peak together; their
        sum at once is :attr:`peak_engine_bytes`).
        """
        return {
            "model state (held)": self.held_bytes,
            "gathered parameters (peak)": self.peak_gathered_bytes,
            "gather buffers (peak)": self.peak_gather_buffer_bytes,
            "gradient buckets (peak)": self.peak_bucket_bytes,
            "full gradient before reduction (largest)": self.peak_full_grad_bytes,
            "buffer pool cache (peak)": self.peak_pool_bytes,
            "zero3 transient at once (peak)": self.peak_engine_bytes,
            "model state in swap files (NVMe offload)": self.nvme_bytes,
            "model state in host memory (offload on an accelerator)": (
                self.host_param_bytes + self.host_master_bytes + self.host_optimizer_bytes
            ),
        }

    @property
    def held_bytes(self) -> int:
        """The model state this rank holds (parameters, gradients, masters, optimizer state)."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def peak_held_bytes(self) -> int:
        """:attr:`held_bytes` with the gradient shards at their peak (what a step holds
        during backward; compare with ``estimate_model_states``'s ``per_rank_bytes``).
        """
        grads = max(self.grad_bytes, self.peak_grad_shard_bytes)
        return self.param_bytes + grads + self.master_bytes + self.optimizer_bytes

    @property
    def held_fraction(self) -> float:
        """``held_bytes / unsharded_bytes`` (ideally ``1/N``)."""
        return self.held_bytes / max(1, self.unsharded_bytes)


@dataclasses.dataclass(frozen=True)
class ModelStatesEstimate:
    """Model-state bytes each rank will hold (:func:`estimate_model_states`).

    Attributes:
        world_size: Ranks (N).
        numel: Parameter elements (Ψ).
        param_bytes: Parameter shards plus whole persistent parameters, per rank.
        grad_bytes: Gradient shards, per rank.
        master_bytes: fp32 master shards (parameters not in fp32), per rank.
        optimizer_bytes: Optimizer state, per rank.
        unsharded_bytes: The same state in one unsharded process.
        largest_module_bytes: The largest module's own parameters, whole: what one
            module's gather adds while it runs (``max_reuse_distance=0``).
        window: The gather window the model would get (None for a parameter count at
            world 1, or where nothing is gathered).
        window_bytes: The most parameter bytes gathered at once
            (:attr:`~zero3.core.engine.GatherWindow.bound_bytes`).
        pool_bytes: The buffer pool's bound (:attr:`~zero3.core.engine.GatherWindow.pool_bytes`).
        buffer_bytes: Gather and bucket buffers in use on top of the gathered
            parameters: one gather being copied out and five buckets (four reductions
            in flight and the one filling), each a chunk or the largest parameter.
        nvme_bytes: Masters and optimizer state in swap files between steps, per rank
            (``offload_optimizer: nvme``: its ``ratio`` of them), and the parameter
            shards ``offload_param: nvme`` moves there (beyond ``max_in_cpu``); not in
            :attr:`param_bytes`, :attr:`master_bytes`, :attr:`optimizer_bytes` or
            :attr:`per_rank_bytes`. An offloaded shard's master is a separate fp32 copy
            (in :attr:`master_bytes` unless the optimizer is offloaded too).
        host_bytes: Masters and optimizer state offloaded to host memory
            (``offload_optimizer: cpu``), per rank, and with the model on an
            accelerator the parameter shards ``offload_param: cpu`` moves there; on a
            CPU run host memory is also where the rest is, and these stay in
            :attr:`per_rank_bytes`.
    """

    world_size: int
    numel: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int
    largest_module_bytes: int
    window: GatherWindow | None = None
    window_bytes: int = 0
    pool_bytes: int = 0
    buffer_bytes: int = 0
    nvme_bytes: int = 0
    host_bytes: int = 0

    @property
    def per_rank_bytes(self) -> int:
        """The model state per rank (parameters, gradients, masters, optimizer state)."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def transient_bytes(self) -> int:
        """The most zero3's transient memory holds at once (a bound for
        :attr:`MemoryStats.peak_engine_bytes`): the gathered window, the buffers in use
        and the pool's cache.
        """
        return self.window_bytes + self.buffer_bytes + self.pool_bytes

    @property
    def peak_bytes(self) -> int:
        """Model state plus transient memory per rank (activations not included)."""
        return self.per_rank_bytes + self.transient_bytes


def _param_list(
    model: nn.Module | int,
) -> tuple[list[tuple[int, torch.dtype, bool]], int]:
    """(numel, dtype, trainable) per distinct parameter, and the largest module's bytes."""
    if isinstance(model, int):
        if model < 0:
            raise ValueError(f"estimate_model_states: a parameter count must be >= 0, got {model}")
        return [(model, torch.float32, True)], model * 4
    _check_module(model)
    params = [(p.numel(), p.dtype, p.requires_grad) for p in model.parameters()]
    largest = max(
        (
            sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            for m in model.modules()
        ),
        default=0,
    )
    return params, largest


def _check_module(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            "estimate_model_states expects an nn.Module (on the meta device is fine) or a "
            f"parameter count, got {type(model).__name__}"
        )


def _window_estimate(
    model: nn.Module | int, world_size: int, config: Zero3Config, el: int, offloaded: bool
) -> tuple[GatherWindow | None, int]:
    """The gather window a model would get (each module's own parameters a fetch unit,
    as without leaf modules), and the buffers in use beside it.
    """

    def is_sharded(numel: int) -> bool:
        return not is_persistent(numel, world_size, config, offloaded=offloaded)

    if isinstance(model, int):
        units = sizes = [model] if is_sharded(model) else []
    else:
        units = [
            sum(p.numel() for p in m.parameters(recurse=False) if is_sharded(p.numel()))
            for m in model.modules()
        ]
        sizes = [p.numel() for p in model.parameters() if is_sharded(p.numel())]
    sharded = sum(sizes)
    if not sharded:
        return None, 0
    shard_bytes = 2 * sum(-(-n // world_size) for n in sizes) * el
    window = resolve_window(
        config, units, sharded_numel=sharded, element_size=el, world_size=world_size,
        shard_bytes=shard_bytes,
    )  # fmt: skip
    if world_size == 1:  # parameters filled from their shards, gradients kept whole
        return window, 0
    # One gather being copied out (receive buffer beside the storages it fills), and
    # the buckets in use: four reductions in flight and the one filling, each a chunk
    # or, for a parameter larger than a chunk, that parameter's own bucket.
    unit_bytes = window.unit_numel * el
    bucket = max(window.chunk_numel, max(sizes)) * el
    buffers = unit_bytes + unit_bytes // world_size + 5 * bucket
    return window, buffers


def _optimizer_states(optimizer: str | float) -> float:
    """fp32 state values per element: ``optimizer`` by name or as a number."""
    if not isinstance(optimizer, str):
        return float(optimizer)
    if optimizer.lower() not in OPTIMIZER_STATES:
        raise ValueError(
            f"estimate_model_states: unknown optimizer {optimizer!r}; give one of "
            f"{sorted(OPTIMIZER_STATES)} or the fp32 values it keeps per element"
        )
    return OPTIMIZER_STATES[optimizer.lower()]


class _Tally:
    """Bytes per rank, added up parameter by parameter (estimate_model_states)."""

    def __init__(self, world_size: int, config: Zero3Config, device_type: str) -> None:
        self.world_size = world_size
        self.config = config
        self.held = {"param": 0, "grad": 0, "master": 0, "optimizer": 0}
        self.one_process_bytes = 0  # the same model in one process
        self.kept = 0  # shard elements offload_param's max_in_cpu keeps in memory
        self.param_nvme = 0  # shard bytes swapped out to NVMe
        self.host_param = 0  # shard bytes in host memory (parameter offload to the CPU)
        self.host_fp32_master = 0  # host masters of offloaded fp32 shards
        self.accelerator = device_type != "cpu"
        self.swapping = config.offload_param.device == "nvme"
        self.to_host = self.accelerator and config.offload_param.device == "cpu"
        self.offloaded = config.offload_param.moves_shards(device_type)

    def add(
        self,
        numel: int,
        dtype: torch.dtype,
        reduce_dtype: torch.dtype | None,
        trainable: bool,
        states: float,
    ) -> None:
        """Count one parameter of ``numel`` elements sharded in ``dtype``."""
        world_size, held = self.world_size, self.held
        el = torch.empty((), dtype=dtype).element_size()
        grad_el = torch.empty((), dtype=reduce_dtype or dtype).element_size()
        shard = -(-numel // world_size)
        whole = is_persistent(numel, world_size, self.config, offloaded=self.offloaded)
        if world_size == 1 and whole:  # the "shard" is the parameter itself
            held["param"] += numel * el
        else:  # a persistent parameter keeps its shard and its whole self
            held["param"] += shard * el + (numel * el if whole else 0)
        self.one_process_bytes += numel * el
        max_in_cpu = self.config.offload_param.max_in_cpu
        swapped = self.swapping and not whole and self.kept + shard > max_in_cpu
        if swapped:
            held["param"] -= shard * el
            self.param_nvme += shard * el
        elif self.swapping and not whole:
            self.kept += shard
        if self.to_host and not whole:
            held["param"] -= shard * el
            self.host_param += shard * el
        if not trainable:
            return
        held["grad"] += shard * grad_el if world_size > 1 else numel * grad_el
        aliased = dtype == torch.float32 and not swapped and not (self.to_host and not whole)
        held["master"] += 0 if aliased else shard * 4
        offload = self.config.offload_optimizer
        if aliased and self.accelerator and offload.enabled:
            self.host_fp32_master += int(shard * 4 * offload.ratio)
        held["optimizer"] += int(min(shard, numel) * states * 4)
        self.one_process_bytes += numel * grad_el + (0 if dtype == torch.float32 else numel * 4)
        self.one_process_bytes += int(numel * states * 4)

    def apply_optimizer_offload(self) -> dict[str, int]:
        """Take what optimizer offload moves out of ``held`` where it leaves the device's
        memory, and return the master and optimizer-state bytes it moves, host masters
        included. Called once, after every parameter was added.
        """
        offload = self.config.offload_optimizer
        moved = {"master": 0, "optimizer": 0}
        if offload.device in ("cpu", "nvme"):
            moved = {k: int(self.held[k] * offload.ratio) for k in moved}
        if offload.device == "nvme" or self.accelerator:  # out of (device) memory
            self.held["master"] -= moved["master"]
            self.held["optimizer"] -= moved["optimizer"]
        moved["master"] += self.host_fp32_master
        return moved


def estimate_model_states(
    model: nn.Module | int,
    world_size: int,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str | float = "adamw",
    config: Zero3Config | None = None,
    device: str | torch.device = "cpu",
) -> ModelStatesEstimate:
    """Model-state bytes per rank of a model sharded over ``world_size`` ranks, before
    anything is built (DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live``).

    Counts what zero3 allocates: per parameter a shard of ``ceil(numel/N)`` elements
    (whole parameters too for persistent ones), a gradient shard in the reduce dtype, an
    fp32 master shard when the parameter is not fp32, and the optimizer's fp32 state
    values for each element this rank steps.

    Args:
        model: A model (build it under ``zero3.hooks.empty_init()`` or
            ``torch.device("meta")``: nothing is allocated), or a parameter count
            (one fp32 tensor, trainable).
        world_size: Ranks (N).
        param_dtype: The dtype parameters are sharded in (default: each one's own,
            or ``config.param_dtype``).
        reduce_dtype: The gradient dtype (default: ``config.reduce_dtype``, else the
            parameter dtype).
        optimizer: A name in ``adamw, adam, lion, adagrad, sgd-momentum, sgd, none`` or
            the number of fp32 state values it keeps per element.
        config: Engine settings (persistence threshold, dtypes); default
            ``Zero3Config()``.
        device: Where the model lives (``"cpu"``, or an accelerator such as
            ``"cuda"``). On an accelerator what offload keeps in host memory
            (:attr:`~ModelStatesEstimate.host_bytes`) is not in ``per_rank_bytes``, and
            an offloaded fp32 parameter gets a host master of its own.

    Raises:
        ValueError: Unknown optimizer name, or ``world_size < 1``.
    """
    config = config or Zero3Config()
    if world_size < 1:
        raise ValueError(f"estimate_model_states: world_size must be >= 1, got {world_size}")
    states = _optimizer_states(optimizer)
    params, largest = _param_list(model)
    param_dtype = param_dtype or config.param_dtype
    reduce_dtype = reduce_dtype or config.reduce_dtype
    tally = _Tally(world_size, config, torch.device(device).type)
    for numel, own_dtype, trainable in params:
        tally.add(numel, param_dtype or own_dtype, reduce_dtype, trainable, states)
    el = max(
        (torch.empty((), dtype=param_dtype or d).element_size() for _, d, _ in params), default=4
    )
    window, buffers = _window_estimate(model, world_size, config, el, tally.offloaded)
    moved = tally.apply_optimizer_offload()
    held = tally.held
    offload = config.offload_optimizer.device
    return ModelStatesEstimate(
        nvme_bytes=(sum(moved.values()) if offload == "nvme" else 0) + tally.param_nvme,
        host_bytes=(sum(moved.values()) if offload == "cpu" else 0) + tally.host_param,
        world_size=world_size,
        numel=sum(n for n, _, _ in params),
        param_bytes=held["param"],
        grad_bytes=held["grad"],
        master_bytes=held["master"],
        optimizer_bytes=held["optimizer"],
        unsharded_bytes=tally.one_process_bytes,
        largest_module_bytes=largest,
        window=window,
        window_bytes=window.bound_bytes if window else 0,
        pool_bytes=window.pool_bytes if window else 0,
        buffer_bytes=buffers,
    )
