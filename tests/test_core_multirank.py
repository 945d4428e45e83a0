"""zero3.core across real ranks (gloo): shards, gathers, trace, fingerprints, memory.

These drive the coordinator by hand (modules in forward order, then reversed for
backward), as the hooks package does from module hooks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero3.comm import GlooBackend
from zero3.core import FingerprintMismatchError, Zero3Config, gathered_parameters, local_shard
from zero3.core.engine import Moment, ParamStatus, Phase, ShardedModelState, TraceState

pytestmark = pytest.mark.multirank

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _begin(state: ShardedModelState, training: bool = True) -> None:
    """Open a step by hand, as the model's training step does."""
    state.stats.rotate()
    state.coordinator.begin_pass(training)


def _at(forward: bool) -> Moment:
    return Moment(1, Phase.TRAIN_FORWARD if forward else Phase.BACKWARD)


def _walk(state: ShardedModelState, modules, x=None):
    """One step: forward fetch/compute/release per module, then backward order."""
    c = state.coordinator
    _begin(state, training=True)
    outs = []
    for m in modules:
        c.fetch_sub_module(m, _at(True))
        if x is not None:
            x = m(x)
            outs.append(x)
        c.release_sub_module(m)
    for m in reversed(modules):
        c.fetch_sub_module(m, _at(False))
        c.release_sub_module(m)
    c.end_pass(state.params)
    return x


def _round_trip(dtype: torch.dtype) -> dict[str, object]:
    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.uneven = nn.Parameter(torch.randn(53, dtype=dtype))  # 53 at world 4
            self.tiny = nn.Parameter(torch.randn(3, dtype=dtype))  # fewer than the ranks
            self.matrix = nn.Parameter(torch.randn(7, 5, dtype=dtype))

    model = Odd()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = ShardedModelState.create(model, Zero3Config(param_persistence_threshold=0), comm)
    for sp in state.params:
        assert sp.status is ParamStatus.NOT_AVAILABLE
        assert sp.param.untyped_storage().nbytes() == 0
        assert sp.shard_numel * comm.world_size >= sp.numel
        start, stop = sp.valid_range(comm.rank)
        assert torch.equal(local_shard(sp.param), reference[sp.name].reshape(-1)[start:stop])
    with gathered_parameters(model.parameters()):
        for name, p in model.named_parameters():
            assert p.dtype == dtype
            assert torch.equal(p.detach(), reference[name]), name
    assert all(sp.param.untyped_storage().nbytes() == 0 for sp in state.params)
    return {"gathers": state.stats.current.gathers + state.stats.last.gathers}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shard_gather_round_trip(worker_pool, world_size, dtype):
    worker_pool(world_size).run(_round_trip, dtype)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.use_b = True

    def order(self):
        return [self.a, self.b, self.c] if self.use_b else [self.a, self.c]


def _trace_lifecycle() -> dict[str, object]:
    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)
    model = Branchy()
    reference = Branchy()
    reference.load_state_dict(model.state_dict())
    state = ShardedModelState.create(
        model, Zero3Config(param_persistence_threshold=0, max_reuse_distance=0), comm
    )
    c = state.coordinator
    x = torch.randn(4, 8)
    log = []
    for step in range(6):
        use_b = step < 3  # every rank changes its control flow at step 3
        model.use_b = reference.use_b = use_b
        out = _walk(state, model.order(), x)
        expected = x
        for m in reference.order():
            expected = m(expected)
        assert torch.equal(out, expected), step
        stats = state.stats.current
        log.append(
            (
                c.traces["train"].state.value,
                stats.trace_invalidations,
                stats.gathers,
                stats.prefetch_hits,
            )
        )
    return {"log": log}


@pytest.mark.parametrize("world_size", [2, 4])
def test_trace_record_complete_and_uniform_invalidation(worker_pool, world_size):
    results = worker_pool(world_size).run(_trace_lifecycle)
    log = results[0]["log"]
    states = [entry[0] for entry in log]
    invalidations = [entry[1] for entry in log]
    assert states[0] == TraceState.COMPLETE.value  # recorded over step 0
    assert invalidations == [0, 0, 0, 1, 0, 0]  # step 3 departs from the trace
    assert states[3] == TraceState.INVALID.value
    assert states[4] == TraceState.COMPLETE.value  # re-recorded
    assert all(entry[2] > 0 for entry in log)  # gathers really happened
    assert log[1][3] > 0 and log[5][3] > 0  # prefetching works with a complete trace
    assert all(r == results[0] for r in results)  # every rank saw the same


def _gathered_parameters_modifier() -> dict[str, object]:
    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)
    model = nn.Linear(9, 5)
    original = model.weight.detach().clone()
    state = ShardedModelState.create(model, Zero3Config(param_persistence_threshold=0), comm)
    # Without a modifier, edits are discarded.
    with gathered_parameters([model.weight]):
        model.weight.data.add_(100.0)
    with gathered_parameters(model.weight):
        unchanged = torch.equal(model.weight.detach(), original)
    # With modifier_rank=last, that rank's edit reaches everyone's shard.
    src = comm.world_size - 1
    with gathered_parameters(model.parameters(), modifier_rank=src):
        if comm.rank == src:
            model.weight.data.fill_(7.0)
            model.bias.data.fill_(-1.0)
        else:
            model.weight.data.fill_(123.0)  # ignored: not the modifier
    sp = next(s for s in state.params if s.param is model.weight)
    shard_ok = bool((local_shard(model.weight) == 7.0).all())
    with gathered_parameters(model.parameters()):
        after = (model.weight.detach().clone(), model.bias.detach().clone())
    released = model.weight.untyped_storage().nbytes() == 0
    return {
        "unchanged": unchanged,
        "weight_all_7": bool((after[0] == 7.0).all()),
        "bias_all_-1": bool((after[1] == -1.0).all()),
        "shard_ok": shard_ok and sp.status is ParamStatus.NOT_AVAILABLE,
        "released": released,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_parameters_with_and_without_modifier(worker_pool, world_size):
    for result in worker_pool(world_size).run(_gathered_parameters_modifier):
        assert all(result.values()), result


class Twins(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(6, 6)
        self.right = nn.Linear(6, 6)  # same size: gathers of the two have equal bytes


class NoHostChannel(GlooBackend):
    """gloo without a host channel: gathers are checked by their in-band fingerprints."""

    def host_channel(self) -> None:
        return None


def _different_modules_per_rank(headers: bool) -> str:
    comm = (GlooBackend if headers else NoHostChannel)(timeout_s=20)
    model = Twins()
    state = ShardedModelState.create(model, Zero3Config(param_persistence_threshold=0), comm)
    c = state.coordinator
    _begin(state, training=True)
    chosen = model.left if comm.rank % 2 == 0 else model.right
    with pytest.raises(FingerprintMismatchError) as info:
        c.fetch_sub_module(chosen, _at(True))
        c.verify_gathers()  # without headers: the batched in-band check
    return str(info.value)


@pytest.mark.parametrize("headers", [True, False], ids=["headers", "in-band"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_fetching_different_same_sized_modules_fail_with_fingerprint_error(
    worker_pool, world_size, headers
):
    # With a host channel the headers catch it before the gather; without one the
    # fingerprints inside the gathered bytes do. Both name each rank's module and the fix.
    results = worker_pool(world_size).run(_different_modules_per_rank, headers)
    for rank, message in enumerate(results):
        if headers:
            assert "ranks are about to issue different collectives" in message, rank
            assert "rank 0: gathered a module's parameters for module 'left'" in message
            assert "rank 1: gathered a module's parameters for module 'right'" in message
        else:
            assert "ranks gathered different parameters" in message, rank
            assert "rank 0: module 'left'" in message
            assert "rank 1: module 'right'" in message
        assert "set_leaf_modules" in message  # says how to fix it


def _memory_drops() -> dict[str, object]:
    comm = GlooBackend(timeout_s=20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state = ShardedModelState.create(
        model, Zero3Config(param_persistence_threshold=0, max_reuse_distance=0), comm
    )
    c = state.coordinator
    x = torch.randn(3, 64, requires_grad=True)
    _begin(state, training=True)
    h = x
    during = []
    for m in model:
        c.fetch_sub_module(m, _at(True))
        h = m(h)
        c.release_sub_module(m)
        # Autograd saved the Linear weights for backward; they share the parameters'
        # storages, so the released storages must really be empty now.
        during.append(sum(p.untyped_storage().nbytes() for p in model.parameters()))
    shard_bytes = sum(sp.shard.untyped_storage().nbytes() for sp in state.params)
    for m in reversed(model):  # backward gathers again before autograd reads them
        c.fetch_sub_module(m, _at(False))
    h.sum().backward()
    grad_ok = x.grad is not None and bool(torch.isfinite(x.grad).all())
    for m in model:
        c.release_sub_module(m)
    c.end_pass(state.params)
    after = sum(p.untyped_storage().nbytes() for p in model.parameters())
    return {
        "during": during,
        "after": after,
        "full": full_bytes,
        "shard_bytes": shard_bytes,
        "grad_ok": grad_ok,
        "gathers": state.stats.current.gathers,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_released_storages_are_really_freed(worker_pool, world_size):
    for result in worker_pool(world_size).run(_memory_drops):
        assert result["during"] == [0, 0, 0], result
        assert result["after"] == 0
        assert result["grad_ok"]
        assert result["gathers"] > 0
        # Each rank keeps 1/N of the parameters (plus at most N-1 padding elements each).
        assert result["shard_bytes"] <= result["full"] / world_size + 2 * 4 * world_size
