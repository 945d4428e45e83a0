"""PartitionedOptimizer in one process (the loopback backend) and the loss scaler."""

import copy

import pytest
import torch
from torch import nn

from zero3.comm import create_backend
from zero3.core import Zero3Config
from zero3.hooks import full_state_dict, shard_module
from zero3.optim import LossScaler, PartitionedOptimizer


def _pair(**config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 3))
    reference = copy.deepcopy(model)
    config.setdefault("param_persistence_threshold", 0)
    shard_module(model, Zero3Config(**config), comm=create_backend("loopback"))
    return model, reference


def _train(model, opt, steps=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_matches_torch_and_lr_writes_take_effect():
    model, reference = _pair()
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    assert isinstance(opt, torch.optim.Optimizer)
    for o in (opt, ropt):
        o.param_groups[0]["lr"] = 3e-2  # written like a trainer would
    _train(model, opt)
    _train(reference, ropt)
    full = full_state_dict(model)
    for k, v in reference.state_dict().items():
        assert torch.allclose(full[k], v, atol=1e-6), k


def test_state_dict_round_trip_resumes_exactly():
    model, _ = _pair()
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _train(model, opt, steps=3)
    saved = copy.deepcopy(opt.state_dict())
    weights = full_state_dict(model)
    _train(model, opt, steps=2, seed=1)
    expected = full_state_dict(model)

    from zero3.hooks import load_full_state_dict

    fresh, _ = _pair()
    load_full_state_dict(fresh, weights)
    fresh_opt = PartitionedOptimizer(fresh, torch.optim.AdamW, lr=1e-2)
    fresh_opt.load_state_dict(saved)
    _train(fresh, fresh_opt, steps=2, seed=1)
    got = full_state_dict(fresh)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def test_errors_are_clear():
    model, _ = _pair()
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="already stepped by another PartitionedOptimizer"):
        PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(NotImplementedError, match="cannot add param groups"):
        opt.add_param_group({"params": []})
    bad = opt.state_dict()
    bad["rank"] = 3
    with pytest.raises(ValueError, match="saved by rank 3"):
        opt.load_state_dict(bad)
    other, _ = _pair()
    with pytest.raises(TypeError, match="factory must set them itself"):
        PartitionedOptimizer(other, lambda groups: torch.optim.SGD(groups, lr=0.1), lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of this sharded module"):
        PartitionedOptimizer(other, torch.optim.SGD, [nn.Parameter(torch.ones(2))], lr=0.1)


def test_plain_clip_grad_norm_is_refused_and_ours_clips():
    model, reference = _pair()
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 6)
    model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"has no \.grad.*PartitionedOptimizer\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a world of one too
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    assert float(opt.clip_grad_norm_(1e-3)) == pytest.approx(float(expected), rel=1e-5)


def test_dynamic_loss_scaler_follows_deepspeed_knobs():
    s = LossScaler.from_config(0, 4, loss_scale_window=2, hysteresis=2, min_loss_scale=2.0)
    assert s.dynamic and s.scale == 16
    s.update(overflow=True)
    assert s.scale == 16  # hysteresis: the first overflow is tolerated
    s.update(overflow=True)
    assert s.scale == 8
    s.update(overflow=False)
    s.update(overflow=False)
    assert s.scale == 16  # a clean window doubles it
    for _ in range(10):
        s.update(overflow=True)
    assert s.scale == 2.0  # floor
    static = LossScaler.from_config(128, 16, 1000, 2, 1.0)
    assert not static.dynamic and static.scale == 128
