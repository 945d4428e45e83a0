"""Leaves named by module path (DeepSpeed's leaf_module names / name_suffixes) on real
ranks: the routed MoE block is gathered whole in one collective and trains as one process."""

from __future__ import annotations

import copy

import pytest
import torch

from zero3.comm import GlooBackend
from zero3.core import ModulePath, Zero3Config
from zero3.hooks import set_leaf_modules, shard_module, stats
from zero3.testing.models import Routed, loss_of, routed_input

pytestmark = pytest.mark.multirank


def _config(how: str) -> Zero3Config:
    # Every parameter sharded (the tiny model would otherwise be all persistent) and
    # released after forward, so each gather shows in the counters.
    base = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "timeout_s": 30}
    if how == "names":
        return Zero3Config(leaf_modules=(ModulePath("moe"),), **base)
    if how == "name_suffixes":
        ds = {"zero_optimization": {"stage": 3, "leaf_module": {"name_suffixes": ["moe"]}}}
        return Zero3Config.from_deepspeed({**ds, "gradient_clipping": 0}, **base)
    return Zero3Config(**base)  # "after": set_leaf_modules once sharded


def _routed_with_path_leaf(how: str) -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(0)
    model = Routed()
    reference = copy.deepcopy(model)
    shard_module(model, _config(how), comm=comm)
    if how == "after":
        assert set_leaf_modules(model, ModulePath("moe", suffix=True)) == ["moe"]
    moe_numel = sum(p.numel() for p in reference.moe.parameters())
    head_numel = sum(p.numel() for p in reference.head.parameters())
    rows = []
    for step in range(2):
        # Rank r routes every token to expert r: the ranks run different experts.
        x = routed_input(comm.rank, seed=step).requires_grad_(True)
        xr = x.detach().clone().requires_grad_(True)
        out, ref = model(x), reference(xr)
        loss_of(out).backward()
        loss_of(ref).backward()
        s = stats(model)
        rows.append(
            {
                "out": (out - ref).abs().max().item(),
                "in": (x.grad - xr.grad).abs().max().item(),
                "forward_gathers": s.forward_gathers,
                "forward_numel": s.forward_gathered_numel,
            }
        )
        model.zero_grad()
        reference.zero_grad()
    return {"rows": rows, "moe": moe_numel, "head": head_numel}


@pytest.mark.parametrize("how", ["names", "name_suffixes", "after"])
def test_module_path_leaf_gathers_the_routed_block_once(worker_pool, how):
    for result in worker_pool(2).run(_routed_with_path_leaf, how, timeout=120):
        first = result["rows"][0]
        # One gather for the whole MoE subtree (router and all four experts, though this
        # rank runs one) and one for the head, on the step without a trace.
        assert first["forward_gathers"] == 2, result
        assert first["forward_numel"] == result["moe"] + result["head"], result
        for row in result["rows"]:
            assert row["out"] < 1e-6 and row["in"] < 1e-6, result
