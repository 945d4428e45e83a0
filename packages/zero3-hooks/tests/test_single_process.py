"""shard_module in one process (the loopback plugin backend: a world of one)."""

import copy

import pytest
import torch
from torch import nn

from zero3.comm import create_backend
from zero3.core import Zero3Config, local_grad
from zero3.core.engine import sharded_state
from zero3.hooks import ShardedModule, set_leaf_modules, shard_module, stats, unshard_module
from zero3.testing.recording import RecordingBackend


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_world_of_one_keeps_parameters_whole_and_matches():
    model = _model()
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=create_backend("loopback"))
    assert isinstance(model, ShardedModule) and type(model).__name__ == "Sequential"
    x = torch.randn(3, 8)
    out, ref = model(x), reference(x)
    assert torch.allclose(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        # One rank has nothing to shard: the parameter stays whole, no gathers.
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
        assert torch.allclose(local_grad(p), q.grad.reshape(-1))
        with pytest.raises(RuntimeError, match=r"has no \.grad"):  # zero3 holds it
            p.grad  # noqa: B018
    assert stats(model).gathers == 0 and stats(model).reduce_collectives == 0
    # Each gradient is kept as autograd produced it, not copied into a flat buffer.
    kept = sharded_state(model).reducer.grad_buffers()
    assert len(kept) == len(list(model.parameters()))
    assert {t.data_ptr() for t in kept} == {local_grad(p).data_ptr() for p in model.parameters()}
    unshard_module(model)
    assert not isinstance(model, ShardedModule)
    assert torch.allclose(model(x), ref)


def test_set_leaf_modules_errors_and_after_sharding():
    model = _model()
    with pytest.raises(ValueError, match="no submodule"):
        set_leaf_modules(model, nn.Conv2d)
    with pytest.raises(ValueError, match="at least one"):
        set_leaf_modules(model)
    # A simulated world of two (values are not meaningful, scheduling is).
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=RecordingBackend(2))
    assert set_leaf_modules(model, "Sequential") == ["<root>"]  # after sharding, by name
    x = torch.randn(2, 8)
    model(x).sum().backward()
    s = stats(model)
    assert s.forward_gathers == 1  # the whole subtree in one gather
    with pytest.raises(ValueError, match="leaf_modules: no module"):
        shard_module(
            _model(), Zero3Config(leaf_modules=(nn.Conv2d,)), comm=create_backend("loopback")
        )


def test_module_zero_grad_ends_the_accumulation_window():
    model = _model()
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=create_backend("loopback"))
    x = torch.randn(2, 8)
    model(x).sum().backward()
    first = local_grad(model[0].weight).clone()
    model(x).sum().backward()  # accumulates: twice the gradient
    assert torch.allclose(local_grad(model[0].weight), 2 * first)
    model.zero_grad()  # what trainers call: ends the window
    assert local_grad(model[0].weight) is None
    model(x).sum().backward()
    assert torch.allclose(local_grad(model[0].weight), first)


def test_synchronize_exchanges_edit_flags_only_when_a_rank_edited():
    model = _model()
    # Biases (16 and 4 elements) stay whole on every rank: their edits are visible in place.
    config = Zero3Config(param_persistence_threshold=16)
    shard_module(model, config, comm=RecordingBackend(2))
    state = sharded_state(model)
    control, comm = state.control, state.comm
    assert isinstance(control, RecordingBackend) and isinstance(comm, RecordingBackend)
    with torch.no_grad():
        model(torch.randn(2, 8))  # an inference step: it ends with a synchronisation
    control.clear()
    comm.clear()
    state.synchronize()  # no rank edited: the header alone (it carries the counts)
    assert control.ops() == ["all_gather"] and comm.ops() == []
    with torch.no_grad():
        model[0].bias.add_(1.0)
    control.clear()
    state.synchronize()  # an edit: the header, then the flags, the merge and its refresh
    assert comm.ops()[0] == "all_reduce" and "reduce_scatter" in comm.ops(), comm.ops()
    control.clear()
    comm.clear()
    state.synchronize()  # merged: nothing pending any more
    assert control.ops() == ["all_gather"] and comm.ops() == []
