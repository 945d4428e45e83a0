"""Sharded training with PartitionedOptimizer equals one-process training."""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
from torch import nn

from zero3.comm import CommError, GlooBackend
from zero3.core import FingerprintMismatchError, Zero3Config
from zero3.core.engine import sharded_state
from zero3.hooks import full_state_dict, shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing import RankExited
from zero3.testing.models import Routed, build, loss_of, routed_input, train_beside

pytestmark = pytest.mark.multirank

LOCAL = 2
STEPS = 5


def _load_lion() -> type[torch.optim.Optimizer]:
    """The docs' third-party optimizer (examples/lion.py), shipped to workers by value."""
    path = Path(__file__).resolve().parents[1] / "examples" / "lion.py"
    spec = importlib.util.spec_from_file_location("zero3_docs_lion", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # cloudpickle ships registered modules by value
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module.Lion  # type: ignore[no-any-return]


Lion = _load_lion()


def _groups(model: nn.Module, kind: str) -> Any:
    if kind == "all":
        return None
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "lion": (Lion, {"lr": 1e-3, "weight_decay": 0.1}),
}


def _close_params(sharded: dict[str, torch.Tensor], reference: nn.Module) -> float:
    """Share of elements off by more than 1e-4 + 1e-3*|value|."""
    off = total = 0
    for key, value in reference.state_dict().items():
        diff = (sharded[key].float() - value.float()).abs()
        off += int((diff > 1e-4 + 1e-3 * value.float().abs()).sum())
        total += value.numel()
    return off / total


def _train(
    name: str = "gpt_tied",
    optimizer: str = "adamw",
    groups: str = "all",
    accumulate: int = 1,
    clip: float | None = None,
    scheduler: bool = False,
    steps: int = STEPS,
    **config: Any,
) -> dict[str, Any]:
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build(name)
    reference = copy.deepcopy(model)
    untouched = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("unused")}
    config.setdefault("param_persistence_threshold", 0)
    shard_module(model, Zero3Config(gradient_clipping=clip, **config), comm=comm)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = PartitionedOptimizer(model, cls, _groups(model, groups), **kwargs)
    ref_groups = _groups(reference, groups)
    ropt = cls(
        ref_groups if ref_groups else [p for p in reference.parameters() if p.requires_grad],
        **kwargs,
    )
    scheds = []
    if scheduler:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ropt)]
    diffs, norms = [], []
    for step in range(steps):
        total = torch.zeros(())
        ref_total = 0.0
        for micro in range(accumulate):
            x = make(LOCAL * n, step * 10 + micro)
            loss = loss_of(model(x[r * LOCAL : (r + 1) * LOCAL])) / accumulate
            loss.backward()
            total += loss.detach()
            ref_loss = loss_of(reference(x)) / accumulate
            ref_loss.backward()
            ref_total += float(ref_loss)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.zero_grad()
        for s in scheds:
            s.step()
        comm.all_reduce(total).wait()
        diffs.append(abs(float(total) / n - ref_total))
    full = full_state_dict(model)
    return {
        "max_loss_diff": max(diffs),
        "off": _close_params(full, reference),
        "untouched": all(torch.equal(full[k], v) for k, v in untouched.items())
        if untouched
        else None,
        "lr": opt.param_groups[0]["lr"],
        "ref_lr": ropt.param_groups[0]["lr"],
        "gathers": stats(model).gathers,
        "reductions": stats(model).reduce_collectives,
        "norm": opt.last_grad_norm,
        "ref_norms": norms,
    }


def _train_losses(name: str, optimizer: str, steps: int = STEPS, **config: Any) -> dict[str, Any]:
    """Loss per step of sharded vs one-process training (both measured before the step)."""
    comm = GlooBackend(timeout_s=30)
    model, make = build(name)
    reference = copy.deepcopy(model)
    config.setdefault("param_persistence_threshold", 0)
    shard_module(model, Zero3Config(**config), comm=comm)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = PartitionedOptimizer(model, cls, **kwargs)
    ropt = cls([p for p in reference.parameters() if p.requires_grad], **kwargs)
    diffs = train_beside(model, opt, reference, ropt, make, comm, steps, LOCAL)
    return {"max_loss_diff": max(diffs), "off": _close_params(full_state_dict(model), reference)}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizers_match_one_process(worker_pool, optimizer, world_size):
    for result in worker_pool(world_size).run(_train_losses, "gpt_tied", optimizer):
        assert result["max_loss_diff"] < 1e-5, result
        assert result["off"] <= 0.005, result


CASES = {
    "two-groups": {"groups": "decay"},
    "scheduler": {"scheduler": True},
    "clipping": {"clip": 0.05},
    "accumulation": {"accumulate": 3},
    "unused-with-decay": {"name": "frozen_and_unused"},
    "default-persistence": {"param_persistence_threshold": 100_000},
    "sub-groups": {"sub_group_size": 700},
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_training_features_match_one_process(worker_pool, case, world_size):
    kwargs = dict(CASES[case])
    results = worker_pool(world_size).run(_train, **kwargs)
    for result in results:
        assert result["max_loss_diff"] < 1e-5, result
        assert result["off"] <= 0.005, result
        assert result["reductions"] > 0
        if case != "default-persistence":
            assert result["gathers"] > 0
    if case == "scheduler":
        assert results[0]["lr"] == results[0]["ref_lr"] == pytest.approx(1e-2 * 0.25)
    if case == "clipping":
        assert results[0]["norm"] == pytest.approx(results[0]["ref_norms"][-1], rel=1e-4)
    if case == "unused-with-decay":
        assert results[0]["untouched"] is True  # gradless: AdamW's decay must skip it


def _flat_mode() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=30)
    model, make = build("gpt_tied")
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, flat=True, lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    n, r = comm.world_size, comm.rank
    for step in range(STEPS):
        x = make(LOCAL * n, step)
        loss_of(model(x[r * LOCAL : (r + 1) * LOCAL])).backward()
        opt.step()
        opt.zero_grad()
        loss_of(reference(x)).backward()
        ropt.step()
        ropt.zero_grad()
    return {
        "off": _close_params(full_state_dict(model), reference),
        "tensors": len(opt.param_groups[0]["params"]),
    }


def test_flat_mode_hands_one_tensor_per_sub_group(worker_pool):
    for result in worker_pool(2).run(_flat_mode):
        assert result["tensors"] == 1
        assert result["off"] <= 0.005


def _mixed_precision(dtype_name: str, force_overflow: bool) -> dict[str, Any]:
    """bf16/fp16 parameters with fp32 masters, against the same recipe in one process.

    The one-process recipe: the model in low precision runs forward/backward on the
    full batch; fp32 master copies take the gradients (cast up) and step; results are
    cast back. fp16 multiplies the loss by the scale and divides the gradients back.
    """
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model, make = build("gpt_tied")
    reference = copy.deepcopy(model).to(dtype)
    masters = [p.detach().float().clone() for p in reference.parameters()]
    config = Zero3Config(
        param_persistence_threshold=0, param_dtype=dtype, initial_scale_power=8, hysteresis=1
    )
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ropt = torch.optim.AdamW(masters, lr=1e-2)
    scale = 2.0**8 if dtype_name == "fp16" else 1.0
    diffs, skipped = [], []
    for step in range(STEPS):
        x = make(LOCAL * n, step)
        loss = loss_of(model(x[r * LOCAL : (r + 1) * LOCAL]))
        overflow_now = force_overflow and step == 2
        if overflow_now and r == n - 1:
            loss = loss * float("inf")  # only the last rank overflows
        opt.scale_loss(loss).backward()
        before = opt.loss_scale
        opt.step()
        opt.zero_grad()
        skipped.append(opt.loss_scale < before)
        ref_loss = loss_of(reference(x))
        (ref_loss * scale).backward()
        if not overflow_now:
            for m, p in zip(masters, reference.parameters(), strict=True):
                m.grad = p.grad.float() / scale
            ropt.step()
            with torch.no_grad():
                for m, p in zip(masters, reference.parameters(), strict=True):
                    p.copy_(m)
        else:
            scale /= 2  # the reference applies the same skip-and-halve
        reference.zero_grad()
        mean = loss.detach().float().clone()
        comm.all_reduce(mean).wait()
        if not overflow_now:
            diffs.append(abs(float(mean) / n - float(ref_loss)) / float(ref_loss))
    full = full_state_dict(model)
    num = den = 0.0
    off = total = 0
    for k, v in reference.state_dict().items():
        d = full[k].float() - v.float()
        num += float(d.pow(2).sum())
        den += float(v.float().pow(2).sum())
        off += int((d.abs() > 2e-2 + 1e-2 * v.float().abs()).sum())
        total += v.numel()
    return {
        "loss_rel": max(diffs),
        "param_rel": (num / den) ** 0.5,
        "off": off / total,
        "skipped": skipped,
        "scale": opt.loss_scale,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_params_with_fp32_masters(worker_pool, world_size):
    # Tolerance: the forward runs in bf16 (8 mantissa bits, ~0.4% per rounding) and the
    # gradient is averaged over ranks in bf16 where one process averages in one
    # reduction, so losses agree to bf16 precision (1e-2 relative), not to fp32's 1e-5;
    # parameters agree in norm to 2e-2, and AdamW turns rounding noise on near-zero
    # gradients into lr-sized steps, so at most 1% of elements may differ by more than
    # 2e-2 + 1e-2*|value| (two lr-sized steps).
    for result in worker_pool(world_size).run(_mixed_precision, "bf16", False):
        assert result["loss_rel"] < 1e-2, result
        assert result["param_rel"] < 2e-2, result
        assert result["off"] < 0.01, result


def test_fp16_loss_scaling_with_a_forced_overflow(worker_pool):
    for result in worker_pool(2).run(_mixed_precision, "fp16", True):
        assert result["skipped"] == [False, False, True, False, False], result
        assert result["scale"] == 2.0**7  # halved once (hysteresis 1)
        assert result["loss_rel"] < 1e-2, result
        assert result["param_rel"] < 2e-2, result
        assert result["off"] < 0.01, result


def _hf_training(name: str) -> dict[str, Any]:
    from zero3.testing.hf_models import build_hf, leaf_classes, tokens

    comm = GlooBackend(timeout_s=60)
    n, r = comm.world_size, comm.rank
    model = build_hf(name)
    reference = copy.deepcopy(model)
    shard_module(
        model,
        Zero3Config(param_persistence_threshold=0, leaf_modules=leaf_classes(name)),
        comm=comm,
    )
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    diffs = []
    for step in range(4):
        ids = tokens(2 * n, step)
        loss = model(input_ids=ids[2 * r : 2 * r + 2], labels=ids[2 * r : 2 * r + 2]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = (
            sum(
                reference(input_ids=ids[2 * q : 2 * q + 2], labels=ids[2 * q : 2 * q + 2]).loss
                for q in range(n)
            )
            / n
        )
        ref.backward()
        ropt.step()
        ropt.zero_grad()
        mean = loss.detach().clone()
        comm.all_reduce(mean).wait()
        diffs.append(abs(float(mean) / n - float(ref)))
    return {"loss": max(diffs), "off": _close_params(full_state_dict(model), reference)}


@pytest.mark.transformers
@pytest.mark.parametrize("name", ["llama", "gpt2", "albert", "mixtral"])
def test_transformers_models_train_like_one_process(worker_pool, name):
    for result in worker_pool(2).run(_hf_training, name, timeout=300):
        assert result["loss"] < 1e-5, result
        assert result["off"] <= 0.005, result


def _rank_dies() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=8)
    model, make = build("gpt_tied")
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=8), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    start = time.monotonic()
    try:
        for step in range(20):
            if step == 2 and comm.rank == 1:
                os._exit(7)
            loss_of(model(make(2, step))).backward()
            opt.step()
            opt.zero_grad()
    except CommError as exc:
        return {"error": str(exc).splitlines()[0], "elapsed": time.monotonic() - start}
    return {"error": None}


def test_a_dying_rank_stops_the_others_within_the_timeout(worker_pool):
    results = worker_pool(2).run(_rank_dies, allow_rank_exit=True, timeout=90)
    assert isinstance(results[1], RankExited)
    assert results[0]["error"] is not None, results
    assert results[0]["elapsed"] < 30


def _diverging_without_leaf() -> str:
    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)
    model = Routed()
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    with pytest.raises(FingerprintMismatchError) as info:
        for _ in range(3):
            loss_of(model(routed_input(comm.rank))).backward()
            opt.step()
            opt.zero_grad()
    return str(info.value)


def test_divergent_modules_without_leaf_fail_with_the_fingerprint_error(worker_pool):
    for message in worker_pool(2).run(_diverging_without_leaf):
        assert "rank 0: gathered a module's parameters for module 'moe.experts.0." in message
        assert "rank 1: gathered a module's parameters for module 'moe.experts.1." in message


def _live_storage_bytes(exclude: frozenset[int] = frozenset()) -> int:
    import warnings

    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.distributed.reduce_op
        objects = gc.get_objects()
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() in exclude:
                continue
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _memory() -> dict[str, Any]:
    from zero3.testing.models import TinyGPT

    comm = GlooBackend(timeout_s=30)
    gc.collect()
    baseline = _live_storage_bytes()  # whatever this worker process already holds
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=64, heads=4, layers=4, seq=16)
    psi = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 512, (2, 16))
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    loss_of(model(x)).backward()
    opt.step()  # Adam state exists from here on
    loss_of(model(x)).backward()  # gradient shards of a fresh window
    del x
    gc.collect()
    # Communication buffers cached for reuse (BufferPool) are not model state; they are
    # bounded by the model's gathered size and counted apart.
    pool = sharded_state(model).pool
    return {
        "live": _live_storage_bytes(frozenset(pool.cached_data_ptrs())) - baseline,
        "psi": psi,
        "pool": pool.cached_bytes,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_holds_a_1_over_n_share_of_model_state(worker_pool, world_size):
    for result in worker_pool(world_size).run(_memory):
        # Per rank: fp32 master (which is the fp32 parameter's shard) + Adam's two
        # moments + fp32 gradient shard = 4 * 4 * psi / N bytes; unsharded: 16 * psi.
        share = 4 * 4 * result["psi"] / world_size
        assert result["live"] < 1.25 * share + 200_000, result
        assert result["live"] > 0.9 * share, result
        # The pool keeps at most what a step used at once: the gathered parameters and
        # their gather buffers (receive + send).
        assert result["pool"] <= 4 * result["psi"] * (2 + 1 / world_size) + (1 << 20)


def _state_dict_round_trip() -> bool:
    from zero3.hooks import load_full_state_dict

    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank

    def run(model, opt, make, steps, seed):
        for step in range(steps):
            x = make(LOCAL * n, seed * 100 + step)
            loss_of(model(x[r * LOCAL : (r + 1) * LOCAL])).backward()
            opt.step()
            opt.zero_grad()

    model, make = build("gpt_tied")
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    run(model, opt, make, 3, 0)
    saved, weights = copy.deepcopy(opt.state_dict()), full_state_dict(model)
    run(model, opt, make, 2, 1)
    expected = full_state_dict(model)
    fresh, _ = build("gpt_tied", seed=5)  # different init: everything comes from the files
    shard_module(fresh, Zero3Config(param_persistence_threshold=0), comm=comm)
    load_full_state_dict(fresh, weights)
    fresh_opt = PartitionedOptimizer(fresh, torch.optim.AdamW, lr=1e-2)
    fresh_opt.load_state_dict(saved)
    run(fresh, fresh_opt, make, 2, 1)
    got = full_state_dict(fresh)
    return all(torch.equal(got[k], v) for k, v in expected.items())


@pytest.mark.parametrize("world_size", [2, 4])
def test_optimizer_state_dict_round_trip_per_rank(worker_pool, world_size):
    assert worker_pool(world_size).run(_state_dict_round_trip) == [True] * world_size
