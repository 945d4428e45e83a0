"""zero3.hooks.unsharded and iter_full_parameters at world 2 (zoo models, no transformers)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zero3.comm import GlooBackend
from zero3.core import FingerprintMismatchError, Zero3Config, gathered_parameters
from zero3.core.engine import TraceState, sharded_state
from zero3.hooks import iter_full_parameters, shard_module, stats, unshard_module, unsharded
from zero3.optim import PartitionedOptimizer

pytestmark = pytest.mark.multirank

LEAN = dict(max_reuse_distance=0)


def _model(**config):
    from zero3.testing.models import build

    comm = GlooBackend(timeout_s=30)
    model, make = build("gpt_tied")
    reference = copy.deepcopy(model)
    cfg = Zero3Config(param_persistence_threshold=0, **config)
    return shard_module(model, cfg, comm=comm), reference, make, comm


def _hook_keys(module: nn.Module) -> tuple[list[int], list[int]]:
    return list(module._forward_pre_hooks), list(module._forward_hooks)


def _whole_block() -> dict[str, object]:
    model, reference, make, comm = _model()
    user_hook = model.blocks[0].register_forward_pre_hook(lambda m, a: None)  # after zero3's
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = make(2, comm.rank)
    for _ in range(2):  # two training steps: the training trace is COMPLETE
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(2):
        xs = [make(2, r) for r in range(comm.world_size)]
        torch.stack([reference(xi).pow(2).mean() for xi in xs]).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    keys_before = [_hook_keys(m) for m in model.modules()]
    state = sharded_state(model)
    total = sum(sp.numel * 4 for sp in state.params)
    before = stats(model).gathers
    with torch.no_grad(), unsharded(model) as same:
        inside = stats(model).memory.gathered_bytes
        hooks_inside = sum(len(m._forward_pre_hooks) for m in model.modules())
        out = [model(make(2, 10 + i)) for i in range(3)]
        gathers_inside = stats(model).gathers - before
    diff = max((o - reference(make(2, 10 + i))).abs().max().item() for i, o in enumerate(out))
    after = stats(model).memory.gathered_bytes
    keys_after = [_hook_keys(m) for m in model.modules()]
    user_hook.remove()
    # Training after the block: the trace is intact and prefetching hits.
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    c = state.coordinator
    return {
        "same": same is model,
        "diff": diff,
        "inside": inside,
        "total": total,
        "hooks_inside": hooks_inside,
        "gathers_inside": gathers_inside,
        "after": after,
        "order_kept": keys_before == keys_after,
        "train_trace": c.traces["train"].state is TraceState.COMPLETE,
        "hit_rate": stats(model).prefetch_hit_rate,
        "gathers": stats(model).gathers,
    }


def test_unsharded_runs_whole_without_hooks(worker_pool):
    for r in worker_pool(2).run(_whole_block, timeout=90):
        assert r["same"] and r["diff"] < 1e-5, r
        assert r["inside"] == r["total"] and r["after"] == 0, r
        assert r["hooks_inside"] == 2, r  # the user's, and the root's grad guard: zero3's are out
        assert r["gathers_inside"] == 1, r  # the block's one gather, none per forward
        assert r["order_kept"], r
        assert r["train_trace"] and r["hit_rate"] == 1.0 and r["gathers"] > 0, r


def _budget_block(fraction: float) -> dict[str, object]:
    model, reference, make, _ = _model(**LEAN)
    state = sharded_state(model)
    sizes = [sp.numel * 4 for sp in state.params]
    budget = int(sum(sizes) * fraction)
    infer_before = state.coordinator.traces["infer"].state
    with torch.no_grad(), unsharded(model, max_bytes=budget):
        outs = [model(make(2, i)) for i in range(3)]
        inside = stats(model).memory.gathered_bytes
        hits = stats(model).prefetch_hits
    diff = max((o - reference(make(2, i))).abs().max().item() for i, o in enumerate(outs))
    memory = stats(model).memory
    return {
        "diff": diff,
        "peak": memory.peak_gathered_bytes,
        "bound": budget + max(sizes),
        "inside": inside,
        "budget": budget,
        "after": memory.gathered_bytes,
        "gathers": stats(model).gathers,
        "hits": hits,
        "infer_untouched": state.coordinator.traces["infer"].state is infer_before,
    }


@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.7])
def test_unsharded_max_bytes_bounds_the_gathered_bytes(worker_pool, fraction):
    for r in worker_pool(2).run(_budget_block, fraction, timeout=90):
        assert r["diff"] < 1e-5, r
        assert r["peak"] <= r["bound"], r
        assert r["inside"] <= r["budget"] and r["after"] == 0, r
        assert r["gathers"] > 0 and r["infer_untouched"], r


def _edits_merged() -> dict[str, object]:
    model, _, make, comm = _model()
    with torch.no_grad(), unsharded(model):
        if comm.rank == 1:
            model.blocks[0].mlp.fc.bias.fill_(3.0)  # seen by autograd's version counter
        model(make(1, 0))
    with gathered_parameters(model.blocks[0].mlp.fc.bias):
        merged = bool((model.blocks[0].mlp.fc.bias == 3.0).all())
    return {"merged": merged}


def test_unsharded_merges_in_place_edits_on_exit(worker_pool):
    for r in worker_pool(2).run(_edits_merged, timeout=60):
        assert r["merged"], r


def _refusals() -> dict[str, str]:
    model, _, make, _ = _model()
    found: dict[str, str] = {}

    def catch(key, fn):
        try:
            fn()
        except (RuntimeError, ValueError, TypeError) as exc:
            found[key] = str(exc)

    def nested():
        with unsharded(model), unsharded(model):
            pass

    def grad_forward():
        with unsharded(model):
            model(make(1, 0))

    def inside_step():
        out = model(make(1, 0))  # a training forward; its backward has not run
        try:
            with unsharded(model):
                pass
        finally:
            out.pow(2).mean().backward()

    def unshard_inside():
        with unsharded(model):
            unshard_module(model)

    catch("nested", nested)
    catch("grad", grad_forward)
    catch("step", inside_step)
    catch("unshard", unshard_inside)
    catch("plain", lambda: unsharded(nn.Linear(2, 2)).__enter__())
    catch("sub", lambda: unsharded(model.blocks[0]).__enter__())
    catch("budget", lambda: unsharded(model, max_bytes=-1).__enter__())
    # After every refusal the model still works and holds nothing gathered.
    with torch.no_grad():
        model(make(1, 0))
    found["gathered"] = str(stats(model).memory.gathered_bytes)
    return found


def test_unsharded_refusals_are_clear(worker_pool):
    for r in worker_pool(2).run(_refusals, timeout=60):
        assert "do not nest" in r["nested"], r
        assert "grad enabled" in r["grad"], r
        assert "step of the model is in progress" in r["step"], r
        assert "inside a zero3.hooks.unsharded block" in r["unshard"], r
        assert "not a sharded model" in r["plain"] and "not a sharded model" in r["sub"], r
        assert "max_bytes" in r["budget"], r
        assert r["gathered"] == "0", r


# -- iter_full_parameters ------------------------------------------------------------------


def _stream(bucket_bytes: int, rank0_only: bool, dtype) -> dict[str, object]:
    model, reference, _, comm = _model(**LEAN)
    state = sharded_state(model)
    largest = max(sp.numel * 4 for sp in state.params)
    names, worst = [], 0.0
    expected = dict(reference.named_parameters())
    for name, tensor in iter_full_parameters(
        model, bucket_bytes=bucket_bytes, rank0_only=rank0_only, dtype=dtype
    ):
        names.append(name)
        want = expected[name].detach().to(dtype or torch.float32)
        worst = max(worst, (tensor - want).abs().max().item())
        assert tensor.dtype == (dtype or torch.float32)
    memory = stats(model).memory
    return {
        "names": names,
        "expected": [n for n, _ in reference.named_parameters()],
        "worst": worst,
        "peak": memory.peak_gathered_bytes,
        "bound": bucket_bytes + largest,
        "after": memory.gathered_bytes,
        "rank": comm.rank,
    }


@pytest.mark.parametrize(
    "bucket_bytes,rank0_only,dtype",
    [(4096, False, None), (1, True, None), (1 << 30, False, torch.bfloat16)],
    ids=["4KiB", "rank0-one-by-one", "bf16-all"],
)
def test_iter_full_parameters_streams_in_order_within_the_bucket(
    worker_pool, bucket_bytes, rank0_only, dtype
):
    for r in worker_pool(2).run(_stream, bucket_bytes, rank0_only, dtype, timeout=60):
        if rank0_only and r["rank"] != 0:
            assert r["names"] == [], r
        else:
            assert r["names"] == r["expected"], r  # tied lm_head.weight listed once
            assert r["worst"] == 0.0, r
        assert 0 < r["peak"] <= r["bound"] and r["after"] == 0, r


def _stop_early() -> dict[str, str]:
    model, _, make, comm = _model(**LEAN)
    stream = iter_full_parameters(model, bucket_bytes=1)
    if comm.rank == 0:
        next(stream)
        stream.close()  # stops after one tensor
        action = lambda: model(make(1, 0))  # noqa: E731 - its next zero3 collective
    else:
        action = lambda: list(stream)  # noqa: E731
    try:
        action()
    except FingerprintMismatchError as exc:
        return {"error": str(exc)}
    return {"error": ""}


def test_iter_full_parameters_rank_that_stops_early_fails_every_rank(worker_pool):
    for r in worker_pool(2).run(_stop_early, timeout=60):
        assert "iter_full_parameters" in r["error"], r
        assert "consume the whole iterator" in r["error"], r


def _zoo_block(name: str, fraction: float | None) -> dict[str, object]:
    from zero3.testing.models import MoEBlock, build

    comm = GlooBackend(timeout_s=30)
    model, make = build(name)
    reference = copy.deepcopy(model)
    leaves = (MoEBlock,) if name == "moe" else ()  # routing differs per rank: a leaf
    config = Zero3Config(param_persistence_threshold=0, max_reuse_distance=0, leaf_modules=leaves)
    shard_module(model, config, comm=comm)
    total = sum(sp.numel * 4 for sp in sharded_state(model).params)
    budget = None if fraction is None else int(total * fraction)
    with torch.no_grad():
        model(make(2, comm.rank))  # an inference step first: externals found, a trace
        with unsharded(model, max_bytes=budget):
            outs = [model(make(2, 10 * comm.rank + i)) for i in range(3)]
    refs = [reference(make(2, 10 * comm.rank + i)) for i in range(3)]
    diff = max((o - r).abs().max().item() for o, r in zip(outs, refs, strict=True))
    return {"diff": diff, "after": stats(model).memory.gathered_bytes}


@pytest.mark.parametrize("fraction", [None, 0.4], ids=["whole", "budget-0.4"])
@pytest.mark.parametrize(
    "name", ["albert_reused", "bias_returning", "parent_uses_child_weight", "moe"]
)
def test_unsharded_forward_equals_plain_on_awkward_models(worker_pool, name, fraction):
    for r in worker_pool(2).run(_zoo_block, name, fraction, timeout=60):
        assert r["diff"] < 1e-5 and r["after"] == 0, r
