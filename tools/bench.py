"""Benchmark zero3 against one process, DDP, FSDP2 and DeepSpeed ZeRO-3 on one workload.

    ./dev run python tools/bench.py                      # world 2, 3 interleaved rounds
    ./dev run python tools/bench.py --world1             # zero3 vs plain PyTorch at world 1
    ./dev run python tools/bench.py --layers 16 --systems ddp,zero3,zero3-release
    ./dev run python tools/bench.py --world 4 --steps 2 --systems zero3,zero3-release  # bytes
    ./dev run python tools/bench.py --rounds 1 --systems ddp,zero3 --profile  # phases
    ./dev run python tools/bench.py --systems ddp,fsdp2,zero3,zero3-release  # + memory
    ./dev run python tools/bench.py --lora 8 --systems ddp,fsdp2,zero3,zero3-keep-frozen
    ./dev run python tools/bench.py --systems zero3,zero3-offload-cpu,zero3-offload-nvme

Every (system, round) runs in fresh processes (so peak RSS is that system's), with one
thread per rank. Per round, each system's median step time of the slowest rank; the
ratio against DDP is the median of the per-round ratios. Losses are compared with one
process training on the same global batch; peak RSS per rank is reported against
DDP and the ZeRO-3 theory (``_bench/memory.py``). The offload rows put their swap files
under ``ZERO3_BENCH_SWAP`` (default: the temp directory), whose bandwidth is measured
first. zero3 builds its model under ``empty_init`` (``zero3-eager-build`` builds it whole
first). DeepSpeed runs when importable (``DS_BUILD_OPS=0 pip install deepspeed``; it runs
on CPU with DS_ACCELERATOR=cpu).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any

from _bench import memory
from _bench.disk import bandwidth, swap_dir
from _bench.workload import Workload
from _train.launch import free_port, rank_env

WORLD2 = ["ddp", "fsdp2", "zero3", "zero3-release", "deepspeed"]
WORLD1 = ["plain", "zero3"]


def launch(
    system: str, world: int, args: argparse.Namespace, batch: int = 4, threads: int | None = None
) -> dict[str, Any]:
    """Run one system on ``world`` fresh processes; return rank 0's merged result."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, threads or args.threads)
        env["DS_ACCELERATOR"] = "cpu"
        cmd = [sys.executable, __file__, "--worker", system, "--layers", str(args.layers),
               "--steps", str(args.steps + args.warmup), "--batch", str(batch),
               "--lora", str(args.lora)]  # fmt: skip
        if args.profile and system.startswith("zero3"):
            cmd += ["--profile-after", str(args.warmup)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    failed = [
        f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
        for rank, (p, (_, err)) in enumerate(zip(procs, outs, strict=True))
        if p.returncode != 0
    ]
    if failed:
        raise RuntimeError(f"{system} failed; " + "\n".join(failed))
    line = next(x for x in outs[0][0].splitlines() if x.startswith("BENCH_RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("BENCH_RESULT "))
    result["timed"] = result["times"][args.warmup :]
    result["timed_usage"] = {key: v[args.warmup :] for key, v in result["usage"].items()}
    return result


def _row(
    name: str, runs: list[dict[str, Any]], ddp: list[dict[str, Any]] | None, ref: list[float]
) -> str:
    medians = [statistics.median(r["timed"]) for r in runs]
    ratio = "-"
    if ddp is not None:
        ratios = [m / statistics.median(d["timed"]) for m, d in zip(medians, ddp, strict=True)]
        ratio = f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"
    last = runs[-1]
    rss = " / ".join(f"{b / 2**30:.2f}" for b in last["rss"])
    payload = (
        f"{last['payload'] / 2**20:.1f} MiB ({last['payload_kind']})" if "payload" in last else "-"
    )
    diff = (
        max(abs(a - b) for a, b in zip(last["losses"], ref, strict=False)) if ref else float("nan")
    )
    rounds = ", ".join(f"{m:.2f}" for m in medians)
    sharded = 100 * last.get("sharded", 0)
    use = {
        key: statistics.median(v for r in runs for v in r["timed_usage"][key])
        for key in last["timed_usage"]
    }
    return (
        f"| {name} | {rounds} | {ratio} | {use['cpu']:.2f} ({use['kernel']:.2f}) "
        f"| {use['switches'] / 1000:.1f}k | {use['faults'] / 1000:.0f}k | {rss} | {payload} "
        f"| {sharded:.1f}% | {diff:.1e} |"
    )


def _phases(name: str, runs: list[dict[str, Any]]) -> str:
    """Rank 0's profiled phase times, median over rounds, against the profiled step."""
    step_ms = 1000 * statistics.median(t for r in runs for t in r["timed"])
    lines = [f"\n{name} under cProfile (rank 0, ms per step; step {step_ms:.0f} ms):", ""]
    lines += ["| phase | ms/step | share of step |", "|---|---|---|"]
    labels = sorted({k for r in runs for k in r["phases_ms"]})
    for label in labels:
        ms = statistics.median(r["phases_ms"].get(label, 0.0) for r in runs)
        lines.append(f"| {label} | {ms:.1f} | {100 * ms / step_ms:.1f}% |")
    python_ms = statistics.median(r["engine_python_ms"] for r in runs)
    lines.append(
        f"| engine Python (self time of every zero3 function) | {python_ms:.1f} "
        f"| {100 * python_ms / step_ms:.1f}% |"
    )
    top = runs[-1]["engine_python_top_ms"]
    lines.append(
        "\nlargest engine self times (last round, ms/step): "
        + ", ".join(f"{where} {ms:.1f}" for where, ms in top.items())
    )
    return "\n".join(lines)


def _offload_line(
    name: str, runs: list[dict[str, Any]], in_memory: list[dict[str, Any]] | None
) -> str:
    """Where an offloaded optimizer step's time went (rank 0, median of steps and rounds),
    and its step against in-memory zero3's (median of the per-round ratios)."""

    def median(key: str) -> float:
        return statistics.median(r["offload"][key] for r in runs)

    step, wait = median("step_s"), median("io_wait_s")
    where = {None: "host memory", True: "swap files, O_DIRECT", False: "swap files, buffered"}
    line = (
        f"{name}: optimizer walk {step:.2f} s per step, of it waiting on I/O {wait:.2f} s "
        f"({100 * wait / step if step else 0:.0f}%); read {median('read_bytes') / 2**20:.0f} MiB, "
        f"written {median('written_bytes') / 2**20:.0f} MiB per step per rank "
        f"({where[runs[-1]['offload_direct']]})"
    )
    swap = runs[-1].get("param_swap")
    if swap is not None:  # cumulative over the last round's run
        line += (
            f"; parameter shards: {swap['file_bytes'] / 2**20:.0f} MiB in the swap file, "
            f"read {swap['read_bytes'] / 2**20:.0f} MiB ({swap['read_ahead_bytes'] / 2**20:.0f} "
            f"ahead of its gather), waited {swap['io_wait_s']:.2f} s over the run"
        )
    if in_memory:
        ratios = [
            statistics.median(r["timed"]) / statistics.median(z["timed"])
            for r, z in zip(runs, in_memory, strict=True)
        ]
        line += f"; step {statistics.median(ratios):.3f}x the zero3 row's"
    return line


def report(
    results: dict[str, list[dict[str, Any]]], base: str, ref: list[float], title: str
) -> str:
    """A markdown table of the results."""
    lines = [
        f"### {title}",
        "",
        f"| system | median step time per round (s) | vs {base} (median of rounds; range) "
        "| CPU s/step per rank (of it kernel) | voluntary context switches/step per rank "
        "| page faults/step per rank | peak RSS per rank (GiB) "
        "| payload bytes/step per rank | elements sharded | max loss diff vs 1 process |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        if runs and "skipped" in runs[0]:
            lines.append(f"| {name} | SKIPPED: {runs[0]['skipped']} | | | | | | | |")
            continue
        lines.append(_row(name, runs, results.get(base) if name != base else None, ref))
    for name, runs in results.items():
        last = runs[-1] if runs else {}
        if "phases_ms" in last:
            lines.append(_phases(name, runs))
        if "gathers" in last:
            lines.append(
                f"\n{name}: {last['gathers']} gathers + {last['reductions']} reductions per step, "
                f"{last.get('headers')} header exchanges per step, prefetch hit rate "
                f"{100 * last['hit_rate']:.0f}%, padding/fingerprint/flag bytes "
                f"{last['overhead'] / 2**20:.2f} MiB"
            )
        if "offload" in last:
            lines.append(_offload_line(name, runs, results.get("zero3")))
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--systems", default=",".join(WORLD2), help="comma-separated systems")
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--world1", action="store_true", help="compare zero3 with plain PyTorch at world 1"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed first steps per run")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="train peft LoRA adapters of rank R on a frozen base (every system; needs peft)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile zero3's timed steps (cProfile, rank 0) and print where the time goes",
    )
    p.add_argument("--profile-after", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.worker:
        from _bench import systems

        workload = Workload(layers=args.layers, batch=args.batch, lora=args.lora)
        systems.main(args.worker, workload, args.steps, args.profile_after)
        return
    world = 1 if args.world1 else args.world
    names = WORLD1 if args.world1 else args.systems.split(",")
    base = "plain" if args.world1 else "ddp"
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}; world {world}, {args.layers} layers, "
        f"{args.rounds} rounds x ({args.warmup} warmup + {args.steps} timed) steps",
        flush=True,
    )
    # The reference: one process on the whole global batch (world x 4 sequences).
    ref = launch("reference", 1, args, batch=4 * world, threads=os.cpu_count() or 1)["losses"]
    if any("nvme" in n or "offload-both" in n for n in names):
        disk = bandwidth(swap_dir())
        print(
            f"swap directory {swap_dir()}: write {disk['write_mib_s']:.0f} MiB/s, read "
            f"{disk['read_mib_s']:.0f} MiB/s (256 MiB, 1 MiB requests, "
            f"{'O_DIRECT' if disk['direct'] else 'buffered: the page cache may serve reads'})",
            flush=True,
        )
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for round_index in range(args.rounds):
        for name in names:
            if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                results[name] = [{"skipped": "deepspeed is not importable here"}]
                continue
            if name == "deepspeed" and args.lora:
                results[name] = [{"skipped": "the DeepSpeed row does not train LoRA"}]
                continue
            run = launch(name, world, args)
            results[name].append(run)
            print(
                f"round {round_index + 1} {name}: median {statistics.median(run['timed']):.3f} s",
                flush=True,
            )
    print()
    lora = f", LoRA rank {args.lora} on a frozen base" if args.lora else ""
    print(report(results, base, ref, f"world {world}, {args.layers} layers{lora}"))
    workload = Workload(layers=args.layers, lora=args.lora)
    trainable = workload.lora_numel if args.lora else None
    print(memory.report(results, world, memory.model_numel(workload), trainable))


if __name__ == "__main__":
    main()
