"""Adversarial scenarios: what users do to a sharded model, against plain PyTorch.

Each scenario either works as in one process (checked against a plain-PyTorch reference
on the same global batch) or fails with a clear error on every rank. docs/
troubleshooting.rst keeps the table "what you did -> what zero3 does"; extend both when
a new scenario turns up.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero3.comm import GlooBackend
from zero3.core import Zero3Config, gathered_parameters
from zero3.hooks import full_state_dict, load_full_state_dict, shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing import RankExited

pytestmark = pytest.mark.multirank

LOCAL = 2


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, world: int, dim: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + step)
    return torch.randn(LOCAL * world, dim, generator=g)


def _train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ropt: torch.optim.Optimizer,
    x: torch.Tensor,
    comm: GlooBackend,
) -> float:
    """One step on this rank's slice and on the reference's global batch; loss diff."""
    r = comm.rank
    loss = model(x[r * LOCAL : (r + 1) * LOCAL]).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    ref_loss = reference(x).float().pow(2).mean()
    ref_loss.backward()
    ropt.step()
    ropt.zero_grad()
    mean = loss.detach().clone()
    comm.all_reduce(mean).wait()
    return abs(float(mean) / comm.world_size - float(ref_loss))


def _max_param_diff(model: nn.Module, reference: nn.Module) -> float:
    full = full_state_dict(model)
    return max(
        float((full[k].float() - v.float()).abs().max()) for k, v in reference.state_dict().items()
    )


def _error_text(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # the tests read the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- 1: load_full_state_dict on some ranks only -----------------------------------------


def _load_on_rank0_only() -> str:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    full = {k: torch.ones_like(v) for k, v in model.state_dict().items()}
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)

    def run() -> None:
        if comm.rank == 0:  # the DDP habit
            load_full_state_dict(model, full)
        model(torch.randn(2, 6))

    return _error_text(run)


def test_load_full_state_dict_on_one_rank_fails_everywhere(worker_pool):
    for text in worker_pool(2).run(_load_on_rank0_only):
        assert "FingerprintMismatchError" in text, text
        assert "load_full_state_dict was called on some ranks only" in text, text


# -- 2: in-place edits of persistent parameters -------------------------------------------


def _edit_persistent(edit_on: str) -> dict[str, float]:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(timeout_s=20), comm=comm)  # all persistent (tiny)
    with torch.no_grad():  # re-initialise after sharding, before the optimizer exists
        for m in (reference, model):
            nn.init.constant_(m[0].bias, 0.5)
        if edit_on == "all" or comm.rank == 0:
            nn.init.normal_(model[2].weight, std=0.01, generator=torch.Generator().manual_seed(5))
        nn.init.normal_(reference[2].weight, std=0.01, generator=torch.Generator().manual_seed(5))
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    diffs = []
    for step in range(3):
        diffs.append(_train_step(model, opt, reference, ropt, _batch(step, comm.world_size), comm))
        with torch.no_grad():  # an edit between steps
            model[4].bias.add_(0.1)
            reference[4].bias.add_(0.1)
    return {"loss": max(diffs), "params": _max_param_diff(model, reference)}


@pytest.mark.parametrize("edit_on", ["all", "rank0"])
def test_edits_of_persistent_parameters_reach_the_masters(worker_pool, edit_on):
    for result in worker_pool(2).run(_edit_persistent, edit_on):
        assert result["loss"] < 1e-5, result
        assert result["params"] < 1e-5, result


# -- 3: gathered_parameters(modifier_rank) edits of a bf16 model --------------------------


def _modifier_edit_bf16() -> dict[str, bool]:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    config = Zero3Config(param_persistence_threshold=0, param_dtype="bf16", timeout_s=20)
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.0)
    with gathered_parameters(model[2].weight, modifier_rank=0), torch.no_grad():
        if comm.rank == 0:
            model[2].weight.fill_(0.25)
    model(torch.randn(2, 6).bfloat16()).float().sum().backward()
    opt.step()  # lr=0: the master must already hold the edit
    opt.zero_grad()
    weight = full_state_dict(model)["2.weight"]
    return {"kept": bool((weight == 0.25).all()), "gathered": stats(model).gathers > 0}


def test_modifier_edits_persist_in_bf16_after_a_step(worker_pool):
    for result in worker_pool(2).run(_modifier_edit_bf16):
        assert all(result.values()), result


def _load_after_optimizer_bf16() -> dict[str, bool]:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    config = Zero3Config(param_persistence_threshold=0, param_dtype="bf16", timeout_s=20)
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.0)  # masters exist already
    loaded = {k: torch.full_like(v, 0.5) for k, v in full_state_dict(model).items()}
    load_full_state_dict(model, loaded)
    model(torch.randn(2, 6).bfloat16()).float().sum().backward()
    opt.step()  # lr=0: the masters must hold the loaded values
    after = full_state_dict(model)
    return {"kept": all(bool((after[k] == 0.5).all()) for k in loaded)}


def test_loading_weights_after_the_optimizer_exists_reaches_the_masters(worker_pool):
    for result in worker_pool(2).run(_load_after_optimizer_bf16):
        assert all(result.values()), result


# -- 4: modules that edit their weights in forward -----------------------------------------


class _Renorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 6, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(4.0)
        self.head = nn.Linear(6, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(dim=1))


def _embedding_max_norm() -> dict[str, float]:
    comm = GlooBackend(timeout_s=20)
    model = _Renorm()
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    diffs = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 12, (LOCAL * comm.world_size, 3), generator=g)
        diffs.append(_train_step(model, opt, reference, ropt, tokens, comm))
    full = full_state_dict(model)["emb.weight"]
    return {
        "loss": max(diffs),
        "params": _max_param_diff(model, reference),
        "norm_gap": float((full.norm(dim=1) - reference.emb.weight.norm(dim=1)).abs().max()),
    }


def test_embedding_max_norm_renorm_reaches_the_shards(worker_pool):
    for result in worker_pool(2).run(_embedding_max_norm):
        assert result["loss"] < 1e-5, result
        assert result["params"] < 1e-5, result
        assert result["norm_gap"] < 1e-5, result


# -- 5: unfreezing a parameter frozen at sharding -----------------------------------------


def _progressive_unfreezing() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, list(model.parameters()), lr=1e-2)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    before = full_state_dict(model)["0.weight"].clone()
    diffs = []
    for step in range(4):
        if step == 2:
            model[0].requires_grad_(True)
            reference[0].requires_grad_(True)
        diffs.append(_train_step(model, opt, reference, ropt, _batch(step, comm.world_size), comm))
    after = full_state_dict(model)["0.weight"]
    return {
        "loss": max(diffs),
        "params": _max_param_diff(model, reference),
        "moved": not torch.equal(before, after),
        "grads": [p.grad for p in model.parameters()].count(None),
    }


def test_unfrozen_parameters_train_like_plain_pytorch(worker_pool):
    for result in worker_pool(2).run(_progressive_unfreezing):
        assert result["loss"] < 1e-5, result
        assert result["params"] < 1e-5, result
        assert result["moved"], result
        assert result["grads"] == 6, result  # every .grad None: gradients live in shards


# -- 6: buffers --------------------------------------------------------------------------


def _batchnorm_buffers() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    rank0_view = copy.deepcopy(model[1])  # what rank 0's own batches make of the stats
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.0)
    for step in range(3):
        x = _batch(step, comm.world_size) * (1 + comm.rank)  # ranks see different data
        model(x[comm.rank * LOCAL : (comm.rank + 1) * LOCAL]).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            h = nn.functional.linear(x[:LOCAL], *_first_layer(model))
            rank0_view.train()(h)
    full = full_state_dict(model)
    return {
        "mean": full["1.running_mean"],
        "var": full["1.running_var"],
        "batches": int(full["1.num_batches_tracked"]),
        "rank0_mean": rank0_view.running_mean,
    }


def _first_layer(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with gathered_parameters(list(model[0].parameters())):
        return model[0].weight.detach().clone(), model[0].bias.detach().clone()


def test_buffers_follow_rank_0_on_every_rank(worker_pool):
    results = worker_pool(2).run(_batchnorm_buffers)
    first = results[0]
    for result in results:
        assert torch.equal(result["mean"], first["mean"])
        assert torch.equal(result["var"], first["var"])
        assert result["batches"] == 3
    assert torch.allclose(first["mean"], first["rank0_mean"], atol=1e-6)


# -- 8: ranks that issue different collectives ------------------------------------------


def _different_models() -> str:
    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8 + 4 * comm.rank), nn.Linear(8 + 4 * comm.rank, 2))
    return _error_text(
        lambda: shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    )


def _different_configs() -> str:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    config = Zero3Config(param_persistence_threshold=0, reduce_bucket_size=100 + comm.rank)
    return _error_text(lambda: shard_module(model, config, comm=comm))


def test_different_models_or_configs_fail_at_shard_module(worker_pool):
    for text in worker_pool(2).run(_different_models):
        assert "shard_module: the ranks sharded different models" in text, text
        assert "parameter '0.weight'" in text and "(8, 6)" in text and "(12, 6)" in text, text
    for text in worker_pool(2).run(_different_configs):
        assert "Zero3Config.reduce_bucket_size: rank 0: 100; rank 1: 101" in text, text


def _eval_on_rank0_only() -> str:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)

    def run() -> None:
        if comm.rank == 0:
            with torch.no_grad():
                model(torch.randn(2, 6))
        model(torch.randn(2, 6)).sum().backward()

    return _error_text(run)


def _uneven_steps() -> str:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)

    def run() -> None:
        for _ in range(3 - comm.rank):  # rank 1 has one batch less
            model(torch.randn(2, 6)).sum().backward()
        full_state_dict(model)

    return _error_text(run)


class _Expert(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(6, hidden)
        self.out = nn.Linear(hidden, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class _UnevenMoE(nn.Module):
    """Experts of different sizes; each rank's tokens pick "its" expert."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.ModuleList(_Expert(4 * (e + 1)) for e in range(2))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts[expert](x)


def _routing_to_different_sizes() -> str:
    comm = GlooBackend(timeout_s=20)
    model = _UnevenMoE()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    return _error_text(lambda: model(torch.randn(2, 6), comm.rank).sum().backward())


def test_ranks_doing_different_things_fail_in_python_on_every_rank(worker_pool):
    for text in worker_pool(2).run(_eval_on_rank0_only):
        assert "ranks are about to issue different collectives" in text, text
        assert "inference forward" in text and "evaluation" in text, text
    for text in worker_pool(2).run(_uneven_steps):
        assert "ranks are about to issue different collectives" in text, text
        assert "different steps" in text, text
    for text in worker_pool(2).run(_routing_to_different_sizes):
        assert "module 'experts.0.fc'" in text and "module 'experts.1.fc'" in text, text
        assert "leaf" in text, text


# -- 9: a rank that stops calling zero3 ------------------------------------------------------


def _peer_goes_quiet() -> str:
    comm = GlooBackend(timeout_s=4)
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=4), comm=comm)
    model(torch.randn(2, 6)).sum().backward()
    if comm.rank == 1:
        time.sleep(8)  # stuck in user code: never issues its next collective
        os._exit(0)  # leave: the pool rebuilds the group for the next case
    return _error_text(lambda: model(torch.randn(2, 6)))


def test_a_timeout_says_what_this_rank_waited_for(worker_pool):
    texts = worker_pool(2).run(_peer_goes_quiet, timeout=90, allow_rank_exit=True)
    assert isinstance(texts[1], RankExited)
    text = texts[0]
    assert text.startswith("CommTimeoutError: zero3: rank 0 timed out before"), text
    assert "module '0'" in text and "step 2" in text, text
    assert "the last operation all ranks completed together" in text, text


# -- 10: double backward and torch.compile ----------------------------------------------------


def _double_backward() -> str:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    x = torch.randn(2, 6, requires_grad=True)

    def penalty() -> None:
        (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        grad.pow(2).sum().backward()

    return _error_text(penalty)


def test_double_backward_is_refused_clearly(worker_pool):
    for text in worker_pool(2).run(_double_backward):
        assert "double backward" in text and "create_graph=True" in text, text


def _compiled() -> str:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    compiled = torch.compile(model)
    return _error_text(lambda: compiled(torch.randn(2, 6)))


def test_torch_compile_of_a_sharded_model_is_refused_clearly(worker_pool):
    for text in worker_pool(2).run(_compiled, timeout=240):
        assert "torch.compile of a sharded model is not supported" in text, text


# -- round 3: silent wrong results and unhelpful errors (issue 24) ---------------------------


def test_a_deepspeed_key_under_two_spellings_with_different_values_is_refused():
    def config(**zero: Any) -> dict[str, Any]:
        return {"zero_optimization": {"stage": 3, **zero}, "gradient_clipping": 0}

    with pytest.raises(
        ValueError, match=r"stage3_prefetch_bucket_size=100.*prefetch_bucket_size=200"
    ):
        Zero3Config.from_deepspeed(
            config(stage3_prefetch_bucket_size=100, prefetch_bucket_size=200)
        )
    with pytest.raises(ValueError, match=r"param_persistence_threshold.*keep one"):
        Zero3Config.from_deepspeed(
            config(param_persistence_threshold=0, stage3_param_persistence_threshold="auto")
        )
    same = config(stage3_max_live_parameters=7, max_live_parameters=7)
    assert Zero3Config.from_deepspeed(same).max_live_parameters == 7  # one value: fine


def _tied_file(path: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    from zero3.hooks import empty_init
    from zero3.testing.models import TinyGPT

    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)
    stored = {k: v.clone() for k, v in TinyGPT(dim=8, layers=1).state_dict().items()}
    stored["lm_head.weight"] = torch.randn_like(stored["wte.weight"])  # differs from wte's
    file = f"{path}/tied-{comm.rank}.safetensors"
    save_file(stored, file)
    reference = TinyGPT(dim=8, layers=1)
    reference.load_state_dict(stored, strict=True)  # what torch keeps of the two values
    with empty_init():
        model = TinyGPT(dim=8, layers=1)
    config = Zero3Config(param_persistence_threshold=0, timeout_s=20)
    shard_module(model, config, comm=comm, checkpoint=file)
    x = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        diff = float((model(x) - reference(x)).abs().max())
    gathers = stats(model).gathers
    return {"params": _max_param_diff(model, reference), "out": diff, "gathers": gathers}


def test_a_tied_weight_stored_under_both_names_loads_what_torch_loads(worker_pool, tmp_path):
    for result in worker_pool(2).run(_tied_file, str(tmp_path)):
        assert result["params"] == 0.0 and result["out"] == 0.0, result
        assert result["gathers"] > 0, result


def _eager_differ(seed_per_rank: bool) -> str:
    comm = GlooBackend(timeout_s=20)
    model = _mlp(seed=comm.rank if seed_per_rank else 0)
    config = Zero3Config(param_persistence_threshold=0, sync_module_states=False, timeout_s=20)
    return _error_text(lambda: shard_module(model, config, comm=comm))


def test_eager_parameters_that_differ_per_rank_are_refused_without_sync(worker_pool):
    for text in worker_pool(2).run(_eager_differ, True):
        assert text.startswith("ValueError: zero3: the ranks' parameters differ"), text
        assert "'0.weight'" in text and "'4.bias'" in text and "sync_module_states" in text
    assert worker_pool(2).run(_eager_differ, False) == ["no error"] * 2


def _plain_clipping(threshold: int) -> dict[str, Any]:
    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(param_persistence_threshold=threshold, timeout_s=20), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.5)
    ropt = torch.optim.SGD(reference.parameters(), lr=0.5)
    before = [p.grad for p in model.parameters()]  # no backward yet: None, as in torch
    norms, refused = [], ""
    for step in range(3):
        x = _batch(step, comm.world_size)
        model(x[comm.rank * LOCAL : (comm.rank + 1) * LOCAL]).pow(2).mean().backward()
        if step == 0:
            refused = _error_text(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        norms.append(float(opt.clip_grad_norm_(0.05)))
        opt.step()
        after_step = _error_text(lambda: model[0].weight.grad)  # torch still holds it here
        model.zero_grad()
        reference(x).pow(2).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)))
        ropt.step()
        ropt.zero_grad()
    return {
        "before": before.count(None),
        "refused": refused,
        "after_step": after_step,
        "after_zero_grad": [p.grad for p in model.parameters()].count(None),
        "norm_diff": max(abs(a - b) for a, b in zip(norms[::2], norms[1::2], strict=True)),
        "params": _max_param_diff(model, reference),
        "reductions": stats(model).reduce_collectives,
    }


@pytest.mark.parametrize("threshold", [0, 100_000])  # partitioned, and all persistent
def test_plain_clip_grad_norm_of_a_sharded_model_fails_loudly_on_every_rank(worker_pool, threshold):
    for result in worker_pool(2).run(_plain_clipping, threshold):
        assert result["before"] == result["after_zero_grad"] == 6, result
        refused = result["refused"]
        start = "RuntimeError: zero3: parameter '0.weight' of a sharded model has no .grad"
        assert refused.startswith(start), refused
        assert "PartitionedOptimizer.clip_grad_norm_" in refused and "gradient_clipping" in refused
        assert "has no .grad" in result["after_step"], result
        assert result["norm_diff"] < 1e-5 and result["params"] < 1e-5, result
        assert result["reductions"] > 0, result


def _extra_round_trip(path: str) -> dict[str, Any]:
    from zero3.optim import load_checkpoint, save_checkpoint

    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    extra = {
        "step": torch.tensor(7),  # 0-dim: the most common thing in extra
        "loss": torch.tensor(1.5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64),
        "empty": torch.empty(0, 3),
        "transposed": torch.arange(6.0).view(2, 3).t(),
        "nested": {"a": [torch.tensor(1, dtype=torch.int8), (torch.tensor(2.0), 3)], "t": (1, 2)},
        f"rank{comm.rank}": torch.full((2,), float(comm.rank), requires_grad=True),
    }
    save_checkpoint(f"{path}/ckpt", model, opt, extra=extra)
    back = load_checkpoint(f"{path}/ckpt", model, opt)
    return {"same": _same(extra, back), "keys": sorted(back)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a.detach(), b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() <= b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_extra_round_trips_any_tensor_shape_dtype_and_nesting(worker_pool, tmp_path):
    for result in worker_pool(2).run(_extra_round_trip, str(tmp_path)):
        assert result["same"], result
        assert {"rank0", "rank1"} <= set(result["keys"]), result


def _another_optimizer(path: str) -> str:
    from zero3.optim import load_checkpoint, save_checkpoint

    comm = GlooBackend(timeout_s=20)
    config = Zero3Config(param_persistence_threshold=0, timeout_s=20)
    model = shard_module(_mlp(), config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    save_checkpoint(f"{path}/adamw", model, opt)
    fresh = shard_module(_mlp(), config, comm=comm)
    sgd = PartitionedOptimizer(fresh, torch.optim.SGD, lr=0.1, momentum=0.9)
    try:
        load_checkpoint(f"{path}/adamw", fresh, sgd)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_checkpoint_of_another_optimizer_class_is_refused_at_load(worker_pool, tmp_path):
    for text in worker_pool(2).run(_another_optimizer, str(tmp_path)):
        assert text.startswith("CheckpointMismatchError: checkpoint "), text
        assert "AdamW optimizer" in text and "wraps SGD" in text, text
        assert "load_checkpoint(path, model, None)" in text, text


def _diff(xs: Any, ys: Any) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


def _copies_and_ema() -> dict[str, Any]:
    import io
    import pickle

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    comm = GlooBackend(timeout_s=20)
    config = Zero3Config(param_persistence_threshold=0, timeout_s=20)
    model = _mlp()
    reference = copy.deepcopy(model)
    shard_module(model, config, comm=comm)
    whole, part = copy.deepcopy(model), copy.deepcopy(model[2])  # gathers: every rank
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.2)
    ropt = torch.optim.SGD(reference.parameters(), lr=0.2)
    refused = ""
    for step in range(3):
        _train_step(model, opt, reference, ropt, _batch(step, comm.world_size), comm)
        if step == 0:
            refused = _error_text(lambda: ema.update_parameters(model))
        with gathered_parameters(list(model.parameters())):  # how an EMA is kept
            ema.update_parameters(model)
        ref_ema.update_parameters(reference)
    pickled = _error_text(lambda: torch.save(model, io.BytesIO()))
    return {
        "plain": [
            type(whole) is nn.Sequential,
            type(part) is nn.Linear,
            all(type(p) is nn.Parameter for p in whole.parameters()),
        ],
        "hooks": len(whole._forward_pre_hooks) + len(whole[0]._forward_hooks),
        "whole_diff": _diff(whole.parameters(), _mlp().parameters()),
        "part_diff": _diff(part.parameters(), _mlp()[2].parameters()),
        "refused": refused,
        "ema_diff": _diff(ema.state_dict().values(), ref_ema.state_dict().values()),
        "pickled": pickled,
        "config": pickle.loads(pickle.dumps(config)) == copy.deepcopy(config) == config,
        "gathers": stats(model).gathers,
    }


def test_deepcopy_and_ema_of_a_sharded_model_are_ordinary_copies(worker_pool):
    for result in worker_pool(2).run(_copies_and_ema):
        assert all(result["plain"]) and result["hooks"] == 0, result
        assert result["whole_diff"] == 0.0 and result["part_diff"] == 0.0, result
        assert "partitioned across ranks" in result["refused"], result
        assert "gathered_parameters" in result["refused"], result
        assert result["ema_diff"] < 1e-6, result
        start = "TypeError: zero3: a sharded module cannot be pickled"
        assert result["pickled"].startswith(start), result
        assert "full_state_dict" in result["pickled"], result
        assert result["config"] and result["gathers"] > 0, result


def _peer_leaves(how: str) -> str:
    import atexit

    comm = GlooBackend(timeout_s=20)
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=20), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    if comm.rank == 1:  # one batch fewer than rank 0: its script ends here
        if how == "exit":
            atexit._run_exitfuncs()  # what the interpreter does as the script ends
        os._exit(0)  # (no exit handler at all for "crash")
    return _error_text(lambda: model(torch.randn(2, 6)))


@pytest.mark.parametrize("how", ["exit", "crash"])
def test_a_peer_that_left_is_named_with_the_operation_and_step(worker_pool, how):
    texts = worker_pool(2).run(_peer_leaves, how, timeout=90, allow_rank_exit=True)
    assert isinstance(texts[1], RankExited)
    text = texts[0]
    who = {
        "exit": "rank 1 left the job (its process exited normally",
        "crash": "rank 1 is gone: its process (pid",
    }[how]
    assert text.startswith(f"PeerGoneError: zero3: {who}"), text
    assert "while rank 0 waited for it in this zero3 operation: " in text, text
    assert "module '0'" in text and "step 2, training forward" in text, text


def _broken_safetensors(path: str, damage: str) -> str:
    from safetensors.torch import save_file

    from zero3.hooks import empty_init

    comm = GlooBackend(timeout_s=20)
    file = f"{path}/{damage}-{comm.rank}.safetensors"
    save_file(_mlp().state_dict(), file)
    data = Path(file).read_bytes()  # the header's length is the first 8 bytes
    Path(file).write_bytes(data[:-40] if damage == "truncated" else data[:6] + b"\xff" + data[7:])
    with empty_init():
        model = _mlp()
    config = Zero3Config(param_persistence_threshold=0, timeout_s=20)
    try:
        shard_module(model, config, comm=comm, checkpoint=file)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_broken_safetensors_file_is_named(worker_pool, tmp_path, damage):
    for rank, text in enumerate(worker_pool(2).run(_broken_safetensors, str(tmp_path), damage)):
        file = f"{tmp_path}/{damage}-{rank}.safetensors"
        assert text.startswith(f"CorruptCheckpointError: the safetensors file {file} is "), text
        assert "Write or download it again" in text, text
