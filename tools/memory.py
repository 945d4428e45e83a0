"""Memory of models bigger than one rank, measured: peak RSS per rank against bounds.

    ./dev run python tools/memory.py build               # world 2: build + one forward
    ./dev run python tools/memory.py build --offload-param /tmp   # + shards streamed to disk
    ./dev run python tools/memory.py load --worlds 2,4   # a >= 1.5 GB fp32 checkpoint
    ./dev run python tools/memory.py table               # training, world 1/2/4 vs theory
    ./dev run python tools/memory.py cap                 # RLIMIT_DATA: zero3 trains, DDP not
    ./dev run python tools/memory.py largest --cap-mib 600   # the largest GPT under a cap
    ./dev run python tools/memory.py offload             # offload's peaks vs in-memory zero3
    ./dev run python tools/memory.py offload --untrimmed # + each with the heap kept
    ./dev run python tools/memory.py checkpoint          # save, async save, load, consolidate

Every figure is the growth of a rank's peak resident set (the kernel's high-water mark,
``VmHWM``: ``ru_maxrss`` without the peak of the parent image before ``exec``) over a baseline
taken in the same process after the imports and the process group (the interpreter,
torch and gloo cost the same with or without a model); at the baseline the peak is reset
to the current RSS (``/proc/self/clear_refs``), so an earlier transient peak of the
imports cannot hide growth. ``W`` is the model's fp32 weight bytes, ``L`` its largest
tensor, ``N`` the world size. The bounds checked:

- building under ``empty_init`` (and loading a checkpoint): ``1.1·(W/N + 2·L) + 32 MiB``;
- then one forward (no grad, one sequence) with ``max_reuse_distance=0``, a one-layer
  ``prefetch_bucket_size`` and ``max_live_parameters`` of three layers:
  ``1.1·(W/N + 4·L) + 32 MiB``.

The bounds are checked with glibc's mmap threshold pinned (``MALLOC_MMAP_THRESHOLD_`` =
128 KiB in each rank's environment, ``--malloc pinned``, the default): by default glibc
raises the threshold to the size of every large block freed (up to 32 MiB), after which
the forward's activations of a few MiB come from the heap, whose holes are not handed
back, and the resident set creeps up layer by layer (measured on the benchmark GPT: 1 to 5
MiB per block, 26 MiB more after one forward; :ref:`fact-mmap-threshold`). The creep is the
allocator's, not zero3's, and eager PyTorch pays it too; the zero3 path is also run with
glibc's default and printed beside (not checked), so both are on record.

With ``--offload-param DIR``, ``build`` and ``load`` also build with the parameter shards
streamed into swap files under DIR (``offload_param`` nvme, ``max_in_cpu`` 0), checked
against ``1.1·(B·L/N + 2·L) + 32 MiB`` (``+ 4·L`` with the forward), ``B`` being
``offload_param.buffer_count``: the writes in flight, and in the forward the reads ahead,
take the shards' place.

``offload`` trains the benchmark GPT at world 2 with in-memory zero3, optimizer offload
(nvme) and both offloads, ``--repeats`` runs each and under both allocator settings, and
checks that each offload's median peak is below in-memory zero3's by at least 80% of the
model state it moves out of memory (``memory_stats`` held bytes); checked with the
threshold pinned, printed with glibc's default.

``checkpoint`` measures each checkpoint operation on a 256 MiB fp32 model of 16 equal
tensors at world 2 (``--ckpt-mib``, ``--ckpt-layers``, ``--worlds``): after one AdamW step,
from a baseline taken just before the operation, against the rank's saved state (its
weight shards and two Adam moments) and the largest tensor (docs/checkpoints.rst).

The eager path (every rank builds the model whole, loads the weights, then shards it) is
run beside each for comparison; it is skipped when the machine's available memory could
not hold it. The script exits with status 1 when a bound is missed or the cap
demonstration does not come out as claimed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _bench.workload import Workload
from _train.launch import free_port, rank_env
from _train.report import peak_rss_bytes, rss_baseline

MiB = 2**20
RESULT = "MEMORY_RESULT "
#: glibc's initial mmap threshold; set in the environment it also stops the threshold's rise.
PINNED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
#: The benchmark GPT (tools/bench.py) and a 1.75 GB fp32 one of the same shape.
SMALL = Workload()
BIG = Workload(layers=8, d_model=2048, heads=16)


# -- the ranks ---------------------------------------------------------------------------------


def _meminfo(field: str) -> int:
    with open("/proc/self/status" if field.startswith("Vm") else "/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _bounds_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build (and load), then one forward; every growth from one baseline."""
    import torch
    from _bench.workload import batch, build

    from zero3.comm import GlooBackend
    from zero3.core import Zero3Config
    from zero3.core.engine import sharded_state
    from zero3.hooks import empty_init, memory_stats, shard_module

    torch.set_num_threads(1)
    w = Workload(**spec["workload"])
    comm = GlooBackend(timeout_s=900)
    layer = w.layer_numel
    offload = (
        {"offload_param": {"device": "nvme", "nvme_path": spec["offload"], "max_in_cpu": 0}}
        if spec.get("offload")
        else {}
    )
    config = Zero3Config(
        backend="gloo",
        max_reuse_distance=0,
        prefetch_bucket_size=layer,
        max_live_parameters=3 * layer,
        **offload,
    )
    x, y = batch(Workload(**{**spec["workload"], "batch": 1}), 0, comm.rank, comm.world_size)
    comm.barrier().wait()
    baseline = rss_baseline()
    if spec["eager"]:
        model = build(w)
        if spec["checkpoint"]:
            _load_eagerly(model, spec["checkpoint"])
        shard_module(model, config, comm=comm)
    else:
        torch.manual_seed(w.seed)
        with empty_init():
            model = build(w)
        shard_module(model, config, comm=comm, checkpoint=spec["checkpoint"] or None)
    built = peak_rss_bytes() - baseline
    with torch.no_grad():
        model(x, y)
    forward = peak_rss_bytes() - baseline
    held = memory_stats(model).param_bytes
    swap = sharded_state(model).param_swap
    if swap is not None:
        swap.close()  # os._exit runs no finalizer: the swap file goes now
    return {"rank": comm.rank, "baseline": baseline, "built": built, "forward": forward,
            "held": held}  # fmt: skip


def _load_eagerly(model: Any, path: str) -> None:
    """The eager path's load: each file's tensors into the whole model, file by file."""
    import torch
    from safetensors.torch import load_file

    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(set(index["weight_map"].values())):
            for key, value in load_file(str(Path(path) / name)).items():
                params[key].copy_(value)


def _cap_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Train a few steps under an RLIMIT_DATA cap; report success or the error."""
    import resource

    import torch
    from _bench.systems import SYSTEMS
    from _bench.workload import Workload as W

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    rss_baseline()
    cap = _meminfo("VmData") + spec["allowance"]
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    w = W(**spec["workload"])
    try:
        step, info = SYSTEMS[spec["system"]](w, rank, dist.get_world_size())
        losses = [step(i) for i in range(spec["steps"])]
        outcome = {"ok": True, "losses": losses}
        info.get("close", lambda: None)()  # the worker leaves with os._exit: files go now
    except (RuntimeError, MemoryError) as exc:
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    data = _meminfo("VmData") - cap + spec["allowance"]  # growth of the data segment
    return {"rank": rank, "cap": cap, "data": data, "peak": peak_rss_bytes(), **outcome}


def _consolidate_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Consolidation's peak RSS growth: one process, no process group (as
    ``zero3-consolidate`` runs)."""
    import time

    from zero3.optim import consolidate_checkpoint

    base = rss_baseline()
    start = time.perf_counter()
    consolidate_checkpoint(spec["dir"], spec["dir"] + "-hf")
    return {"rank": 0, "growth": peak_rss_bytes() - base, "seconds": time.perf_counter() - start}


def _checkpoint_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's peak RSS growth in a checkpoint operation (``spec["phase"]``).

    The rank builds a stack of equal bias-free linears, shards it and takes one AdamW
    step (so the optimizer state exists; not for ``load-fresh``), then measures the
    operation from a baseline taken just before it.
    """
    import time

    import torch
    from torch import nn

    from zero3.comm import create_backend
    from zero3.core import Zero3Config
    from zero3.core.engine import sharded_state
    from zero3.hooks import shard_module
    from zero3.optim import PartitionedOptimizer, load_checkpoint, save_checkpoint

    phase, path = spec["phase"], spec["dir"]
    torch.set_num_threads(1)
    comm = create_backend("gloo", timeout_s=600)
    dim = int((spec["mib"] * MiB / 4 / spec["layers"]) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(spec["layers"])))
    swap = spec.get("offload")
    offload = (
        {"offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
         "offload_optimizer": {"device": "nvme", "nvme_path": swap}}
        if swap else {}
    )  # fmt: skip
    shard_module(model, Zero3Config(param_persistence_threshold=0, **offload), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    if phase != "load-fresh":
        model(torch.randn(4, dim)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    comm.barrier().wait()
    base = rss_baseline()
    start = time.perf_counter()
    returned = 0.0
    if phase == "save":
        save_checkpoint(path, model, opt)
    elif phase == "async":
        future = save_checkpoint(path + "-async", model, opt, async_save=True)
        returned = time.perf_counter() - start
        assert future is not None
        future.result()
    else:
        load_checkpoint(path, model, opt)
    seconds = time.perf_counter() - start
    comm.barrier().wait()
    growth = peak_rss_bytes() - base
    if opt.offload is not None:
        opt.offload.close()  # os._exit runs no finalizer: the swap files go now
    if sharded_state(model).param_swap is not None:
        sharded_state(model).param_swap.close()
    return {"rank": comm.rank, "growth": growth, "seconds": seconds, "returned": returned}


_WORKERS = {
    "bounds": _bounds_worker,
    "cap": _cap_worker,
    "checkpoint": _checkpoint_worker,
    "consolidate": _consolidate_worker,
}


def worker_main(kind: str, spec: dict[str, Any]) -> None:
    """One rank: run, print the result line, leave without interpreter teardown."""
    try:
        result = _WORKERS[kind](spec)
    except Exception as exc:  # reported, not raised: the parent prints it
        result = {"rank": int(os.environ.get("RANK", "0")), "crash": f"{type(exc).__name__}: {exc}"}
    print(RESULT + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)  # a finished gloo rank can abort at exit (:ref:`fact-gloo-teardown`)


def launch(
    kind: str,
    world: int,
    spec: dict[str, Any],
    timeout: float,
    extra_env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``world`` fresh ranks of ``kind`` (``extra_env`` added to their environment);
    every rank's result."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**rank_env(rank, world, port, 1), **(extra_env or {})}
        cmd = [sys.executable, __file__, "--worker", kind, "--spec", json.dumps(spec)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for rank, p in enumerate(procs):
        out, _ = p.communicate(timeout=timeout)
        lines = [x for x in out.splitlines() if x.startswith(RESULT)]
        results.append(json.loads(lines[-1][len(RESULT) :]) if lines else {"rank": rank,
                       "crash": f"exit {p.returncode}, no result"})  # fmt: skip
    return results


# -- checkpoints -------------------------------------------------------------------------------


def write_checkpoint(w: Workload, path: Path, files: int = 4) -> None:
    """Random fp32 weights of the model in the transformers layout (``files`` files and an
    index), written one file at a time: the writer never holds the whole model."""
    import torch
    from _bench.workload import build
    from safetensors.torch import save_file

    if (path / "model.safetensors.index.json").is_file():
        return
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in build(w).state_dict().items()}
    total = sum(s.numel() * 4 for s in shapes.values())
    groups: list[list[str]] = [[]]
    size = 0
    for key, shape in shapes.items():
        if size >= total / files and len(groups) < files:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += shape.numel() * 4
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: torch.randn(shapes[k], generator=g) * 0.02 for k in keys}, str(path / name))
        weight_map.update(dict.fromkeys(keys, name))
        gc.collect()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


# -- the reports -------------------------------------------------------------------------------


def _sizes(w: Workload) -> tuple[int, int]:
    """(W, L): fp32 weight bytes and the largest tensor's bytes."""
    import torch
    from _bench.workload import build

    with torch.device("meta"):
        params = list(build(w).parameters())
    return sum(p.numel() * 4 for p in params), max(p.numel() * 4 for p in params)


def _available() -> int:
    return _meminfo("MemAvailable")


def bounds(
    w: Workload,
    worlds: list[int],
    checkpoint: str,
    timeout: float,
    pinned: bool,
    offload_dir: str = "",
) -> bool:
    """Build (+ load) and forward at each world size against the bounds; eager beside,
    and (``offload_dir``) the build with the parameter shards streamed into swap files.
    """
    from zero3.core import Zero3Config

    weights, largest = _sizes(w)
    in_flight = Zero3Config().offload_param.buffer_count  # shard writes / reads ahead
    source = f"from checkpoint {checkpoint}" if checkpoint else "initialised by reset_parameters"
    print(f"model: GPT {w.layers} layers, d_model {w.d_model}, vocab {w.vocab}: "
          f"W = {weights / MiB:.0f} MiB fp32, largest tensor L = {largest / MiB:.0f} MiB; "
          f"{source}")  # fmt: skip
    print(f"glibc mmap threshold: {'pinned at 128 KiB' if pinned else 'glibc default'}")
    print()
    print("| N | path | built: growth / bound (MiB) | + forward: growth / bound (MiB) "
          "| parameter shards held (MiB) | baseline (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    ok = True
    spec = {"workload": vars(w), "checkpoint": checkpoint}
    # (eager, environment, checked): the zero3 path is also run under glibc's default
    # threshold when the bound is checked with it pinned, so both are on record.
    runs = [
        (False, PINNED_MMAP if pinned else {}, True, False),
        (True, PINNED_MMAP if pinned else {}, False, False),
    ]
    if pinned:
        runs.append((False, {}, False, False))
    if offload_dir:
        runs.append((False, PINNED_MMAP if pinned else {}, True, True))
    for n in worlds:
        for eager, env, checked, offloaded in runs:
            # Offloaded shards are written as they are cut: none stay, but the writes in
            # flight (buffer_count of the largest shard) and, in the forward, the shards
            # read ahead (as many) take their place.
            held = in_flight * largest / n if offloaded else weights / n
            build_bound = 1.1 * (held + 2 * largest) + 32 * MiB
            forward_bound = 1.1 * (held + 4 * largest) + 32 * MiB
            label = "eager (whole model on every rank)" if eager else "empty_init + shard_module"
            if offloaded:
                label += ", offload_param nvme (max_in_cpu 0)"
            if pinned and not env:
                label += ", glibc default threshold (not checked)"
            need = n * (1.3 * (weights + weights / n) + 600 * MiB)
            if eager and need > _available() - 2 * 2**30:
                print(f"| {n} | {label} | skipped: needs ~{need / 2**30:.1f} GiB, "
                      f"{_available() / 2**30:.1f} GiB available | | | |")  # fmt: skip
                continue
            run_spec = {**spec, "eager": eager, "offload": offload_dir if offloaded else ""}
            rows = launch("bounds", n, run_spec, timeout, env)
            crashed = [r for r in rows if "crash" in r]
            if crashed:
                print(f"| {n} | {label} | FAILED: {crashed[0]['crash']} | | | |")
                ok = False
                continue
            built = max(r["built"] for r in rows)
            forward = max(r["forward"] for r in rows)
            marks = ""
            if checked:
                fits = built <= build_bound and forward <= forward_bound
                ok &= fits
                marks = "" if fits else " **over**"
            print(f"| {n} | {label} | {built / MiB:.0f} / {build_bound / MiB:.0f} "
                  f"| {forward / MiB:.0f} / {forward_bound / MiB:.0f}{marks} "
                  f"| {max(r['held'] for r in rows) / MiB:.0f} "
                  f"| {max(r['baseline'] for r in rows) / MiB:.0f} |", flush=True)  # fmt: skip
    return ok


def table(worlds: list[int], systems: list[str], steps: int, timeout: float) -> bool:
    """The benchmark GPT trained at each world size: per-rank peak RSS growth, model
    state held (measured) and estimated, against 16·Ψ/N; DDP beside it."""
    import bench
    import torch
    from _bench.workload import build

    from zero3.core import Zero3Config, estimate_model_states

    w = SMALL
    with torch.device("meta"):
        meta = build(w)
    psi = sum(p.numel() for p in meta.parameters())
    print(f"benchmark GPT: Psi = {psi / 1e6:.1f}M parameters, fp32 AdamW, batch {w.batch} x "
          f"seq {w.seq} per rank, {steps} steps; MiB per rank (the largest rank)")  # fmt: skip
    print()
    print("| N | system | theory 16·Ψ/N | estimate | held (memory_stats) | peak RSS growth "
          "| growth - held | below DDP | baseline |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    args = argparse.Namespace(threads=1, layers=w.layers, steps=steps, warmup=0,
                              profile=False, timeout=timeout, lora=0)  # fmt: skip
    ok = True
    for n in worlds:
        estimate = estimate_model_states(meta, n, config=Zero3Config())
        ddp = None
        for system in systems:
            # DDP needs a process group; one process trains plainly.
            name = "plain" if system == "ddp" and n == 1 else system
            run = bench.launch(name, n, args)
            growth = max(p - b for p, b in zip(run["rss"], run["baseline"], strict=True))
            ddp = growth if system == "ddp" else ddp
            below = f"{(ddp - growth) / MiB:.0f}" if ddp is not None and system != "ddp" else "-"
            held = est = extra = "-"
            if "held" in run:
                off = abs(run["held"] - estimate.per_rank_bytes) / estimate.per_rank_bytes
                ok &= off < 0.01
                held = f"{run['held'] / MiB:.1f}"
                est = f"{estimate.per_rank_bytes / MiB:.1f}"
                extra = f"{(growth - run['held']) / MiB:.0f}"
            theory = 16 * psi / (n if system.startswith("zero3") else 1)
            base = max(run["baseline"]) / MiB
            print(f"| {n} | {name} | {theory / MiB:.0f} | {est} | {held} | {growth / MiB:.0f} "
                  f"| {extra} | {below} | {base:.0f} |", flush=True)  # fmt: skip
    print("\nestimate: zero3.core.estimate_model_states(model on meta, N); held: "
          "zero3.hooks.memory_stats(model, optimizer) after each backward, most of any "
          "step")  # fmt: skip
    return ok


def cap(layers: int, allowance: int, timeout: float) -> bool:
    """zero3 at world 4 trains under a per-process RLIMIT_DATA cap that DDP exceeds."""
    w = Workload(layers=layers, batch=1)
    weights, _ = _sizes(w)
    print(f"model: GPT {layers} layers, W = {weights / MiB:.0f} MiB; fp32 AdamW state "
          f"unsharded 16·Ψ = {4 * weights / MiB:.0f} MiB; cap per process: VmData at the "
          f"start + {allowance / MiB:.0f} MiB (RLIMIT_DATA)")  # fmt: skip
    outcome: dict[str, bool] = {}
    oom_seen = False
    for system in ("zero3", "ddp"):
        rows = launch("cap", 4, {"workload": vars(w), "system": system, "steps": 3,
                                 "allowance": allowance}, timeout)  # fmt: skip
        ok = all(r.get("ok") for r in rows)
        outcome[system] = ok
        errors = sorted({r.get("error") or r.get("crash", "") for r in rows if not r.get("ok")})
        if system == "ddp":
            oom_seen = any("can't allocate memory" in e for e in errors)
        data = max(r.get("data", 0) for r in rows) / MiB
        print(f"  {system} at world 4: " + ("trained 3 steps, losses "
              + ", ".join(f"{x:.4f}" for x in rows[0]["losses"]) if ok else "failed: "
              + " | ".join(errors)) + f" (data segment grew {data:.0f} MiB)")  # fmt: skip
    expected = outcome["zero3"] and oom_seen
    print("  as claimed" if expected else "  NOT as claimed")
    return expected


def largest(
    allowance: int, world: int, layers: list[int], systems: list[str], timeout: float
) -> bool:
    """The largest benchmark GPT each system trains under one RLIMIT_DATA cap per rank
    (by default DDP, FSDP2, zero3, zero3 with its optimizer state in swap files, and
    zero3 with its parameter shards there too)."""
    print(f"cap per rank: VmData at the start + {allowance / MiB:.0f} MiB (RLIMIT_DATA); "
          f"world {world}; the benchmark GPT at {', '.join(map(str, layers))} layers, batch "
          "1, 2 fp32 AdamW steps; each system stops at its first failure")  # fmt: skip
    fits: dict[str, int] = {}
    for system in systems:
        fits[system] = 0
        for n in layers:
            w = Workload(layers=n, batch=1)
            spec = {"workload": vars(w), "system": system, "steps": 2, "allowance": allowance}
            rows = launch("cap", world, spec, timeout)
            data = max(r.get("data", 0) for r in rows) / MiB
            if not all(r.get("ok") for r in rows):
                errors = sorted({r.get("error") or r.get("crash", "") for r in rows
                                 if not r.get("ok")})  # fmt: skip
                print(f"  {system}, {n} layers: failed (data segment grew {data:.0f} MiB): "
                      + " | ".join(e[:120] for e in errors), flush=True)  # fmt: skip
                break
            fits[system] = _sizes(w)[0] // 4
            print(f"  {system}, {n} layers (Psi {fits[system] / 1e6:.1f}M): trained (data "
                  f"segment grew {data:.0f} MiB)", flush=True)  # fmt: skip
    base = fits.get("ddp")
    print("\n| system | largest model trained (Psi) | x larger model per GiB of RAM than DDP |")
    print("|---|---|---|")
    for system, psi in fits.items():
        ratio = f"{psi / base:.2f}" if base else "- (no DDP row in this run)"
        print(f"| {system} | {psi / 1e6:.1f}M | {ratio} |")
    # zero3 trains a larger model than DDP; each offload at least as large as without.
    order = [fits[s] for s in ("ddp", "zero3") if s in fits]
    offloads = [fits[s] for s in ("zero3", "zero3-offload-nvme", "zero3-offload-both") if s in fits]
    return (
        all(a < b for a, b in itertools.pairwise(order))
        and all(a <= b for a, b in itertools.pairwise(offloads))
        and all(order + offloads)
    )


#: What `offload` compares: in-memory zero3, then each offload (tools/bench.py systems).
OFFLOAD_SYSTEMS = ("zero3", "zero3-offload-nvme", "zero3-offload-both")
#: With ``--untrimmed``: each offload again with ``trim_host_heap=False``.
UNTRIMMED_SYSTEMS = ("zero3-offload-nvme-untrimmed", "zero3-offload-both-untrimmed")
#: glibc's mmap threshold pinned at 128 KiB (freed large blocks go back to the kernel).
PINNED = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def offload(
    world: int, layers: int, repeats: int, mallocs: list[str], timeout: float,
    untrimmed: bool = False,
) -> bool:  # fmt: skip
    """Peak RSS growth per rank of in-memory zero3 and of each offload, ``repeats`` runs
    each (interleaved), under each allocator setting: against the target that each
    offload's peak is below the in-memory peak by at least 80% of the model state it
    moves out of memory (``memory_stats`` after the backward: held bytes of in-memory
    zero3 minus the offload's). Medians of the runs; checked with the threshold pinned.
    ``untrimmed`` adds each offload with ``trim_host_heap=False`` (not checked).
    """
    import bench

    systems = OFFLOAD_SYSTEMS + (UNTRIMMED_SYSTEMS if untrimmed else ())

    print(f"world {world}, the benchmark GPT at {layers} layers, fp32 AdamW, batch 4 x "
          f"seq 256 per rank; {repeats} runs of 6 steps per system and allocator setting; "
          "MiB per rank (the largest rank)")  # fmt: skip
    args = argparse.Namespace(threads=1, layers=layers, steps=4, warmup=2,
                              profile=False, timeout=timeout, lora=0)  # fmt: skip
    ok = True
    print("\n| allocator | system | peak RSS growth per run | median | held | moved out "
          "of memory | target (median) | met |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for malloc in mallocs:
        saved = {k: os.environ.pop(k, None) for k in PINNED}
        if malloc == "pinned":
            os.environ.update(PINNED)
        try:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
            for _ in range(repeats):
                for system in systems:
                    runs[system].append(bench.launch(system, world, args))
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None)
                if value is not None:
                    os.environ[key] = value
        growth = {
            s: [max(p - b for p, b in zip(r["rss"], r["baseline"], strict=True)) for r in rs]
            for s, rs in runs.items()
        }
        held = {s: statistics.median(r["held"] for r in rs) for s, rs in runs.items()}
        base = statistics.median(growth["zero3"])
        for system in systems:
            median = statistics.median(growth[system])
            moved = held["zero3"] - held[system]
            target = base - 0.8 * moved
            met = "-" if system == "zero3" else ("yes" if median <= target else "**no**")
            if malloc == "pinned" and system in OFFLOAD_SYSTEMS[1:]:
                ok &= median <= target
            each = ", ".join(f"{g / MiB:.0f}" for g in growth[system])
            goal = "-" if system == "zero3" else f"{target / MiB:.0f}"
            print(f"| {malloc} | {system} | {each} | {median / MiB:.0f} | "
                  f"{held[system] / MiB:.0f} | {moved / MiB:.0f} | {goal} | {met} |",
                  flush=True)  # fmt: skip
    print("\nheld: zero3.hooks.memory_stats(model, optimizer).held_bytes after the backward "
          "(most of any step); moved out: in-memory zero3's held minus the row's; target: "
          "in-memory zero3's median peak minus 80% of what the row moves out")  # fmt: skip
    return ok


#: The checkpoint operations `checkpoint` measures (save runs first: the others read it).
PHASES = ("save", "async", "load", "load-fresh", "consolidate")


def checkpoint(
    mib: int, layers: int, world: int, phases: list[str], timeout: float, offload: str = ""
) -> bool:
    """Peak RSS growth of each checkpoint operation, per rank, against the rank's state
    (``offload``: with every shard and the optimizer state in swap files under it).
    """
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="zero3-memory-checkpoint-")
    rows = []
    try:
        spec = {"dir": str(Path(root) / "ckpt"), "mib": mib, "layers": layers, "offload": offload}
        for phase in ["save", *(p for p in phases if p != "save")]:
            kind, n = ("consolidate", 1) if phase == "consolidate" else ("checkpoint", world)
            rows += [
                {"phase": phase, **r} for r in launch(kind, n, {**spec, "phase": phase}, timeout)
            ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    largest, state = mib / layers, 3 * mib / world  # this rank's weights + Adam's two moments
    print(f"model {mib} MiB fp32 in {layers} tensors of {largest:.1f} MiB, {world} ranks: "
          f"each rank saves {state:.0f} MiB (its weight shards and two Adam moments)")  # fmt: skip
    if offload:
        print(f"offloaded (offload_param and offload_optimizer nvme under {offload}): the "
              f"shards, their separate fp32 masters and the moments, {4 * mib / world:.0f} "
              "MiB per rank, are in swap files before each operation")  # fmt: skip
    print()
    print("| operation | rank | growth (MiB) | / rank's state | / largest tensor | s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "crash" in row:
            print(f"| {row['phase']} | {row['rank']} | FAILED: {row['crash']} | | | |")
            continue
        grown = row["growth"] / MiB
        note = f" (returned after {row['returned']:.2f} s)" if row.get("returned") else ""
        print(f"| {row['phase']} | {row['rank']} | {grown:.1f} | {grown / state:.2f} "
              f"| {grown / largest:.2f} | {row['seconds']:.2f}{note} |")  # fmt: skip
    return not any("crash" in row for row in rows)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "what",
        nargs="?",
        choices=["build", "load", "table", "cap", "largest", "offload", "checkpoint"],
        default="build",
    )
    p.add_argument(
        "--worlds", default=None, help="comma-separated world sizes (`checkpoint`: the first)"
    )
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/zero3-memory/gpt-2048x8"),
                   help="where `load` writes (once) and reads its checkpoint")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="training steps for `table`")
    p.add_argument(
        "--systems", default="ddp,zero3,zero3-ds-window", help="tools/bench.py systems for `table`"
    )
    p.add_argument("--cap-layers", type=int, default=16, help="model layers for `cap`")
    p.add_argument(
        "--cap-mib", type=int, default=800, help="RLIMIT_DATA allowance for `cap` / `largest`"
    )
    p.add_argument(
        "--largest-layers", default="2,4,8,12,16,24,32,48",
        help="layer counts `largest` tries, in order",
    )  # fmt: skip
    p.add_argument(
        "--largest-systems", default="ddp,fsdp2,zero3,zero3-offload-nvme,zero3-offload-both",
        help="tools/bench.py systems for `largest`",
    )  # fmt: skip
    p.add_argument(
        "--malloc", choices=["pinned", "glibc"], default="pinned",
        help="glibc's mmap threshold for `build`/`load` ranks: pinned at 128 KiB (bounds "
        "checked so, the zero3 path also shown with glibc's default) or glibc's default",
    )  # fmt: skip
    p.add_argument(
        "--ckpt-mib", type=int, default=256, help="model size (fp32 MiB) for `checkpoint`"
    )
    p.add_argument("--ckpt-layers", type=int, default=16, help="equal layers for `checkpoint`")
    p.add_argument(
        "--ckpt-phases",
        default=",".join(PHASES),
        help="comma-separated operations for `checkpoint`",
    )
    p.add_argument(
        "--offload-param", default="", metavar="DIR",
        help="`build`/`load`: also build with the parameter shards streamed into swap files "
        "under DIR (offload_param nvme, max_in_cpu 0), checked against its own bound; "
        "`checkpoint`: run it with the shards and the optimizer state offloaded under DIR",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=8, help="model layers for `offload`")
    p.add_argument("--repeats", type=int, default=3, help="runs per system for `offload`")
    p.add_argument(
        "--mallocs", default="pinned,glibc",
        help="allocator settings `offload` runs: pinned (threshold at 128 KiB), glibc",
    )  # fmt: skip
    p.add_argument(
        "--untrimmed", action="store_true",
        help="`offload`: also each offload with trim_host_heap=False (the heap kept)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args.worker, json.loads(args.spec))
    worlds = [int(x) for x in args.worlds.split(",")] if args.worlds else None
    pinned = args.malloc == "pinned"
    if args.what == "build":
        ok = bounds(SMALL, worlds or [2], "", args.timeout, pinned, args.offload_param)
    elif args.what == "load":
        write_checkpoint(BIG, args.checkpoint)
        source = str(args.checkpoint)
        ok = bounds(BIG, worlds or [2, 4], source, args.timeout, pinned, args.offload_param)
    elif args.what == "table":
        systems = args.systems.split(",")
        ok = table(worlds or [1, 2, 4], systems, args.steps, args.timeout)
    elif args.what == "cap":
        ok = cap(args.cap_layers, args.cap_mib * MiB, args.timeout)
    elif args.what == "largest":
        layers = [int(x) for x in args.largest_layers.split(",")]
        systems = args.largest_systems.split(",")
        ok = largest(args.cap_mib * MiB, (worlds or [2])[0], layers, systems, args.timeout)
    elif args.what == "offload":
        mallocs = args.mallocs.split(",")
        unknown = sorted(set(mallocs) - {"pinned", "glibc"})
        if unknown:
            p.error(f"--mallocs: unknown {unknown}; choose from pinned, glibc")
        world = (worlds or [2])[0]
        ok = offload(world, args.layers, args.repeats, mallocs, args.timeout, args.untrimmed)
    else:
        phases = args.ckpt_phases.split(",")
        unknown = sorted(set(phases) - set(PHASES))
        if unknown:
            p.error(f"--ckpt-phases: unknown {unknown}; choose from {list(PHASES)}")
        world = (worlds or [2])[0]
        ok = checkpoint(
            args.ckpt_mib, args.ckpt_layers, world, phases, args.timeout, args.offload_param
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
