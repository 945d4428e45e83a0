"""The Python half of tools/gpu_check.sh: engine parity and step timing on one device.

    tools/gpu_check.sh                       # on the GPU machine: runs the parts below
    "$PY" tools/gpu_check.py parity --dtype fp32  # zero3 vs plain PyTorch, world 1
    "$PY" tools/gpu_check.py parity --dtype bf16  # bf16 params, fp32 masters
    "$PY" tools/gpu_check.py bench                # plain, FSDP2, zero3 step times
    ./dev run python tools/gpu_check.py bench --device cpu --layers 1 --d-model 64  # here

(``$PY``: the Python of the environment gpu_check.sh sets up on that machine, with its
CUDA torch.)

Everything runs at world 1 on ``--device`` (default ``cuda``; ``cpu`` exists so the logic
can be checked on a machine without a GPU, over gloo instead of nccl). The bench runs each
(system, round) in a fresh process, rounds interleaved, and reports each system's median
step time (the device synchronized before and after every timed step), its ratio to plain
PyTorch (median of the per-round ratios), peak device memory, and the largest loss
difference from plain PyTorch on the same batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from _bench.workload import gpt  # the benchmark's model (zero3-tools, installed by gpu_check.sh)
from _train.model import GPT
from torch import nn

RESULT = "GPU_CHECK_RESULT "
SYSTEMS = ("plain", "fsdp2", "zero3")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT; the default is about 170M parameters (a step of tens of ms on an H100)."""

    layers: int = 8
    d_model: int = 1024
    heads: int = 16
    vocab: int = 32768
    seq: int = 1024
    batch: int = 8


def build(shape: Shape, device: torch.device) -> GPT:
    """The model, identical in every process (seeded, built on CPU, then moved)."""
    torch.manual_seed(0)
    return gpt(shape).to(device)


def batch(shape: Shape, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch (the same in every process)."""
    g = torch.Generator().manual_seed(7919 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def synchronize(device: torch.device) -> None:
    """Wait for the device (timing and result reads only)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def world_of_one(device: torch.device) -> None:
    """A one-process default group for FSDP2 (nccl on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    store = tempfile.mkstemp(prefix="gpu-check-store-")[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def zero3_comm(device: torch.device) -> Any:
    """The zero3 backend of this device, as a world of one."""
    from zero3.comm import create_backend

    return create_backend("nccl" if device.type == "cuda" else "gloo", timeout_s=120)


# -- parity -----------------------------------------------------------------------------


def parity(args: argparse.Namespace) -> dict[str, Any]:
    """zero3 at world 1 against plain PyTorch doing the same arithmetic.

    fp32: both step the model's parameters with AdamW. bf16: the reference keeps a bf16
    model and fp32 master copies, as zero3 does with ``param_dtype=bf16``.
    """
    from zero3.core import Zero3Config
    from zero3.hooks import full_state_dict, shard_module
    from zero3.optim import PartitionedOptimizer

    device = torch.device(args.device)
    shape = _shape(args)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build(shape, device)
    reference = build(shape, device).to(dtype)
    masters = [p.detach().float().clone() for p in reference.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-3)
    comm = zero3_comm(device)
    # --offload-optimizer cpu: masters and AdamW state on the host, stepped there, with
    # the gradients and stepped shards on copy streams (page-locked staging).
    offload = {"device": args.offload_optimizer, "pin_memory": True}
    config = Zero3Config(
        param_dtype=dtype if dtype != torch.float32 else None, offload_optimizer=offload
    )
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    losses, ref_losses = [], []
    for step in range(args.steps):
        x, y = batch(shape, step, device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(x, y)
        ref_loss.backward()
        for master, p in zip(masters, reference.parameters(), strict=True):
            master.grad = p.grad.float()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.zero_grad()
        with torch.no_grad():
            for p, master in zip(reference.parameters(), masters, strict=True):
                p.copy_(master)
        losses.append(float(loss.detach()))
        ref_losses.append(float(ref_loss.detach()))
    full = full_state_dict(model)
    worst, off, total = 0.0, 0, 0
    for key, want in reference.state_dict().items():
        gap = (full[key].float() - want.float()).abs()
        worst = max(worst, float(gap.max()))
        off += int((gap > 1e-4 + 1e-3 * want.float().abs()).sum())
        total += want.numel()
    comm.close()
    masters_on = sorted({str(t.device) for t in opt.master_shards()})
    return {
        "dtype": args.dtype,
        "offload_optimizer": args.offload_optimizer,
        "masters_on": masters_on,
        "device": str(device),
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "max_param_diff": worst,
        "off": off / total,
        "losses": losses,
    }


def check_parity(result: dict[str, Any]) -> list[str]:
    """What is wrong with a parity result (empty when it passes).

    fp32 runs the same kernels on the same data, so only reduction order inside kernels
    (atomics in embedding backward) may differ: losses within 1e-5 and at most 0.5% of the
    elements off by more than 1e-4 + 1e-3*|v|, as the CPU tests require. bf16: the same
    arithmetic in bf16 (8 significant bits): losses within 1e-2, the same 0.5% bound.
    """
    limit = 1e-5 if result["dtype"] == "fp32" else 1e-2
    problems = []
    if result.get("offload_optimizer", "none") != "none" and result["masters_on"] != ["cpu"]:
        problems.append(f"offloaded masters are on {result['masters_on']}, not the host")
    if not result["max_loss_diff"] <= limit:
        problems.append(f"losses differ by {result['max_loss_diff']:.3g} (limit {limit:g})")
    if not result["off"] <= 0.005:
        problems.append(f"{100 * result['off']:.2f}% of parameter elements differ (limit 0.5%)")
    return problems


# -- bench ------------------------------------------------------------------------------


def run_system(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """One system's training steps in this process: step times, losses, peak memory."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = _shape(args)
    model: nn.Module = build(shape, device)
    comm = None
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        world_of_one(device)
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    elif system == "zero3":
        from zero3.core import Zero3Config
        from zero3.hooks import shard_module

        comm = zero3_comm(device)
        shard_module(model, Zero3Config(), comm=comm)
    elif system != "plain":
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    if system == "zero3":
        from zero3.optim import PartitionedOptimizer

        opt: torch.optim.Optimizer = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        x, y = batch(shape, step, device)
        synchronize(device)
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"system": system, "times": times[args.warmup :], "losses": losses, "peak": peak}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every system in fresh processes, rounds interleaved; medians and ratios to plain.

    A system that fails is reported (its first error line) and left out of later rounds;
    the others are still timed.
    """
    systems = args.systems.split(",")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    errors: dict[str, str] = {}
    for round_index in range(args.rounds):
        for system in systems:
            if system in errors:
                continue
            try:
                run = _subprocess(["worker", system, *_shape_flags(args)], args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors[system] = str(exc)
                print(f"round {round_index + 1} {system}: FAILED\n{exc}", flush=True)
                continue
            runs[system].append(run)
            median = statistics.median(run["times"])
            print(f"round {round_index + 1} {system}: {1000 * median:.1f} ms/step", flush=True)
    table: dict[str, dict[str, Any]] = {}
    plain = runs.get("plain") if "plain" not in errors else None
    for system in systems:
        if system in errors:
            table[system] = {"error": _first_error_line(errors[system])}
            continue
        system_runs = runs[system]
        medians = [statistics.median(r["times"]) for r in system_runs]
        row: dict[str, Any] = {"median_ms": 1000 * statistics.median(medians)}
        if plain and system != "plain":
            ratios = [
                m / statistics.median(p["times"]) for m, p in zip(medians, plain, strict=True)
            ]
            row["vs_plain"] = statistics.median(ratios)
            pairs = zip(system_runs[-1]["losses"], plain[-1]["losses"], strict=True)
            row["loss_diff"] = max(abs(a - b) for a, b in pairs)
        row["peak_gib"] = system_runs[-1]["peak"] / 2**30
        table[system] = row
    return {"device": args.device, "shape": dataclasses.asdict(_shape(args)), "systems": table}


def _first_error_line(text: str) -> str:
    """The exception line of a traceback (the last line naming an Error)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line.split(":")[0]]
    return (named or lines or ["?"])[-1][:300]


def format_bench(result: dict[str, Any]) -> str:
    """A markdown table of a bench result."""
    lines = [
        f"world 1 on {result['device']}, shape {result['shape']}",
        "",
        "| system | median step (ms) | vs plain | peak memory (GiB) | max loss diff vs plain |",
        "|---|---|---|---|---|",
    ]
    for system, row in result["systems"].items():
        if "error" in row:
            lines.append(f"| {system} | FAILED: {row['error']} | | | |")
            continue
        ratio = f"{row['vs_plain']:.3f}x" if "vs_plain" in row else "-"
        diff = f"{row['loss_diff']:.1e}" if "loss_diff" in row else "-"
        lines.append(
            f"| {system} | {row['median_ms']:.1f} | {ratio} | {row['peak_gib']:.2f} | {diff} |"
        )
    return "\n".join(lines)


# -- plumbing ----------------------------------------------------------------------------


def _shape(args: argparse.Namespace) -> Shape:
    return Shape(args.layers, args.d_model, args.heads, args.vocab, args.seq, args.batch)


def _shape_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for name in ("layers", "d_model", "heads", "vocab", "seq", "batch"):
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


def _subprocess(argv: list[str], timeout: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    if line is None:
        raise RuntimeError(f"{' '.join(argv[:2])} printed no result:\n{proc.stdout[-2000:]}")
    return json.loads(line.removeprefix(RESULT))  # type: ignore[no-any-return]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("job", choices=["parity", "bench", "worker"])
    p.add_argument("system", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="parity only")
    p.add_argument(
        "--offload-optimizer", default="none", choices=["none", "cpu"],
        help="parity only: step the masters on the host (offload_optimizer cpu)",
    )  # fmt: skip
    p.add_argument("--systems", default=",".join(SYSTEMS), help="bench: comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps (parity: steps)")
    p.add_argument("--warmup", type=int, default=3)
    defaults = Shape()
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--heads", type=int, default=defaults.heads)
    p.add_argument("--vocab", type=int, default=defaults.vocab)
    p.add_argument("--seq", type=int, default=defaults.seq)
    p.add_argument("--batch", type=int, default=defaults.batch)
    p.add_argument("--timeout", type=float, default=150, help="seconds per bench process")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check.py: no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); pass --device cpu to check the logic here",
            file=sys.stderr,
        )
        return 2
    if args.job == "worker":
        print(RESULT + json.dumps(run_system(args.system, args)), flush=True)
        sys.stdout.flush()
        os._exit(0)  # skip teardown of the process group threads (:ref:`fact-gloo-teardown`)
    if args.job == "parity":
        result = parity(args)
        problems = check_parity(result)
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}))
        for problem in problems:
            print(f"FAIL parity {args.dtype}: {problem}")
        return 1 if problems else 0
    result = bench(args)
    print(format_bench(result))
    print(RESULT + json.dumps(result))
    return 1 if any("error" in row for row in result["systems"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
