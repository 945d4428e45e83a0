"""Memory by default at world 2: the auto gather window bounds what is gathered, and the
estimate bounds what zero3's transient memory (counted by zero3, not RSS) really holds.

The model's layers are above the window's floor, so the auto window is a part of the
model; DeepSpeed's absolute values, given explicitly, keep the whole model gathered.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zero3.comm import GlooBackend
from zero3.core import Zero3Config, estimate_model_states
from zero3.core.engine import sharded_state
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer

pytestmark = pytest.mark.multirank

WIDTH, LAYERS, STEPS = 1100, 6, 2  # 1.21M elements per layer: one fetch unit above the floor
ABSOLUTE = dict(max_live_parameters=10**9, max_reuse_distance=10**9, prefetch_bucket_size=5 * 10**7)


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS))
    )


def _train(window: dict[str, int]) -> dict[str, object]:
    comm = GlooBackend(timeout_s=60)
    model = _stack()
    reference = copy.deepcopy(model)
    config = Zero3Config(param_persistence_threshold=0, **window)
    with torch.device("meta"):
        estimate = estimate_model_states(_stack(), comm.world_size, optimizer="sgd", config=config)
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    worst, gathers = 0.0, []
    for _ in range(STEPS):
        x = torch.randn(2 * comm.world_size, WIDTH, generator=g)
        mine = x[2 * comm.rank : 2 * comm.rank + 2]
        loss = model(mine).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(x).square().mean()  # the mean over every rank's rows
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        s = stats(model)
        gathers.append((s.forward_gathers, s.backward_gathers))
        total = torch.tensor([loss.item()])
        comm.all_reduce(total).wait()
        worst = max(worst, abs(total.item() / comm.world_size - ref_loss.item()))
    mem = stats(model).memory
    state = sharded_state(model)
    return {
        "loss_diff": worst,
        "gathers": gathers,
        "window": mem.window,
        "estimate_window": estimate.window,
        "peak_gathered": mem.peak_gathered_bytes,
        "peak_engine": mem.peak_engine_bytes,
        "peak_pool": mem.peak_pool_bytes,
        "peak_buckets": mem.peak_bucket_bytes,
        "breakdown": mem.breakdown(),
        "transient_estimate": estimate.transient_bytes,
        "pool_limit": state.pool.limit_bytes,
        "model_bytes": sum(p.numel() for p in reference.parameters()) * 4,
    }


def test_auto_window_bounds_gathers_and_the_estimate_bounds_transients(worker_pool):
    for r in worker_pool(2).run(_train, {}, timeout=240):
        assert r["loss_diff"] < 1e-5, r
        assert all(fwd > 0 and bwd > 0 for fwd, bwd in r["gathers"]), r  # gathers happened
        window = r["window"]
        assert window == r["estimate_window"], r
        assert window.auto == {"prefetch_numel", "live_numel", "reuse_numel", "chunk_numel"}
        # Gathered at most the window's bound, and that is a part of the model.
        assert 0 < r["peak_gathered"] <= window.bound_bytes < r["model_bytes"], r
        # The pool never cached past its bound; the engine's transient memory at once
        # stayed within the estimate, and the estimate is not vacuous (within 4x).
        assert r["peak_pool"] <= window.pool_bytes and r["pool_limit"] <= window.pool_bytes, r
        assert r["peak_buckets"] > 0, r
        assert r["peak_gathered"] < r["peak_engine"] <= r["transient_estimate"], r
        assert r["transient_estimate"] < 4 * r["peak_engine"], r


def test_deepspeeds_absolute_values_keep_the_whole_model_gathered(worker_pool):
    for r in worker_pool(2).run(_train, ABSOLUTE, timeout=240):
        assert r["loss_diff"] < 1e-5, r
        assert r["window"].auto == {"chunk_numel"}, r
        assert r["peak_gathered"] == r["model_bytes"], r  # explicit values win
        fwd, bwd = r["gathers"][-1]
        assert fwd > 0 and bwd == 0, r  # kept from forward through backward
