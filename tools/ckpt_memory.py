"""Peak memory of checkpointing: save, async save, load, consolidation.

    python tools/ckpt_memory.py                 # 256 MiB fp32 model, 16 layers, 2 ranks
    python tools/ckpt_memory.py --mib 512 --layers 8 --nproc 2
    python tools/ckpt_memory.py --mib 1024 --layers 64 --phases save consolidate

Each phase runs in fresh processes (torchrun for the ranks, one process for the
consolidation). A rank builds the model (a stack of bias-free ``nn.Linear``), shards it,
takes one AdamW step so the optimizer state exists, and then measures one operation:
the growth of its peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) over a
baseline taken just before, in the same process. The high-water mark is reset first
(writing 5 to ``/proc/self/clear_refs``, Linux), so that the peak of building and
training the model does not hide the operation's own. Growth is reported in MiB and as
ratios to this rank's saved state (its model shards and Adam's two moments) and to the
largest tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("save", "async", "load", "load-fresh", "consolidate")


def _reset_peak() -> int:
    """Reset the high-water mark; the current RSS (KiB) as the baseline."""
    gc.collect()
    with contextlib.suppress(OSError):  # glibc keeps freed small blocks otherwise
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _model(mib: int, layers: int):
    import torch
    from torch import nn

    dim = int(math.sqrt(mib * 2**20 / 4 / layers))
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(layers))), dim


def _rank_phase(args: argparse.Namespace) -> dict[str, object]:
    import torch

    from zero3.comm import create_backend
    from zero3.core import Zero3Config
    from zero3.hooks import shard_module
    from zero3.optim import PartitionedOptimizer, load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    comm = create_backend("gloo", timeout_s=600)
    model, dim = _model(args.mib, args.layers)
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    if args.phase != "load-fresh":
        model(torch.randn(4, dim)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    comm.barrier().wait()
    base = _reset_peak()
    start = time.perf_counter()
    returned = 0.0
    if args.phase == "save":
        save_checkpoint(args.dir, model, opt)
    elif args.phase == "async":
        future = save_checkpoint(args.dir + "-async", model, opt, async_save=True)
        returned = time.perf_counter() - start
        assert future is not None
        future.result()
    else:
        load_checkpoint(args.dir, model, opt)
    seconds = time.perf_counter() - start
    comm.barrier().wait()
    return {
        "phase": args.phase,
        "rank": comm.rank,
        "growth_kib": _peak() - base,
        "seconds": seconds,
        "returned_s": returned,
    }


def _consolidate_phase(args: argparse.Namespace) -> dict[str, object]:
    from zero3.optim import consolidate_checkpoint

    base = _reset_peak()
    start = time.perf_counter()
    consolidate_checkpoint(args.dir, args.dir + "-hf")
    return {
        "phase": "consolidate",
        "rank": 0,
        "growth_kib": _peak() - base,
        "seconds": time.perf_counter() - start,
        "returned_s": 0.0,
    }


def _run_phase(phase: str, args: argparse.Namespace, ckpt: str) -> list[dict[str, object]]:
    me = str(Path(__file__).resolve())
    flags = ["--phase", phase, "--dir", ckpt, "--mib", str(args.mib), "--layers", str(args.layers)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if phase == "consolidate":
        cmd = [sys.executable, me, *flags]
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(args.nproc), me, *flags]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{phase} failed:\n{out.stdout}\n{out.stderr}")
    return [json.loads(line[6:]) for line in out.stdout.splitlines() if line.startswith("RESULT")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="model size (fp32 MiB)")
    p.add_argument("--layers", type=int, default=16, help="equal nn.Linear layers")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument(
        "--phases",
        nargs="+",
        choices=PHASES,
        default=list(PHASES),
        help="what to measure (save runs first: the others read its checkpoint)",
    )
    p.add_argument("--phase", choices=PHASES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase is not None:  # one measurement, inside a rank or the consolidating process
        result = _consolidate_phase(args) if args.phase == "consolidate" else _rank_phase(args)
        print("RESULT" + json.dumps(result), flush=True)
        return 0
    root = tempfile.mkdtemp(prefix="zero3-ckpt-memory-")
    try:
        ckpt = os.path.join(root, "ckpt")
        phases = ["save", *(p for p in args.phases if p != "save")]
        rows = [row for phase in phases for row in _run_phase(phase, args, ckpt)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    model_mib = args.mib
    largest = model_mib / args.layers
    state = 3 * model_mib / args.nproc  # this rank's shards: weights + Adam's two moments
    print(
        f"model {model_mib} MiB fp32 in {args.layers} tensors of {largest:.1f} MiB, "
        f"{args.nproc} ranks: each rank saves {state:.0f} MiB (weights + 2 Adam moments)"
    )
    print(
        f"{'phase':<12}{'rank':>5}{'growth MiB':>12}{'/ rank state':>14}{'/ largest':>11}{'s':>8}"
    )
    for row in rows:
        mib = float(row["growth_kib"]) / 1024  # type: ignore[arg-type]
        note = f" (returned after {row['returned_s']:.2f} s)" if row["returned_s"] else ""
        print(
            f"{row['phase']:<12}{row['rank']:>5}{mib:>12.1f}{mib / state:>14.2f}"
            f"{mib / largest:>11.2f}{float(row['seconds']):>8.2f}{note}"  # type: ignore[arg-type]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
