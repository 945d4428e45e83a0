"""The memory part of tools/bench.py's report: peak RSS per rank against the theory.

Every worker records its peak RSS (``ru_maxrss``) right after joining the process group,
before its model exists (the baseline: interpreter, torch, gloo), and again at the end;
the growth between the two is what the system itself costs. For fp32 AdamW the model
state of one unsharded process is ``16·Ψ`` bytes (parameters, gradients, two moments);
ZeRO-3 keeps ``16·Ψ/N`` of it per rank, so against DDP (which holds all of it, plus
its gradient buckets) the theory saves ``16·Ψ·(N-1)/N`` per rank. With LoRA on a
frozen base only the ``T`` adapter elements have gradients and moments: ``4·Ψ + 12·T``.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from _bench.workload import Workload, build

MiB = 2**20


def model_numel(w: Workload) -> int:
    """Ψ of the benchmark model (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(w).parameters())


def _growth(run: dict[str, Any]) -> float:
    """The largest rank's peak RSS growth over its baseline in one run."""
    return max(p - b for p, b in zip(run["rss"], run["baseline"], strict=True))


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(max(r[key]) if isinstance(r[key], list) else r[key] for r in runs)


def report(
    results: dict[str, list[dict[str, Any]]], world: int, psi: int, trainable: int | None = None
) -> str:
    """A markdown table of peak RSS per system and the saving against the theory
    (``trainable``: the adapter elements of a LoRA run, whose base is frozen)."""
    state, formula = 16 * psi, "16·Ψ"
    if trainable is not None:
        state, formula = 4 * psi + 12 * trainable, "(4·Ψ + 12·T)"
    theory = state * (world - 1) / world
    lora = " (LoRA: T trainable, the base frozen)" if trainable is not None else ""
    lines = [
        "",
        f"#### memory per rank (world {world}; fp32 AdamW model state{lora}: {formula} = "
        f"{state / MiB:.0f} MiB unsharded, /N = {state / world / MiB:.0f} MiB sharded)",
        "",
        "| system | baseline RSS (MiB) | peak RSS (MiB) | growth over baseline (MiB) "
        "| below DDP (MiB) | model state held / unsharded (MiB) | peak gathered params (MiB) "
        "| buffer pool peak (MiB) | zero3 transient at once (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    growth = {
        name: statistics.median(_growth(r) for r in runs)
        for name, runs in results.items()
        if runs and "skipped" not in runs[0]
    }
    ddp = growth.get("ddp")
    for name, runs in results.items():
        if name not in growth:
            continue
        below = f"{(ddp - growth[name]) / MiB:.0f}" if ddp is not None and name != "ddp" else "-"
        held = gathered = pool = engine = "-"
        if "held" in runs[-1]:
            held = f"{_median(runs, 'held') / MiB:.0f} / {_median(runs, 'unsharded') / MiB:.0f}"
            gathered = f"{_median(runs, 'peak_gathered') / MiB:.0f}"
            pool = f"{_median(runs, 'pool') / MiB:.0f}"
            engine = f"{_median(runs, 'engine') / MiB:.0f}" if "engine" in runs[-1] else "-"
        lines.append(
            f"| {name} | {_median(runs, 'baseline') / MiB:.0f} | {_median(runs, 'rss') / MiB:.0f} "
            f"| {growth[name] / MiB:.0f} | {below} | {held} | {gathered} | {pool} | {engine} |"
        )
    for name, runs in results.items():
        if name in growth and runs[-1].get("window"):
            lines.append(f"\n{name} gather window: {runs[-1]['window']}")
    if ddp is not None and world > 1:
        lines += [
            "",
            f"theory: ZeRO-3 saves {formula}·(N-1)/N = {theory / MiB:.0f} MiB per rank vs DDP",
        ]
        for name in growth:
            if name.startswith("zero3"):
                saved = ddp - growth[name]
                vs_fsdp2 = ""
                if "fsdp2" in growth:
                    gap = growth[name] - growth["fsdp2"]
                    vs_fsdp2 = f"; {gap / MiB:+.0f} MiB against FSDP2 (target: <= 0)"
                lines.append(
                    f"  {name}: {saved / MiB:.0f} MiB below DDP = {100 * saved / theory:.0f}% "
                    f"of the theory{vs_fsdp2}"
                )
    return "\n".join(lines)
