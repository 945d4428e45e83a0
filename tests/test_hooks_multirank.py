"""shard_module on real ranks: sharded forward/backward equals the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zero3.comm import GlooBackend
from zero3.core import FingerprintMismatchError, Zero3Config, register_external_parameter
from zero3.core.engine import sharded_state
from zero3.hooks import (
    full_state_dict,
    load_full_state_dict,
    set_leaf_modules,
    shard_module,
    stats,
    unshard_module,
)
from zero3.testing.models import MoEBlock, Routed, build, loss_of, routed_input

pytestmark = pytest.mark.multirank

ZOO = [
    "gpt_tied",
    "albert_reused",
    "bias_returning",
    "parent_uses_child_weight",
    "frozen_and_unused",
    "moe",
]
LOCAL_BATCH = 3


def _config(reuse: int, **kw) -> Zero3Config:
    return Zero3Config(param_persistence_threshold=0, max_reuse_distance=reuse, **kw)


def _non_persistent_bytes(model: nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _zoo_parity(name: str, reuse: int) -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    rank = comm.rank
    model, make = build(name)
    reference = copy.deepcopy(model)
    config = _config(reuse, leaf_modules=(MoEBlock,) if name == "moe" else ())
    shard_module(model, config, comm=comm)
    worst_out = worst_in = 0.0
    gathers = []
    for step in range(3):
        x = make(LOCAL_BATCH * comm.world_size, step)[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        xs, xr = x.clone(), x.clone()
        if x.is_floating_point():
            xs.requires_grad_(True)
            xr.requires_grad_(True)
        out, ref = model(xs), reference(xr)
        worst_out = max(worst_out, (out - ref).abs().max().item())
        loss_of(out).backward()
        loss_of(ref).backward()
        if x.is_floating_point():
            worst_in = max(worst_in, (xs.grad - xr.grad).abs().max().item())
        gathers.append(stats(model).gathers)
        model.zero_grad()
        reference.zero_grad()
        assert _non_persistent_bytes(model) == 0, "a full parameter outlived backward"
    with torch.no_grad():  # a forward with reuse 0 releases everything too
        model(make(2, 99))
    return {
        "out": worst_out,
        "in": worst_in,
        "gathers": gathers,
        "left": _non_persistent_bytes(model),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("reuse", [0, 1_000_000_000], ids=["release", "default-window"])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_forward_and_input_grads_match_unsharded(worker_pool, name, reuse, world_size):
    for result in worker_pool(world_size).run(_zoo_parity, name, reuse):
        assert result["out"] < 1e-5, result
        assert result["in"] < 1e-6, result
        assert all(g > 0 for g in result["gathers"]), result  # sharding really happened
        assert result["left"] == 0


def _eval_between_training() -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    model, make = build("gpt_tied")
    reference = copy.deepcopy(model)
    shard_module(model, _config(1_000_000_000), comm=comm)
    hooks_counts = []
    diffs = []

    def train_step(step: int) -> None:
        x = make(2, step)
        out, ref = model(x), reference(x)
        diffs.append((out - ref).abs().max().item())
        loss_of(out).backward()
        loss_of(ref).backward()
        model.zero_grad()
        reference.zero_grad()

    step_owner = sharded_state(model).step
    for step in range(2):
        train_step(step)
        for mode in ("no_grad", "inference_mode", "eval"):
            x = make(2, 100 + step)
            if mode == "no_grad":
                with torch.no_grad():
                    out, ref = model(x), reference(x)
            elif mode == "inference_mode":
                with torch.inference_mode():
                    out, ref = model(x), reference(x)
            else:
                model.eval()
                reference.eval()
                with torch.no_grad():
                    out, ref = model(x), reference(x)
                model.train()
                reference.train()
            diffs.append((out - ref).abs().max().item())
            hooks_counts.append(step_owner.pending_backwards)
            assert _non_persistent_bytes(model) == 0, mode  # released after the forward
    train_step(5)  # training after inference-mode forwards: no inference tensor reused
    return {
        "diff": max(diffs),
        "counts": hooks_counts,
        "invalidations": stats(model).trace_invalidations,
    }


@pytest.mark.parametrize("world_size", [2])
def test_eval_no_grad_and_inference_mode_between_training_steps(worker_pool, world_size):
    for result in worker_pool(world_size).run(_eval_between_training):
        assert result["diff"] < 1e-5
        assert result["counts"] == [0] * 6  # no backward machinery armed by eval forwards
        assert result["invalidations"] == 0  # eval uses its own trace


def _moe_routing(leaf: bool) -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(0)
    model = Routed()
    reference = copy.deepcopy(model)
    if leaf:
        set_leaf_modules(model, MoEBlock)  # before sharding; after works too
    shard_module(model, _config(0), comm=comm)
    x = routed_input(comm.rank).requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    try:
        out = model(x)
    except FingerprintMismatchError as exc:
        return {"error": str(exc)}
    ref = reference(xr)
    loss_of(out).backward()
    loss_of(ref).backward()
    return {
        "out": (out - ref).abs().max().item(),
        "in": (x.grad - xr.grad).abs().max().item(),
        "gathers": stats(model).gathers,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_with_rank_dependent_routing_needs_a_leaf(worker_pool, world_size):
    group = worker_pool(world_size)
    for result in group.run(_moe_routing, True):
        assert result.get("error") is None, result
        assert result["out"] < 1e-6 and result["in"] < 1e-6 and result["gathers"] > 0
    # The same run without the leaf marking: each rank runs a different expert, and the
    # equal-sized gathers are caught by the headers before the gather (not a hang, not
    # mixed shards), naming each rank's module and advising a leaf.
    for rank, result in enumerate(group.run(_moe_routing, False)):
        message = result.get("error", "")
        assert "ranks are about to issue different collectives" in message, (rank, result)
        assert "rank 0: gathered a module's parameters for module 'moe.experts.0." in message
        assert "rank 1: gathered a module's parameters for module 'moe.experts.1." in message
        assert "leaf" in message


class HiddenUse(nn.Module):
    """Uses another module's weight through a reference zero3 cannot see being read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.hidden = [self.a.weight]  # a plain list: no module attribute read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) + x @ self.hidden[0].t()


def _explicit_external(register: bool) -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(0)
    model = HiddenUse()
    reference = copy.deepcopy(model)
    reference.hidden = [reference.a.weight]
    if register:
        register_external_parameter(model, model.a.weight)  # before sharding
    shard_module(model, _config(0), comm=comm)
    x = torch.randn(4, 6, requires_grad=True)
    try:
        out = model(x)
        loss_of(out).backward()
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0]}
    xr = x.detach().clone().requires_grad_(True)
    ref = reference(xr)
    loss_of(ref).backward()
    return {"out": (out - ref).abs().max().item(), "in": (x.grad - xr.grad).abs().max().item()}


def test_explicit_external_parameter_with_full_release(worker_pool):
    for result in worker_pool(2).run(_explicit_external, True):
        assert result.get("error") is None and result["out"] < 1e-6 and result["in"] < 1e-6
    # Without the registration the released weight has no bytes: an error, not garbage.
    for result in worker_pool(2).run(_explicit_external, False):
        assert "error" in result, result


def _api_errors_and_state_dicts() -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    model, make = build("gpt_tied")
    reference = copy.deepcopy(model)
    shard_module(model, _config(0), comm=comm)
    out: dict[str, object] = {}
    with pytest.raises(ValueError, match="already sharded"):
        shard_module(model, comm=comm)
    with pytest.raises(ValueError, match="already belongs to a sharded model"):
        shard_module(model.blocks[0], comm=comm)
    # The whole model's state_dict: trainable parameters whole (gathered), and they load
    # back through load_state_dict; a submodule's frozen partitioned one is refused.
    whole = model.state_dict()
    out["state_dict"] = all(torch.equal(whole[k], v) for k, v in reference.state_dict().items())
    model.load_state_dict(whole)
    model.blocks[0].requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"zero3\.hooks\.full_state_dict"):
        model.blocks[0].state_dict()
    model.blocks[0].requires_grad_(True)
    full = full_state_dict(model)
    expected = reference.state_dict()
    out["keys"] = sorted(full) == sorted(expected)
    out["values"] = all(torch.equal(full[k], expected[k]) for k in expected)
    out["rank0_only"] = len(full_state_dict(model, rank0_only=True)) > 0
    # Load a modified state dict, check through a forward.
    changed = {k: v * 0.5 if v.is_floating_point() else v for k, v in expected.items()}
    load_full_state_dict(model, changed)
    reference.load_state_dict(changed)
    x = make(2, 0)
    with torch.no_grad():
        out["loaded"] = (model(x) - reference(x)).abs().max().item()
    unshard_module(model)
    out["unsharded_class"] = type(model).__mro__[1].__name__
    with torch.no_grad():
        out["unsharded"] = (model(x) - reference(x)).abs().max().item()
    out["plain_state_dict"] = all(
        torch.equal(v, model.state_dict()[k]) for k, v in reference.state_dict().items()
    )
    return out


def test_state_dicts_errors_and_unshard(worker_pool):
    for rank, result in enumerate(worker_pool(2).run(_api_errors_and_state_dicts)):
        assert result["keys"] and result["values"] and result["state_dict"]
        assert result["rank0_only"] is (rank == 0)
        assert result["loaded"] < 1e-6
        assert result["unsharded"] < 1e-6 and result["plain_state_dict"]
        assert result["unsharded_class"] == "Module"
