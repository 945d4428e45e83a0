"""Training on the zdev simulated device at world 2 and 4 against one process on zdev.

Rank ``r`` trains on ``zdev:r`` through ``Zero3Config(backend="zdev")``, with
``overlap_comm`` on, small overlap chunks (several gathers and reductions per step, some
in flight at once) and the race detector on; beside it, in the same process, a
one-process reference on the same device takes the whole global batch every step. Every
reduce path, accumulation, leaf modules, activation checkpointing and mixed precision are
covered; each case also asserts that the engine really gathered and reduced (a model
that stayed whole would match the reference trivially).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero3.core import Zero3Config
from zero3.core.engine import sharded_state
from zero3.hooks import full_state_dict, shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import MoEBlock, build, loss_of

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(300)]

LOCAL = 2
STEPS = 3
LR = 1e-2
#: Small overlap chunks: several buckets and gathers per step, several in flight at once.
CHUNK = 2000


def _device() -> torch.device:
    return torch.device("zdev", int(os.environ["LOCAL_RANK"]))


def _config(**config: Any) -> Zero3Config:
    base = {
        "backend": "zdev",
        "param_persistence_threshold": 0,
        "overlap_comm": True,
        "overlap_chunk_size": CHUNK,
    }
    return Zero3Config(**{**base, **config})


def _off(sharded: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    """Share of elements off by more than 1e-4 + 1e-3*|value| (as test_optim_multirank)."""
    off = total = 0
    for key, value in reference.state_dict().items():
        diff = (sharded[key].float() - value.float().cpu()).abs()
        off += int((diff > 1e-4 + 1e-3 * value.float().cpu().abs()).sum())
        total += value.numel()
    return off / total


def _parity(name: str, micro: int = 1, **config: Any) -> dict[str, Any]:
    """Train ``STEPS`` steps of ``micro`` micro-steps beside a one-process reference."""
    dev = _device()
    model, make = build(name)
    model.to(dev)
    reference = copy.deepcopy(model)
    leaf = (MoEBlock,) if name == "moe" else ()
    shard_module(model, _config(leaf_modules=leaf, **config))
    backend = type(sharded_state(model).comm).__name__
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=LR)
    ropt = torch.optim.AdamW(reference.parameters(), lr=LR)
    n, r = dist.get_world_size(), dist.get_rank()
    diffs, late, reductions, gathers = [], 0, 0, 0
    for step in range(STEPS):
        for m in range(micro):
            x = make(LOCAL * n, step * micro + m).to(dev)
            mine = loss_of(model(x[r * LOCAL : (r + 1) * LOCAL])) / micro
            mine.backward()
            s = stats(model)
            late, reductions = late + s.late_reductions, reductions + s.reduce_collectives
            gathers += s.gathers
            ref = loss_of(reference(x)) / micro
            ref.backward()
            mean = torch.tensor([float(mine)])
            dist.all_reduce(mean)
            diffs.append(abs(float(mean) / n - float(ref)))
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    return {
        "backend": backend,
        "device": str(next(iter(sharded_state(model).params)).shard.device),
        "max_loss_diff": max(diffs),
        "off": _off(full_state_dict(model), reference),
        "gathers": gathers,
        "reductions": reductions,
        "late": late,
    }


PATHS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "reduce-scatter": ("gpt_tied", 1, {}),
    "all-reduce": ("gpt_tied", 1, {"grad_reduce_op": "all_reduce"}),
    "discrete": ("gpt_tied", 1, {"contiguous_gradients": False}),
    "late-reentrant-checkpointing": ("checkpoint_reentrant", 1, {}),
    "activation-checkpointing": ("checkpoint_non_reentrant", 1, {}),
    "accumulation": ("gpt_tied", 2, {}),
    "leaf-modules": ("moe", 1, {}),
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("path", list(PATHS))
def test_training_on_zdev_matches_one_process(zdev_pool, path, world_size):
    name, micro, config = PATHS[path]
    results = zdev_pool(world_size).run(_parity, name, micro, timeout=240, **config)
    for rank, result in enumerate(results):
        assert result["backend"] == "ZdevBackend" and result["device"] == f"zdev:{rank}", result
        assert result["gathers"] > 0 and result["reductions"] > STEPS * micro, result
        assert result["max_loss_diff"] < 1e-5, result
        assert result["off"] <= 0.005, result
        if path.startswith("late"):
            assert result["late"] > 0, result  # the late-gradient reduction really ran


# -- mixed precision -----------------------------------------------------------------------------

SCALE_POWER = 8


class _MixedReference:
    """One process doing the engine's arithmetic: a low-precision model, per-slice
    gradients averaged in the parameter dtype, fp16 unscaled in it, fp32 masters."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model = copy.deepcopy(model).to(dtype)
        self.masters = [p.detach().float().clone() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=LR)
        self.scale = 2.0**SCALE_POWER if dtype == torch.float16 else 1.0

    def step(self, x: torch.Tensor, n: int) -> list[float]:
        losses, total = [], None
        for q in range(n):
            loss = loss_of(self.model(x[q * LOCAL : (q + 1) * LOCAL]))
            (loss * self.scale).backward()
            grads = [p.grad.clone() for p in self.model.parameters()]
            total = (
                grads if total is None else [t.add_(g) for t, g in zip(total, grads, strict=True)]
            )
            self.model.zero_grad()
            losses.append(float(loss))
        assert total is not None
        for master, grad in zip(self.masters, total, strict=True):
            grad = grad.div_(n)
            if self.scale != 1.0:
                grad = grad.mul_(1.0 / self.scale)
            master.grad = grad.float()
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(self.model.parameters(), self.masters, strict=True):
                p.copy_(master)
        return losses


def _mixed(dtype_name: str) -> dict[str, Any]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    dev = _device()
    model, make = build("gpt_tied")
    model.to(dev)
    reference = _MixedReference(model, dtype)
    config = _config(param_dtype=dtype, initial_scale_power=SCALE_POWER, hysteresis=1)
    shard_module(model, config)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=LR)
    n, r = dist.get_world_size(), dist.get_rank()
    loss_rel = 0.0
    for step in range(STEPS):
        x = make(LOCAL * n, step).to(dev)
        loss = loss_of(model(x[r * LOCAL : (r + 1) * LOCAL]))
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        ref_losses = reference.step(x, n)
        loss_rel = max(loss_rel, abs(float(loss) - ref_losses[r]) / abs(ref_losses[r]))
    full = full_state_dict(model)
    worst = max(
        float((full[k].float() - v.float().cpu()).abs().max())
        for k, v in reference.model.state_dict().items()
    )
    return {
        "loss_rel": loss_rel,
        "max_abs": worst,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "masters": sorted({str(t.dtype) for g in opt.param_groups for t in g["params"]}),
        "skipped": opt.scaler.skipped_steps,
        "scale": opt.loss_scale,
        "reductions": stats(model).reduce_collectives,
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_low_precision_params_with_fp32_masters_on_zdev(zdev_pool, dtype_name, world_size):
    results = zdev_pool(world_size).run(_mixed, dtype_name, timeout=240)
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype_name]
    for result in results:
        assert result["dtypes"] == [dtype] and result["masters"] == ["torch.float32"], result
        assert result["skipped"] == 0 and result["reductions"] > STEPS, result
        if dtype_name == "fp16":
            assert result["scale"] == 2.0**SCALE_POWER, result  # loss scaling was on
        if world_size == 2:  # two addends commute: the same bits as the reference
            assert result["loss_rel"] == 0.0 and result["max_abs"] == 0.0, result
        else:  # four: the reduction's order differs (test_mixed_precision's bounds)
            assert result["loss_rel"] < 5e-2 and result["max_abs"] <= 2 * LR * STEPS, result


# -- device memory ------------------------------------------------------------------------------


def _device_memory() -> dict[str, int]:
    from zero3.testing.models import TinyGPT, token_batch

    dev = _device()
    zdev = torch.get_device_module("zdev")
    base = zdev.memory_allocated(dev)
    model = TinyGPT(dim=64, layers=4).to(dev)
    whole = zdev.memory_allocated(dev) - base
    shard_module(model, _config())
    sharded = zdev.memory_allocated(dev) - base
    loss_of(model(token_batch(61, 16)(LOCAL, 0).to(dev))).backward()
    return {"whole": whole, "sharded": sharded, "after_backward": zdev.memory_allocated(dev) - base}


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_holds_one_nth_of_the_model_in_device_memory(zdev_pool, world_size):
    """Released parameters really give their device memory back (storages emptied)."""
    for result in zdev_pool(world_size).run(_device_memory, timeout=240):
        share = result["whole"] // world_size
        assert share <= result["sharded"] <= share + 1024, result  # padding at most
        # parameter shards and gradient shards; every gathered parameter released again
        assert result["after_backward"] <= 2 * share + 64 * 1024, result
