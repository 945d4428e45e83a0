"""``model.to(...)`` on a sharded module, at world 2 (the Trainer calls it on its model).

Casting before an optimizer exists equals sharding with ``param_dtype``; the device the
comm backend serves is a no-op; another device, and a cast once an optimizer keeps
fp32 masters, are errors saying what to do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zero3.core import Zero3Config
from zero3.hooks import full_state_dict, shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import build, loss_of

pytestmark = pytest.mark.multirank


def _train(model: torch.nn.Module, make: Any, steps: int = 3) -> list[float]:
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(steps):
        loss = loss_of(model(make(2, 100 * step + rank)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _cast_equals_param_dtype() -> dict[str, Any]:
    config = Zero3Config(param_persistence_threshold=0)
    model, make = build("gpt_tied")
    model.register_buffer("scale", torch.ones(3))
    reference = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    model = shard_module(model, config)
    model.to("cpu")  # the device it is on: nothing to do
    model.to(torch.device("cpu", 0))
    before = stats(model).other_collectives
    returned = model.to(torch.bfloat16)
    cast = full_state_dict(model)
    losses = _train(model, make)
    gathered = stats(model).forward_gathers

    other, make = build("gpt_tied")
    other = shard_module(other, Zero3Config(param_persistence_threshold=0, param_dtype="bf16"))
    return {
        "same_object": returned is model,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "buffer": str(model.scale.dtype),
        "cast_equal": all(torch.equal(cast[k], v) for k, v in reference.items() if k != "scale"),
        "no_collective_for_a_no_op": before == 0,
        "losses": losses,
        "reference_losses": _train(other, make),
        "gathers": gathered,
    }


def test_a_cast_before_the_optimizer_equals_param_dtype(worker_pool):
    for r in worker_pool(2).run(_cast_equals_param_dtype):
        assert r["same_object"]
        assert r["dtypes"] == ["torch.bfloat16"]
        assert r["buffer"] == "torch.bfloat16"  # buffers follow nn.Module.to
        assert r["cast_equal"]
        assert r["gathers"] > 0
        assert r["losses"] == r["reference_losses"]


def _errors() -> dict[str, str]:
    model, make = build("gpt_tied")
    model = shard_module(model, Zero3Config(param_persistence_threshold=0))
    found: dict[str, str] = {}
    for what, call in {
        "device": lambda: model.to("meta"),
        "integer": lambda: model.to(torch.int64),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as exc:
            found[what] = str(exc)
    loss_of(model(make(2, torch.distributed.get_rank()))).backward()
    try:
        model.to(torch.bfloat16)  # gradients of this window are pending
    except ValueError as exc:
        found["window"] = str(exc)
    model.zero_grad()
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model.float()  # the dtype it has: nothing to do
    try:
        model.half()
    except ValueError as exc:
        found["optimizer"] = str(exc)
    found["dtype_after"] = str(next(model.parameters()).dtype)
    del opt
    return found


def test_errors_name_the_problem_and_the_fix(worker_pool):
    for r in worker_pool(2).run(_errors):
        assert "cannot move the sharded TinyGPT to meta" in r["device"]
        assert "'gloo' comm backend" in r["device"] and "cpu" in r["device"]
        assert "floating" in r["integer"]
        assert "accumulation window" in r["window"]
        assert "PartitionedOptimizer already keeps fp32 masters" in r["optimizer"]
        assert "before building the optimizer" in r["optimizer"]
        assert r["dtype_after"] == "torch.float32"
