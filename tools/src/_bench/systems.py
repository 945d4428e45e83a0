"""One benchmark run of one system, executed by every rank of a fresh process group."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (any optimizer imports it,
# through torch._dynamo), its default arguments keep the default group alive past
# destroy_process_group(), and the group's gloo threads can then abort the finished rank
# at interpreter exit (zero3.comm._teardown explains the abort).
import torch.distributed.nn
from _train.report import peak_rss_bytes, rss_baseline

from _bench import phases
from _bench.disk import swap_dir
from _bench.workload import Workload, batch, build, with_lora

StepFn = Callable[[int], float]


def _adamw(params: Any, w: Workload) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=w.lr)


def _loop_step(
    model: Any,
    opt: Any,
    w: Workload,
    rank: int,
    world: int,
    after_backward: Callable[[], None] | None = None,
) -> StepFn:
    """One plain training step (forward, backward, optimizer step, zero_grad)."""

    def step(i: int) -> float:
        x, y = batch(w, i, rank, world)
        loss = model(x, y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


def _theory(numel: int, world: int, psis: float, sharded: float) -> dict[str, Any]:
    """Result fields of a system moving ``psis`` x Psi (N-1)/N fp32 bytes per step."""
    payload = psis * 4 * numel * (world - 1) / world
    return {"sharded": sharded, "payload": payload, "payload_kind": "theory"}


def _numel(params: Any) -> int:
    return sum(p.numel() for p in params)


def _trainable(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _plain(w: Workload, rank: int, world: int) -> tuple[StepFn, dict[str, Any]]:
    """One process, no distribution (the reference, or the world-1 baseline)."""
    model = with_lora(build(w), w)
    opt = _adamw(_trainable(model), w)
    return _loop_step(model, opt, w, rank, world), {"sharded": 0.0}


def _ddp(w: Workload, rank: int, world: int) -> tuple[StepFn, dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(with_lora(build(w), w))
    opt = _adamw(_trainable(model), w)
    # An all-reduce of the trainable gradients (2 x their bytes x (N-1)/N).
    payload = _theory(_numel(_trainable(model)), world, 2, sharded=0.0)
    return _loop_step(model, opt, w, rank, world), payload


def _fsdp2(w: Workload, rank: int, world: int) -> tuple[StepFn, dict[str, Any]]:
    from torch.distributed.fsdp import fully_shard

    model = with_lora(build(w), w)
    for block in model.get_base_model().blocks if w.lora else model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = _adamw(_trainable(model), w)
    # Root params reshard after forward too (reshard_after_forward=True): all-gather in
    # forward and backward, reduce-scatter of the trainable gradients in backward.
    psi, trainable = _numel(model.parameters()), _numel(_trainable(model))
    payload = _theory(psi, world, 2 + trainable / psi, sharded=1.0)
    return _loop_step(model, opt, w, rank, world), payload


def _zero3(
    w: Workload, rank: int, world: int, *, eager_build: bool = False, **config: Any
) -> tuple[StepFn, dict[str, Any]]:
    """zero3; the model is built under ``empty_init`` (never whole on a rank) unless
    ``eager_build``: then every rank builds it whole first, as before construct-time
    sharding. Both give the same weights (``reset_parameters`` in construction order)."""
    from zero3.core import Zero3Config
    from zero3.core.engine import sharded_state
    from zero3.hooks import empty_init, memory_stats, shard_module, stats
    from zero3.optim import PartitionedOptimizer

    if eager_build:
        model = build(w)
    else:
        with empty_init():
            model = build(w)
    shard_module(model, Zero3Config(backend="gloo", **config))
    model = with_lora(model, w)  # adapters on the sharded base (the big-model flow)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=w.lr)
    held: list[int] = []  # model state after each backward (gradients and optimizer state)
    walks: list[dict[str, float]] = []  # each offloaded step's walk (read after the next backward)
    state = sharded_state(model)
    headers: list[int] = []  # the guard's header exchanges so far, at each backward's end

    def after_backward() -> None:
        headers.append(state.guard.exchanges)
        held.append(memory_stats(model, opt).held_bytes)
        if opt.offload is not None and opt.offload.stats.step_s > 0:
            walks.append(dataclasses.asdict(opt.offload.stats))

    step = _loop_step(model, opt, w, rank, world, after_backward)

    psi = sum(sp.numel for sp in state.params)
    sharded = sum(sp.numel for sp in state.params if not sp.persistent) / psi

    def info() -> dict[str, Any]:
        s = stats(model)
        mem = memory_stats(model, opt)
        return {
            "sharded": sharded,
            "payload": (s.gather_payload_bytes + s.reduce_payload_bytes) * (world - 1) / world,
            "overhead": s.overhead_wire_bytes,
            "payload_kind": "measured",
            "gathers": s.gathers,
            "reductions": s.reduce_collectives,
            "hit_rate": s.prefetch_hit_rate,
            # From one backward's end to the next: a whole step (the optimizer's too).
            "headers": headers[-1] - headers[-2] if len(headers) > 1 else None,
            "held": max(held, default=mem.held_bytes),
            "unsharded": mem.unsharded_bytes,
            "peak_gathered": mem.peak_gathered_bytes,
            "pool": mem.peak_pool_bytes,
            "engine": mem.peak_engine_bytes,
            "window": mem.window.describe() if mem.window else "",
            **_offload_info(opt, walks),
            **_param_swap_info(state.param_swap),
        }

    def close() -> None:  # a worker leaving with os._exit runs no finalizer
        if opt.offload is not None:
            opt.offload.close()  # the swap files go now
        if state.param_swap is not None:
            state.param_swap.close()

    return step, {"info": info, "close": close}


def _offload_info(opt: Any, walks: list[dict[str, float]]) -> dict[str, Any]:
    """The offloaded steps' walk: medians over the steps, the last one included."""
    if opt.offload is None:
        return {}
    walks = [*walks, dataclasses.asdict(opt.offload.stats)]
    return {
        "offload": {key: statistics.median(w[key] for w in walks) for key in walks[0]},
        "offload_direct": opt.offload.direct_io if opt.offload.nvme else None,
    }


def _param_swap_info(swap: Any) -> dict[str, Any]:
    """Parameter offload's I/O over the run (cumulative counters) and what it holds."""
    if swap is None:
        return {}
    return {"param_swap": dataclasses.asdict(swap.stats) | {"file_bytes": swap.file_bytes}}


def _offload_nvme(
    w: Workload, rank: int, world: int, **config: Any
) -> tuple[StepFn, dict[str, Any]]:
    """zero3 with its optimizer state in swap files under ``swap_dir()``."""
    nvme = {"device": "nvme", "nvme_path": swap_dir()}
    return _zero3(w, rank, world, offload_optimizer=nvme, **config)


def _offload_both(
    w: Workload, rank: int, world: int, **config: Any
) -> tuple[StepFn, dict[str, Any]]:
    """:func:`_offload_nvme` with the parameter shards in a swap file too (none kept)."""
    shards = {"device": "nvme", "nvme_path": swap_dir(), "max_in_cpu": 0}
    return _offload_nvme(w, rank, world, offload_param=shards, **config)


def _deepspeed(w: Workload, rank: int, world: int) -> tuple[StepFn, dict[str, Any]]:
    import deepspeed

    model = build(w)
    config = {
        "train_micro_batch_size_per_gpu": w.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed >= 0.19 clips at 1.0 when the key is absent
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=_adamw(model.parameters(), w), config=config
    )

    def step(i: int) -> float:
        x, y = batch(w, i, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss)

    big = sum(p.ds_numel for p in model.parameters() if p.ds_numel > 100_000)
    total = sum(p.ds_numel for p in model.parameters())
    return step, _theory(total, world, 3, sharded=big / total)


SYSTEMS: dict[str, Callable[[Workload, int, int], tuple[StepFn, dict[str, Any]]]] = {
    "reference": _plain,
    "plain": _plain,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
    "zero3": _zero3,
    "zero3-release": lambda w, r, n: _zero3(w, r, n, max_reuse_distance=0),
    # DeepSpeed's absolute window values (zero3's defaults before the window was sized
    # from the model), for comparison: the whole model stays gathered forward to backward.
    "zero3-ds-window": lambda w, r, n: _zero3(
        w,
        r,
        n,
        prefetch_bucket_size=50_000_000,
        max_live_parameters=1_000_000_000,
        max_reuse_distance=1_000_000_000,
        overlap_chunk_size=4_194_304,
    ),
    # Optimizer offload: the sub-groups (2,097,152 elements each by default with offload)
    # stepped one at a time, their state in host memory or in swap files.
    "zero3-offload-cpu": lambda w, r, n: _zero3(w, r, n, offload_optimizer={"device": "cpu"}),
    "zero3-offload-nvme": _offload_nvme,
    # Both offloads (ZeRO-Infinity's layout): the parameter shards in a swap file too,
    # read ahead of each gather (max_in_cpu 0: none kept in memory).
    "zero3-offload-both": _offload_both,
    # The same two with the host heap kept at each step (trim_host_heap off;
    # nvme offload trims it by default): what glibc's kept heap costs the offloads.
    "zero3-offload-nvme-untrimmed": lambda w, r, n: _offload_nvme(w, r, n, trim_host_heap=False),
    "zero3-offload-both-untrimmed": lambda w, r, n: _offload_both(w, r, n, trim_host_heap=False),
    "zero3-keep-frozen": lambda w, r, n: _zero3(w, r, n, frozen_params="keep"),
    "zero3-replicate-frozen": lambda w, r, n: _zero3(w, r, n, frozen_params="replicate"),
    "zero3-eager-build": lambda w, r, n: _zero3(w, r, n, eager_build=True),
    "zero3-release-eager-build": lambda w, r, n: _zero3(
        w, r, n, eager_build=True, max_reuse_distance=0
    ),
    "deepspeed": _deepspeed,
}


def lookup(system: str) -> Callable[[Workload, int, int], tuple[StepFn, dict[str, Any]]]:
    """A system by name; ``zero3:key=value:key=value`` is zero3 with config overrides
    (numbers parsed as int or float, ``true``/``false`` as bools, anything else a string).
    """
    name, *overrides = system.split(":")
    if not overrides:
        return SYSTEMS[system]
    if name != "zero3":
        raise ValueError(f"config overrides are for zero3 only, not {name!r}")
    config: dict[str, Any] = {}
    for item in overrides:
        key, _, text = item.partition("=")
        value: Any = text
        if text.lower() in ("true", "false"):
            value = json.loads(text.lower())
        else:
            with contextlib.suppress(ValueError):  # else a string (frozen_params=keep)
                value = float(text)
        config[key] = int(value) if isinstance(value, float) and value.is_integer() else value
    return lambda w, r, n: _zero3(w, r, n, **config)


def _usage_between(before: Any, after: Any) -> dict[str, float]:
    """What one step cost the rank, from two ``getrusage`` readings.

    CPU of every thread of the rank (compute and the backend's) and page faults: on a
    shared 2-core VM these explain step times that wall clock alone cannot. The kernel's
    part of the CPU (socket copies of the collectives, page faults) and the times a thread
    gave up its core (a collective's wait, the backend thread's) say which work it was.
    """
    return {
        "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "kernel": after.ru_stime - before.ru_stime,
        "switches": after.ru_nvcsw - before.ru_nvcsw,
        "faults": after.ru_minflt - before.ru_minflt,
    }


def run(system: str, w: Workload, steps: int, profile_after: int | None = None) -> dict[str, Any]:
    """Run ``steps`` training steps of ``system`` on this rank; rank 0 returns the results.

    With ``profile_after``, the steps after that many run under cProfile and the result
    gets this rank's phase times (:mod:`_bench.phases`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if world > 1 or system.startswith("zero3"):
        if system == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    # The memory every system pays before its model exists (interpreter, torch, the
    # process group): peak RSS growth from here is the system's own.
    baseline = rss_baseline()
    step_fn, info = lookup(system)(w, rank, world)
    times, losses = [], []
    usage: dict[str, list[float]] = {}
    profiler = None
    for i in range(steps):
        if i == profile_after:
            profiler = phases.start()
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        loss = step_fn(i)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        for key, value in _usage_between(before, after).items():
            usage.setdefault(key, []).append(value)
        losses.append(loss)
    extra = info.pop("info")() if "info" in info else {}
    close = info.pop("close", None)
    if close is not None:
        close()
    extra.update(info)
    if profiler is not None:
        extra.update(phases.summarize(profiler, steps - (profile_after or 0)))
    del step_fn, info  # the engine (and its gradient group) goes before the default group
    gc.collect()
    result = {
        "times": times,
        "losses": losses,
        "usage": usage,
        "rss": peak_rss_bytes(),
        "baseline": baseline,
        **extra,
    }
    if dist.is_initialized():
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, result)
        dist.destroy_process_group()
    else:
        rows = [result]
    merged = dict(rows[0])
    merged["times"] = [max(r["times"][i] for r in rows) for i in range(steps)]  # slowest rank
    merged["losses"] = [sum(r["losses"][i] for r in rows) / world for i in range(steps)]
    merged["rss"] = [r["rss"] for r in rows]
    merged["baseline"] = [r["baseline"] for r in rows]
    merged["usage"] = {  # per rank: the mean of the ranks
        key: [sum(r["usage"][key][i] for r in rows) / world for i in range(steps)] for key in usage
    }
    return merged


def main(system: str, w: Workload, steps: int, profile_after: int | None = None) -> None:
    """Worker entry: print rank 0's result as one JSON line."""
    result = run(system, w, steps, profile_after)
    if int(os.environ.get("RANK", "0")) == 0:
        print("BENCH_RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    if system in ("fsdp2", "deepspeed"):
        # FSDP2 keeps a reference to the default group past destroy_process_group() (its
        # gloo threads were still alive at exit here), so a finished rank can still abort
        # at interpreter exit (zero3.comm._teardown explains how); DeepSpeed was not
        # checked. Leave without interpreter teardown. zero3, DDP and plain exit normally.
        os._exit(0)
