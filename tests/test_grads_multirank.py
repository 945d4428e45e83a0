"""The gradient path on real ranks: every gathered gradient equals one process's."""

from __future__ import annotations

import copy

import pytest
import torch

from zero3.comm import GlooBackend
from zero3.core import Zero3Config, full_grad, local_grad
from zero3.core.engine import sharded_state
from zero3.hooks import shard_module, stats
from zero3.testing import CaseError
from zero3.testing.models import MoEBlock, Routed, build, loss_of, routed_input
from zero3.testing.reduce_paths import ArrivalOrderPath

pytestmark = pytest.mark.multirank

LOCAL = 2  # samples per rank per micro-step


def _grad_parity(name: str, micro_steps: int = 1, **config) -> dict[str, object]:
    """Sharded gradients after ``micro_steps`` backwards vs one process on the
    concatenated batches (same micro-steps)."""
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    if name == "routed":
        torch.manual_seed(0)
        model = Routed()

        def make(batch, seed):  # rank q's slice routes to expert q only
            return torch.cat([routed_input(q, seed=seed) for q in range(n)])

        local = 5
    else:
        model, make = build(name)
        local = LOCAL
    reference = copy.deepcopy(model)
    config.setdefault("param_persistence_threshold", 0)
    leaf = (MoEBlock,) if name in ("moe", "routed") else ()
    shard_module(model, Zero3Config(leaf_modules=leaf, **config), comm=comm)
    for micro in range(micro_steps):
        x = make(local * n, micro)
        loss_of(model(x[r * local : (r + 1) * local])).backward()
        # One process, same global batch: the mean over ranks of per-rank means.
        loss_of(reference(x)).backward()
    worst, missing = 0.0, []
    for (pname, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        g = full_grad(p)
        if q.grad is None or not q.requires_grad:
            if g is not None and bool(g.abs().max() > 0):
                missing.append(pname)
            continue
        if g is None:
            missing.append(pname)
            continue
        worst = max(worst, (g.float() - q.grad).abs().max().item())
    s = stats(model)
    return {"worst": worst, "mismatched": missing, "reductions": s.reduce_collectives}


def _check(results, tol=1e-5):
    for result in results:
        assert not result["mismatched"], result
        assert result["worst"] < tol, result
        assert result["reductions"] > 0, result  # reductions really happened


ZOO = [
    "gpt_tied",
    "albert_reused",
    "bias_returning",
    "parent_uses_child_weight",
    "frozen_and_unused",
    "moe",
    "routed",
    "checkpoint_reentrant",
    "checkpoint_non_reentrant",
]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_gradients_equal_one_process(worker_pool, name, world_size):
    _check(worker_pool(world_size).run(_grad_parity, name))


VARIANTS = {
    "accumulate-4": ({"micro_steps": 4}, {}),
    "tiny-buckets": ({}, {"reduce_bucket_size": 1}),
    "huge-buckets": ({}, {"reduce_bucket_size": 10**12}),
    "discrete": ({}, {"contiguous_gradients": False}),
    "no-overlap": ({}, {"overlap_comm": False}),
    "all-reduce": ({}, {"grad_reduce_op": "all_reduce"}),
    "discrete-all-reduce": ({}, {"grad_reduce_op": "all_reduce", "contiguous_gradients": False}),
    "accumulate-release": ({"micro_steps": 3}, {"max_reuse_distance": 0, "reduce_bucket_size": 50}),
    "fp32-reduce-of-bf16": ({}, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}),
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradient_path_variants(worker_pool, variant, world_size):
    call, config = VARIANTS[variant]
    for name in ("gpt_tied", "routed", "checkpoint_reentrant"):
        if variant == "fp32-reduce-of-bf16":
            results = worker_pool(world_size).run(_bf16_grads, name, **config)
            for result in results:
                assert result["rel"] < 0.05, (name, result)
            continue
        _check(worker_pool(world_size).run(_grad_parity, name, **call, **config))


def _bf16_grads(name: str, **config) -> dict[str, object]:
    """bf16 parameters reduced in fp32: compare against the fp32 reference loosely
    (the forward itself runs in bf16, ~3 significant digits)."""
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    if name == "routed":
        torch.manual_seed(0)
        model = Routed()
        x = torch.cat([routed_input(q) for q in range(n)])
        local = 5
    else:
        model, make = build(name)
        x = make(LOCAL * n, 0)
        local = LOCAL
    reference = copy.deepcopy(model)
    leaf = (MoEBlock,) if name == "routed" else ()
    shard_module(
        model, Zero3Config(param_persistence_threshold=0, leaf_modules=leaf, **config), comm=comm
    )
    xs = x if not x.is_floating_point() else x.to(torch.bfloat16)
    loss_of(model(xs[r * local : (r + 1) * local])).backward()
    loss_of(reference(x)).backward()
    num = den = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        g = full_grad(p)
        if q.grad is not None:
            assert g is not None and g.dtype == torch.float32
            num += (g - q.grad).pow(2).sum().item()
            den += q.grad.pow(2).sum().item()
    return {"rel": (num / max(den, 1e-30)) ** 0.5}


def _hf_checkpointing(name: str, reentrant: bool) -> dict[str, object]:
    from zero3.testing.hf_models import build_hf, leaf_classes, tokens

    comm = GlooBackend(timeout_s=60)
    n, r = comm.world_size, comm.rank
    model = build_hf(name)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    shard_module(
        model,
        Zero3Config(param_persistence_threshold=0, leaf_modules=leaf_classes(name)),
        comm=comm,
    )
    ids = tokens(2 * n, 0)
    model(input_ids=ids[2 * r : 2 * r + 2], labels=ids[2 * r : 2 * r + 2]).loss.backward()
    reference(input_ids=ids.view(n, 2, -1)[0], labels=ids.view(n, 2, -1)[0])  # warm path
    reference.zero_grad()
    total = (
        sum(
            reference(input_ids=ids[2 * q : 2 * q + 2], labels=ids[2 * q : 2 * q + 2]).loss
            for q in range(n)
        )
        / n
    )
    total.backward()
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        g = full_grad(p)
        if q.grad is None:
            continue
        assert g is not None
        worst = max(worst, (g - q.grad).abs().max().item())
    return {"worst": worst, "reductions": stats(model).reduce_collectives}


@pytest.mark.transformers
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transformers_gradient_checkpointing(worker_pool, name, reentrant):
    for result in worker_pool(2).run(_hf_checkpointing, name, reentrant, timeout=240):
        assert result["worst"] < 1e-5, result
        assert result["reductions"] > 0


def _bytes_theory(grad_reduce_op: str) -> dict[str, object]:
    # gloo's own reduce-scatter, so the reduce-scatter path is the one measured.
    comm = GlooBackend(timeout_s=30, reduce_scatter_via="native")
    model, make = build("gpt_tied")
    shard_module(
        model,
        Zero3Config(
            param_persistence_threshold=0, grad_reduce_op=grad_reduce_op, reduce_bucket_size=3000
        ),
        comm=comm,
    )
    state = sharded_state(model)
    trainable = [sp for sp in state.params if sp.requires_grad]
    loss_of(model(make(2, 0))).backward()
    s = stats(model)
    return {
        "payload": s.reduce_payload_bytes,
        "padding": s.reduce_padding_bytes,
        "fingerprint": s.reduce_fingerprint_bytes,
        "flags": s.grad_flag_bytes,
        "wire": s.reduce_wire_bytes,
        "collectives": s.reduce_collectives,
        "buckets": len(state.reducer.buckets),
        "theory_payload": sum(sp.numel * 4 for sp in trainable),
        "theory_padded": sum(sp.padded_numel * 4 for sp in trainable),
        "n_trainable": len(trainable),
        "local_grad_numel": sum(
            (lg.numel() if (lg := local_grad(sp.param)) is not None else 0) for sp in trainable
        ),
        "local_theory": sum(sp.local_numel for sp in trainable),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op,factor", [("reduce_scatter", 1), ("all_reduce", 2)])
def test_reduction_bytes_equal_the_theory(worker_pool, world_size, op, factor):
    n = world_size
    for result in worker_pool(world_size).run(_bytes_theory, op):
        assert result["payload"] == factor * result["theory_payload"]
        assert result["payload"] + result["padding"] == factor * result["theory_padded"]
        assert result["fingerprint"] == factor * result["buckets"] * n * 16 * 4
        assert result["wire"] == pytest.approx(factor * result["theory_payload"] * (n - 1) / n)
        assert result["flags"] == 2 * result["n_trainable"]  # one flag collective, counted apart
        assert result["collectives"] == result["buckets"] > 1
        assert result["local_grad_numel"] == result["local_theory"]


def _arrival_order_buckets(fixed: bool) -> dict[str, object]:
    comm = GlooBackend(timeout_s=6)
    torch.manual_seed(0)
    model = Routed()
    shard_module(
        model,
        Zero3Config(
            param_persistence_threshold=0,
            leaf_modules=(MoEBlock,),
            reduce_bucket_size=200,
            timeout_s=6,
        ),
        comm=comm,
    )
    if not fixed:  # DeepSpeed's arrival-order buckets, a test-only strategy
        path = sharded_state(model).reducer.path
        sharded_state(model).reducer.use_path(ArrivalOrderPath(path.comm, path.stream, path.pool))
    # Rank r routes every token to expert r: the other experts get no gradient here.
    loss_of(model(routed_input(comm.rank))).backward()
    return {"ok": True}


def test_fixed_buckets_rule_is_what_keeps_ranks_in_step(worker_pool):
    assert worker_pool(2).run(_arrival_order_buckets, True) == [{"ok": True}] * 2
    # Buckets formed by arrival order (DeepSpeed's way): rank 0 has expert 0's
    # gradients where rank 1 has expert 1's, equal in size, so the two ranks reduce
    # different parameters together. The reduction fingerprints catch it on both ranks
    # (without them the gradients would be silently mixed).
    with pytest.raises(CaseError) as info:
        worker_pool(2).run(_arrival_order_buckets, False, timeout=60)
    text = str(info.value)
    assert "rank 0 raised" in text and "rank 1 raised" in text, text
    assert "ranks reduced different gradient buckets together" in text, text
