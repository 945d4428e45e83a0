"""The end-of-run summary, the trace file and the plot."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zero3.comm import CommBackend
from zero3.core import StepStats, Zero3Config, memory_stats, peak_rss_bytes
from zero3.core.engine import ParamSwap, sharded_state
from zero3.optim import OffloadStats, PartitionedOptimizer

METRICS = [
    "peak_rss",
    "baseline_rss",
    "held",
    "unsharded",
    "gather_payload",
    "gather_padding",
    "gather_fingerprint",
    "reduce_payload",
    "reduce_padding",
    "reduce_fingerprint",
    "flags",
    "refresh",
    "gathers",
    "reductions",
    "small",
    "hit_rate",
    "invalidations",
    "step_time",
    "peak_gathered",
    "peak_gather_buffers",
    "peak_buckets",
    "peak_full_grad",
    "peak_pool",
    "peak_engine",
    "io_wait",
    "swap_walk",
    "swap_read",
    "swap_written",
    "swap_read_ahead",
    "param_read",
    "param_read_ahead",
    "param_written",
    "param_io_wait",
    "param_nvme",
    "copy_wait",
    "to_host",
    "to_device",
    "swap_in_flight",
    "swap_budget",
]


def rss_baseline() -> int:
    """Reset the peak RSS to the current RSS and return it: a baseline from which the
    peak's growth is what comes after (imports may have peaked higher than where the
    process is now). Linux >= 4.0 (``/proc/self/clear_refs``); elsewhere the peak so far.
    """
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_rss_bytes()


def rank_metrics(
    model: nn.Module,
    opt: PartitionedOptimizer,
    stats: StepStats,
    step_times: list[float],
    baseline_rss: int,
    swaps: list[OffloadStats] = (),  # type: ignore[assignment]
) -> torch.Tensor:
    """This rank's summary numbers (in ``METRICS`` order); ``swaps``: the optimizer
    offload's record of each step (medians are reported).
    """
    memory = memory_stats(model, opt)
    state = sharded_state(model)
    values = [
        memory.peak_rss_bytes, baseline_rss, memory.peak_held_bytes, memory.unsharded_bytes,
        stats.gather_payload_bytes, stats.gather_padding_bytes, stats.gather_fingerprint_bytes,
        stats.reduce_payload_bytes, stats.reduce_padding_bytes, stats.reduce_fingerprint_bytes,
        stats.grad_flag_bytes, stats.refresh_bytes,
        stats.gathers, stats.reduce_collectives,
        1 + stats.refresh_gathers + stats.other_collectives,  # +1: the flags all-reduce
        stats.prefetch_hit_rate, state.stats.total_invalidations,
        statistics.median(step_times) if step_times else 0.0,
        memory.peak_gathered_bytes, memory.peak_gather_buffer_bytes, memory.peak_bucket_bytes,
        memory.peak_full_grad_bytes, memory.peak_pool_bytes, memory.peak_engine_bytes,
        *(statistics.median(getattr(w, f) for w in swaps) if swaps else 0.0
          for f in ("io_wait_s", "step_s", "read_bytes", "written_bytes", "read_ahead_bytes")),
        *_param_swap_row(state.param_swap, max(1, len(step_times))),
        memory.nvme_param_bytes,
        *(statistics.median(getattr(w, f) for w in swaps) if swaps else 0.0
          for f in ("copy_wait_s", "to_host_bytes", "to_device_bytes")),
        max((w.peak_in_flight_bytes for w in swaps), default=0),
        opt.offload.budget_bytes() if opt.offload is not None and swaps else 0,
    ]  # fmt: skip
    return torch.tensor(values, dtype=torch.float64)


def _param_swap_row(swap: ParamSwap | None, steps: int) -> list[float]:
    """Parameter offload's reads, reads ahead, writes and I/O wait, per step (means over
    the run: its counters are cumulative).
    """
    if swap is None:
        return [0.0] * 4
    s = swap.stats
    return [s.read_bytes / steps, s.read_ahead_bytes / steps, s.written_bytes / steps,
            s.io_wait_s / steps]  # fmt: skip


def gather_rows(comm: CommBackend, row: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's metric row, on every rank."""
    out = torch.empty(comm.world_size * row.numel(), dtype=row.dtype)
    comm.all_gather(out, row).wait()
    return list(out.view(comm.world_size, -1))


def gather_bytes(comm: CommBackend, payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` (variable length), on every rank."""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(sizes, size).wait()
    longest = int(sizes.max())
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out = torch.empty(longest * comm.world_size, dtype=torch.uint8)
    comm.all_gather(out, mine).wait()
    rows = out.view(comm.world_size, longest)
    return [bytes(rows[r, : int(sizes[r])].tolist()) for r in range(comm.world_size)]


def _mb(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def aligned(header: list[str], rows: list[list[str]]) -> list[str]:
    """A text table whose columns line up (first column left, the others right)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return " | ".join([first, *rest])

    return [line(header), "-+-".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_summary(
    rows: list[torch.Tensor],
    model: nn.Module,
    config: Zero3Config,
    tokens_per_step: int,
    estimate: int,
) -> str:
    """The per-rank summary table plus the bytes-vs-theory lines.

    ``estimate``: the model-state bytes per rank ``estimate_model_states`` predicted
    before the model was built.
    """
    state = sharded_state(model)
    n = len(rows)
    wire = (n - 1) / n
    sharded = [sp for sp in state.params if not sp.persistent]
    psi = sum(sp.numel for sp in state.params)
    psi_s = sum(sp.numel for sp in sharded)
    el = state.params[0].param.element_size()
    trainable = sum(sp.numel for sp in state.params if sp.requires_grad)
    red_el = torch.empty((), dtype=config.reduce_dtype or state.params[0].dtype).element_size()
    header = [
        "rank", "peak RSS", "growth", "model state held", "estimate", "unsharded",
        "gathers", "reductions", "small", "prefetch hits", "step time", "tokens/s",
    ]  # fmt: skip
    table = []
    for r, row in enumerate(rows):
        m = dict(zip(METRICS, row.tolist(), strict=True))
        table.append(
            [
                str(r),
                _mb(m["peak_rss"]),
                _mb(m["peak_rss"] - m["baseline_rss"]),
                f"{_mb(m['held'])} ({m['held'] / max(1, m['unsharded']):.2f}x)",
                _mb(estimate),
                _mb(m["unsharded"]),
                str(int(m["gathers"])),
                str(int(m["reductions"])),
                str(int(m["small"])),
                f"{100 * m['hit_rate']:.1f}%" if m["gathers"] else "-",  # none to prefetch
                f"{m['step_time']:.3f} s",
                f"{tokens_per_step / max(1e-9, m['step_time']):,.0f}",
            ]
        )
    m = dict(zip(METRICS, rows[0].tolist(), strict=True))
    per_rank = [dict(zip(METRICS, row.tolist(), strict=True)) for row in rows]
    excess = max(r["peak_rss"] - r["baseline_rss"] - r["held"] for r in per_rank)
    lines = [
        "",
        f"zero3 summary: world {n}, {psi / 1e6:.2f}M parameters, "
        + sharded_share(psi_s, psi, len(sharded), len(state.params), config),
        "per rank: peak RSS, its growth over the RSS before the model was built, model state "
        "(parameters, gradients, masters, optimizer state) held against the estimate and "
        "one unsharded process; collectives per step",
        *aligned(header, table),
        f"theory: model state per rank = unsharded / N = {_mb(m['unsharded'] / n)} "
        f"(estimate_model_states: {_mb(estimate)}); RSS growth beyond the model state: up to "
        f"{_mb(excess)} per rank (activations, gathered parameters, "
        "communication buffers, allocator)",
    ]
    lines += _memory_lines(per_rank, state.window.describe())
    whole = state.window.reuse_numel >= psi_s
    why_gather = (
        "max_reuse_distance keeps the model whole into backward"
        if whole
        else "released after forward, gathered again in backward"
    )
    k_gather = m["gather_payload"] / max(1, psi_s * el)
    k_reduce = m["reduce_payload"] / max(1, trainable * red_el)
    gathered = (
        f"  gathered {_mb(m['gather_payload'] * wire)} = {k_gather:.2f} x Psi_s(N-1)/N; theory "
        f"{1 if whole else 2} x ({why_gather})"
        if psi_s
        else "  gathered nothing: no parameter is sharded (Psi_s = 0), each rank holds them whole"
    )
    lines += [
        "payload per step (rank 0; each rank moves (N-1)/N of a ring collective's buffer):",
        gathered,
        f"  reduced  {_mb(m['reduce_payload'] * wire)} = {k_reduce:.2f} x Psi(N-1)/N; theory "
        f"{2 if config.grad_reduce_op == 'all_reduce' else 1} x ({config.grad_reduce_op})",
        f"  apart: padding {_mb((m['gather_padding'] + m['reduce_padding']) * wire)}, "
        f"fingerprints {_mb((m['gather_fingerprint'] + m['reduce_fingerprint']) * wire)}, "
        f"got-grad flags {m['flags'] * wire:.0f} B, persistent refresh {_mb(m['refresh'] * wire)}",
        f"  trace invalidations (whole run): {int(m['invalidations'])}",
    ]
    if config.offload_optimizer.enabled:
        lines.append(_offload_line(config, per_rank))
    if config.offload_param.enabled:
        lines.append(_param_offload_line(config, per_rank))
    if config.trims_host_heap:
        lines.append("host heap: its free pages handed back to the kernel half way through "
                     "each backward and as each optimizer step begins and ends "
                     "(Zero3Config.trim_host_heap)")  # fmt: skip
    return "\n".join(lines)


def sharded_share(psi_s: int, psi: int, sharded: int, tensors: int, config: Zero3Config) -> str:
    """How much of the model is sharded, and why the rest is not."""
    threshold = config.param_persistence_threshold
    if sharded == tensors:
        return f"100.0% of elements sharded (all {tensors} tensors)"
    why = (
        f"persistent: tensors of <= {threshold:,} elements (param_persistence_threshold) stay "
        "whole on every rank, as in DeepSpeed, so small ones are not gathered every step"
    )
    if sharded == 0:
        return (
            f"nothing sharded: all {tensors} tensors are {why}; a bigger --d-model, or "
            "--param-persistence-threshold 0, shards them"
        )
    share = f"{100 * psi_s / psi:.1f}% of elements sharded"
    return f"{share} ({sharded} of {tensors} tensors; the rest are {why})"


def _memory_lines(per_rank: list[dict[str, float]], window: str) -> list[str]:
    """The gather window and where each rank's peak goes (MemoryStats.breakdown)."""
    header = [
        "memory",
        "model state",
        "gathered",
        "gather buffers",
        "buckets",
        "full grad",
        "pool",
        "zero3 transient at once",
        "rest (activations, allocator)",
    ]
    rows = []
    for r, m in enumerate(per_rank):
        rest = m["peak_rss"] - m["baseline_rss"] - m["held"] - m["peak_engine"]
        keys = (
            "held",
            "peak_gathered",
            "peak_gather_buffers",
            "peak_buckets",
            "peak_full_grad",
            "peak_pool",
            "peak_engine",
        )
        rows.append([f"rank {r}", *(_mb(m[k]) for k in keys), _mb(rest)])
    return [
        f"gather window: {window}",
        "memory per rank at its peak (each part's own peak; 'at once' is their most together, "
        "counted by zero3; the rest of the RSS growth is activations, autograd and allocator):",
        *aligned(header, rows),
    ]


def _offload_line(config: Zero3Config, per_rank: list[dict[str, float]]) -> str:
    """Where the offloaded optimizer's time went (median step, slowest rank)."""
    section = config.offload_optimizer
    worst = max(per_rank, key=lambda r: r["io_wait"] + r["copy_wait"])
    # The model on an accelerator: the gradients came down and the shards went up.
    copies = (
        f"; gradients to the host {_mb(worst['to_host'])}, stepped shards to the device "
        f"{_mb(worst['to_device'])}, the host waited {worst['copy_wait']:.3f} s for copies"
        if worst["to_host"] or worst["to_device"]
        else ""
    )
    if section.device != "nvme":
        if copies:
            return (
                f"optimizer offload: cpu (stepped on the host): per step, host-side step "
                f"{worst['swap_walk']:.3f} s in a step of {worst['step_time']:.3f} s{copies}"
            )
        return f"optimizer offload: {section.device} (state in host memory; no swap I/O)"
    return (
        f"optimizer offload (nvme, {section.nvme_path}, sub_group_size "
        f"{config.sub_group_size:,}): per step, I/O wait {worst['io_wait']:.3f} s of the "
        f"sub-group walk {worst['swap_walk']:.3f} s (the rest is stepping overlapped with "
        f"I/O) in a step of {worst['step_time']:.3f} s; read {_mb(worst['swap_read'])} "
        f"({_mb(worst['swap_read_ahead'])} of it started during the backward), "
        f"written {_mb(worst['swap_written'])}; record buffers at most "
        f"{_mb(worst['swap_in_flight'])} at once (budget {_mb(worst['swap_budget'])})"
        f"{copies}"
    )


def _param_offload_line(config: Zero3Config, per_rank: list[dict[str, float]]) -> str:
    """Where parameter offload's time went (mean step of the run, slowest rank)."""
    section = config.offload_param
    worst = max(per_rank, key=lambda r: r["param_io_wait"])
    if section.device != "nvme" or (not worst["param_nvme"] and not worst["param_read"]):
        return f"parameter offload: {section.device} (shards in host memory; no swap I/O)"
    return (
        f"parameter offload (nvme, {section.nvme_path}): {_mb(worst['param_nvme'])} of "
        f"shards in the swap file per rank; per step, I/O wait {worst['param_io_wait']:.3f} s "
        f"in a step of {worst['step_time']:.3f} s; read {_mb(worst['param_read'])} "
        f"({_mb(worst['param_read_ahead'])} of it read ahead of its gather), written "
        f"{_mb(worst['param_written'])}"
    )


def write_trace(path: Path, per_rank_events: list[bytes]) -> None:
    """Merge every rank's events into one Chrome/Perfetto trace file."""
    events: list[dict[str, Any]] = []
    for blob in per_rank_events:
        events.extend(json.loads(blob.decode()))
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def write_plot(path: Path, losses: list[float], step_times: list[float]) -> None:
    """Loss and step time per step, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in the dev group
        raise SystemExit(f"error: --plot needs matplotlib (pip install matplotlib): {exc}") from exc
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    steps = list(range(1, len(losses) + 1))
    ax1.plot(steps, losses, color="tab:blue")
    ax1.set_ylabel("loss (mean over ranks)")
    ax1.grid(alpha=0.3)
    ax2.plot(steps, step_times, color="tab:orange")
    ax2.set_ylabel("step time (s, slowest rank)")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.suptitle("zero3 training")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
