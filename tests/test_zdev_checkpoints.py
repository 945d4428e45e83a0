"""Checkpoints from and onto zdev, and models never whole on any rank built onto zdev.

A sharded checkpoint (``zero3.optim.save_checkpoint``) written by a world of 2 on zdev is
loaded by worlds of 2 and 4 on zdev: the weights come back bit for bit and training
resumes where it stopped. A model built under ``empty_init`` is materialised from a
safetensors file straight into zdev shards (``shard_module(checkpoint=)``) and then
trains like one process that loaded the same file onto zdev.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero3.core import Zero3Config
from zero3.core.engine import sharded_state
from zero3.hooks import empty_init, full_state_dict, shard_module, stats
from zero3.optim import PartitionedOptimizer, load_checkpoint, save_checkpoint
from zero3.testing.models import TinyGPT, build, loss_of, token_batch

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(300)]

LOCAL = 2
LR = 1e-2


def _device() -> torch.device:
    return torch.device("zdev", int(os.environ["LOCAL_RANK"]))


def _config() -> Zero3Config:
    return Zero3Config(
        backend="zdev", param_persistence_threshold=0, overlap_comm=True, overlap_chunk_size=2000
    )


def _global_loss(model: torch.nn.Module, step: int) -> float:
    """This step's loss over the global batch (mean of the ranks' losses), then a step."""
    n, r = dist.get_world_size(), dist.get_rank()
    x = token_batch(61, 16)(8, step)[r * 8 // n : (r + 1) * 8 // n].to(_device())
    loss = loss_of(model(x))
    loss.backward()
    total = torch.tensor([float(loss)])
    dist.all_reduce(total)
    return float(total) / n


def _sharded_gpt() -> tuple[torch.nn.Module, PartitionedOptimizer]:
    model, _ = build("gpt_tied")
    model.to(_device())
    shard_module(model, _config())
    return model, PartitionedOptimizer(model, torch.optim.AdamW, lr=LR)


def _train_and_save(path: str) -> dict[str, Any]:
    model, opt = _sharded_gpt()
    for step in range(2):
        _global_loss(model, step)
        opt.step()
        opt.zero_grad()
    save_checkpoint(path, model, opt, extra={"step": 2})
    saved = full_state_dict(model)
    resumed_loss = _global_loss(model, 2)
    opt.step()
    return {"saved": saved, "loss": resumed_loss, "after": full_state_dict(model)}


def _load_and_resume(path: str) -> dict[str, Any]:
    model, opt = _sharded_gpt()
    extra = load_checkpoint(path, model, opt)
    loaded = full_state_dict(model)
    loss = _global_loss(model, int(extra["step"]))
    opt.step()
    return {
        "loaded": loaded,
        "loss": loss,
        "after": full_state_dict(model),
        "device": str(sharded_state(model).params[0].shard.device),
        "reductions": stats(model).reduce_collectives,
    }


@pytest.fixture(scope="module")
def saved(zdev_pool, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("zdev-ckpt") / "ckpt")
    return path, zdev_pool(2).run(_train_and_save, path, timeout=240)[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpoint_saved_on_zdev_loads_onto_zdev_at_any_world_size(zdev_pool, saved, world_size):
    path, before = saved
    for rank, result in enumerate(zdev_pool(world_size).run(_load_and_resume, path, timeout=240)):
        assert result["device"] == f"zdev:{rank}" and result["reductions"] > 0, result
        for key, value in before["saved"].items():
            assert torch.equal(result["loaded"][key], value), key
        assert abs(result["loss"] - before["loss"]) < 1e-5, (result["loss"], before["loss"])
        worst = max((result["after"][k] - v).abs().max().item() for k, v in before["after"].items())
        assert worst < 1e-4 if world_size == 2 else worst <= 2 * LR, worst


def _from_file(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    with empty_init():
        model = TinyGPT()
    on_meta = all(p.is_meta for p in model.parameters())
    shard_module(model, _config(), checkpoint=path)
    reference = TinyGPT()
    reference.load_state_dict(load_file(path), strict=False)  # the tied head is saved once
    reference.to(_device())
    full = full_state_dict(model)
    exact = all(torch.equal(full[k], v.cpu()) for k, v in reference.state_dict().items())
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=LR)
    ropt = torch.optim.AdamW(reference.parameters(), lr=LR)
    n, r = dist.get_world_size(), dist.get_rank()
    diffs = []
    for step in range(2):
        x = token_batch(61, 16)(LOCAL * n, step).to(_device())
        mine = loss_of(model(x[r * LOCAL : (r + 1) * LOCAL]))
        mine.backward()
        ref = loss_of(reference(x))
        ref.backward()
        total = torch.tensor([float(mine)])
        dist.all_reduce(total)
        diffs.append(abs(float(total) / n - float(ref)))
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    return {
        "on_meta": on_meta,
        "exact": exact,
        "device": str(sharded_state(model).params[0].shard.device),
        "tied": model.lm_head.weight is model.wte.weight,
        "loss_diff": max(diffs),
        "gathers": stats(model).gathers,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_empty_init_model_materialises_from_a_checkpoint_onto_zdev(zdev_pool, tmp_path, world_size):
    from safetensors.torch import save_file

    torch.manual_seed(5)
    state = TinyGPT().state_dict()
    del state["lm_head.weight"]  # tied: one name is enough (as save_pretrained writes it)
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    for rank, result in enumerate(zdev_pool(world_size).run(_from_file, path, timeout=240)):
        assert result["on_meta"] and result["exact"] and result["tied"], result
        assert result["device"] == f"zdev:{rank}" and result["gathers"] > 0, result
        assert result["loss_diff"] < 1e-5, result
