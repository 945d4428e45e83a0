"""Single-process tests of the coordinator against a recording in-memory backend.

Tests drive fetch_sub_module / release_sub_module by hand: modules in forward order,
then in reverse order for "backward", then end_pass (the training step does this from
module hooks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zero3.core import Zero3Config
from zero3.core.engine import Moment, ParamStatus, Phase, ShardedModelState, TraceState
from zero3.core.params._coordinator import MAX_INFLIGHT_PREFETCHES
from zero3.testing.recording import RecordingBackend

# Several tests stop a step part-way on purpose; the trace then reports a change.
pytestmark = pytest.mark.filterwarnings("ignore:zero3. the module order changed")


def _begin(state: ShardedModelState, training: bool = True) -> None:
    """Open a step by hand, as the model's training step does."""
    state.stats.rotate()
    state.coordinator.begin_pass(training)


def _at(forward: bool) -> Moment:
    return Moment(1, Phase.TRAIN_FORWARD if forward else Phase.BACKWARD)


def _chain(sizes: list[int]) -> nn.Sequential:
    """Modules with one weight each, of the given numel (no biases)."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(n, 1, bias=False) for n in sizes))


def _state(model: nn.Module, world: int = 4, deferred: bool = False, **cfg) -> ShardedModelState:
    cfg.setdefault("param_persistence_threshold", 0)
    cfg.setdefault("max_reuse_distance", 0)
    backend = RecordingBackend(world_size=world, rank=1, deferred=deferred)
    return ShardedModelState.create(model, Zero3Config(**cfg), backend)


def _step(state: ShardedModelState, order: list[nn.Module], check=None) -> None:
    c = state.coordinator
    _begin(state, training=True)
    for phase, seq in (("fwd", order), ("bwd", order[::-1])):
        for m in seq:
            c.fetch_sub_module(m, _at(phase == "fwd"))
            if check:
                check(m)
            c.release_sub_module(m)
    c.end_pass(state.params)


def test_record_then_complete_then_prefetch():
    model = _chain([40] * 4)
    state = _state(model, prefetch_bucket_size=80)
    c, comm, layers = state.coordinator, state.comm, list(model)
    assert isinstance(comm, RecordingBackend)
    assert comm.ops() == ["broadcast"]  # rank 0's weights, one coalesced broadcast
    comm.clear()
    _step(state, layers)
    assert c.trace.state is TraceState.COMPLETE
    first = state.stats.current
    assert first.gathers == 8 and first.prefetch_gathers == 0  # on demand while recording
    assert comm.ops() == ["all_gather"] * 8
    comm.clear()

    seen = []

    def check(m):
        seen.append([sp.status for sp in state.params])

    _step(state, layers, check)
    stats = state.stats.current
    # Fetch 0 gathers layer 0 on demand and prefetches layers 1 and 2 (80 elements).
    # With max_reuse_distance=0 layer 3 is released on forward exit although backward
    # uses it next, with no fetch in between to prefetch it: the only other miss.
    assert stats.prefetch_misses == 2 and stats.prefetch_hits == 6
    on_demand = stats.prefetch_misses
    assert stats.gathers == len(comm.calls) == on_demand + stats.prefetch_gathers
    assert seen[0][1] is not ParamStatus.NOT_AVAILABLE  # layer 1 prefetched at fetch 0
    assert seen[0][2] is not ParamStatus.NOT_AVAILABLE  # and layer 2 (bucket = 80)
    assert seen[0][3] is ParamStatus.NOT_AVAILABLE  # but not layer 3
    assert all(sp.status is ParamStatus.NOT_AVAILABLE for sp in state.params)  # after the step


def test_one_collective_per_fetch_and_payload_bytes():
    model = nn.Linear(53, 1)  # 53 + 1 elements: uneven at world 4
    state = _state(model)
    _step(state, [model])
    stats = state.stats.current
    assert stats.forward_gathers == 1 and stats.backward_gathers == 1
    assert stats.forward_gathered_numel == 54
    assert stats.gather_payload_bytes == 2 * 54 * 4
    assert stats.gather_fingerprint_bytes == 2 * 16 * 4
    # 4 ranks x (14 + 1 elements aligned to 16 bytes + 16 fingerprint bytes) per gather.
    total = 2 * 4 * (64 + 16 + 16)
    assert (
        stats.gather_payload_bytes + stats.gather_padding_bytes + stats.gather_fingerprint_bytes
        == total
    )


def test_release_keeps_tied_weight_within_reuse_distance():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(10, 10, bias=False)
            self.mid = nn.Linear(10, 10, bias=False)
            self.b = nn.Linear(10, 10, bias=False)
            self.b.weight = self.a.weight

    for distance, kept in ((0, False), (1_000, True)):
        model = Tied()
        state = _state(model, max_reuse_distance=distance)
        c = state.coordinator
        order = [model.a, model.mid, model.b]
        _step(state, order)  # record
        _begin(state, training=True)
        c.fetch_sub_module(model.a, _at(True))
        c.release_sub_module(model.a)
        tied = next(sp for sp in state.params if sp.param is model.a.weight)
        assert (tied.status is ParamStatus.AVAILABLE) is kept, distance
        assert tied.owners == ["a", "b"]
        c.end_pass(state.params)
        assert tied.status is ParamStatus.NOT_AVAILABLE  # nothing whole after the step


def test_default_window_keeps_a_small_model_whole_into_backward():
    model = _chain([30] * 3)
    state = _state(model, max_reuse_distance=1_000_000_000)
    _step(state, list(model))
    c = state.coordinator
    _begin(state, training=True)
    for m in model:
        c.fetch_sub_module(m, _at(True))
        c.release_sub_module(m)
    assert all(sp.status is ParamStatus.AVAILABLE for sp in state.params)
    before = state.stats.current.gathers
    for m in reversed(model):
        c.fetch_sub_module(m, _at(False))
        c.release_sub_module(m)
    assert state.stats.current.backward_gathers == 0 and state.stats.current.gathers == before
    c.end_pass(state.params)


def test_prefetch_respects_max_live_parameters():
    model = _chain([50] * 5)
    state = _state(model, prefetch_bucket_size=1_000, max_live_parameters=120)
    c = state.coordinator
    _step(state, list(model))
    peaks = []
    _begin(state, training=True)
    for m in model:
        c.fetch_sub_module(m, _at(True))
        peaks.append(c.live_numel)
        c.release_sub_module(m)
    c.end_pass(state.params)
    assert max(peaks) <= 120
    assert max(peaks) == 100  # the own module (50) + one prefetched (50); a third would pass 120


def test_only_the_running_module_may_exceed_max_live():
    model = _chain([300, 20, 20])
    state = _state(model, max_live_parameters=100)
    c = state.coordinator
    _step(state, list(model))
    _begin(state, training=True)
    c.fetch_sub_module(model[0], _at(True))
    assert c.live_numel == 300  # the module itself, over the bound: allowed
    c.release_sub_module(model[0])
    c.fetch_sub_module(model[1], _at(True))
    assert c.live_numel <= 100  # prefetch stayed within the bound
    c.end_pass(state.params)


def test_at_most_two_prefetches_in_flight():
    torch.manual_seed(0)
    # Parameterless modules fetch nothing but still prefetch: without the bound, every
    # ReLU would start another gather.
    model = nn.Sequential(
        nn.Linear(10, 1, bias=False),
        *(nn.ReLU() for _ in range(4)),
        *(nn.Linear(10, 1, bias=False) for _ in range(4)),
    )
    state = _state(model, deferred=True, prefetch_bucket_size=10)
    c = state.coordinator
    _step(state, list(model))
    _begin(state, training=True)
    counts = []
    for m in list(model)[:5]:
        c.fetch_sub_module(m, _at(True))
        counts.append(sum(1 for sp in state.params if sp.status is ParamStatus.INFLIGHT))
        c.release_sub_module(m)
    assert counts == [1, 2, 2, 2, 2]  # one layer per prefetch; never a third in flight
    assert MAX_INFLIGHT_PREFETCHES == 2
    c.end_pass(state.params)


def test_overlap_off_still_prefetches_but_blocks():
    model = _chain([10] * 4)
    state = _state(model, overlap_comm=False, prefetch_bucket_size=10)
    _step(state, list(model))
    _step(state, list(model))
    stats = state.stats.current
    assert stats.prefetch_gathers > 0
    assert stats.blocking_prefetches == stats.prefetch_gathers


def test_invalidation_is_counted_and_warned_once():
    model = _chain([10] * 3)
    state = _state(model)
    layers = list(model)
    _step(state, layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(state, [layers[0], layers[2], layers[1]])
        assert state.stats.current.trace_invalidations == 1
        _step(state, layers)  # records again (the last trace was invalidated)
        _step(state, [layers[2], layers[1], layers[0]])
    assert len([w for w in caught if "module order changed" in str(w.message)]) == 1
    assert state.stats.total_invalidations == 2
    assert all(sp.status is ParamStatus.NOT_AVAILABLE for sp in state.params)


def test_inference_steps_keep_their_own_trace():
    model = _chain([10] * 3)
    state = _state(model)
    c = state.coordinator
    _step(state, list(model))
    train = c.traces["train"]
    _begin(state, training=False)
    for m in model:
        c.fetch_sub_module(m, _at(True))
        c.release_sub_module(m)
    c.end_pass(state.params)
    assert train.state is TraceState.COMPLETE and len(train.modules) == 6
    assert c.traces["infer"].state is TraceState.COMPLETE and len(c.traces["infer"].modules) == 3


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 60), min_size=2, max_size=7),
    order_seed=st.randoms(use_true_random=False),
    max_live=st.integers(1, 200),
    bucket=st.integers(1, 200),
)
def test_prefetch_never_raises_live_numel_above_the_bound(sizes, order_seed, max_live, bucket):
    model = _chain(sizes)
    layers = list(model)
    order_seed.shuffle(layers)
    state = _state(model, world=3, max_live_parameters=max_live, prefetch_bucket_size=bucket)
    c = state.coordinator
    for _ in range(3):
        _begin(state, training=True)
        for phase, seq in ((True, layers), (False, layers[::-1])):
            for m in seq:
                own = sum(p.numel() for p in m.parameters())
                before = c.live_numel
                c.fetch_sub_module(m, _at(phase))
                # Anything above the bound must be the running module's own gather.
                assert c.live_numel <= max(max_live, before + own)
                assert c.live_numel <= max(max_live, own) or before + own >= c.live_numel
                c.release_sub_module(m)
        c.end_pass(state.params)
        assert c.live_numel == 0
