"""The released-parameter class: ShardedParam.set_status dresses and undresses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero3.core import Zero3Config
from zero3.core.engine import Moment, ParamStatus, Phase, ShardedModelState
from zero3.core.params._params import ReleasedParameter
from zero3.testing.recording import RecordingBackend


class Scaled(nn.Parameter):
    """A user's own Parameter subclass: it must come back as itself."""


def _begin(state: ShardedModelState, training: bool = True) -> None:
    """Open a step by hand, as the model's training step does."""
    state.stats.rotate()
    state.coordinator.begin_pass(training)


def _at(forward: bool) -> Moment:
    return Moment(1, Phase.TRAIN_FORWARD if forward else Phase.BACKWARD)


def _state(model: nn.Module) -> ShardedModelState:
    config = Zero3Config(param_persistence_threshold=0, max_reuse_distance=0)
    return ShardedModelState.create(model, config, RecordingBackend(world_size=2))


def test_set_status_dresses_released_parameters_and_undresses_gathered_ones():
    model = nn.Linear(4, 3)
    model.weight = Scaled(model.weight.detach().clone())
    state = _state(model)
    weight = state.params[0]
    assert weight.status is ParamStatus.NOT_AVAILABLE
    assert isinstance(model.weight, ReleasedParameter) and isinstance(model.weight, Scaled)
    assert model.weight.shape == (3, 4)  # metadata still answers
    with pytest.raises(RuntimeError, match="parameter 'weight' is partitioned"):
        model.weight.sum()

    c = state.coordinator
    _begin(state, training=True)
    c.fetch_sub_module(model, _at(True))
    assert weight.status is ParamStatus.AVAILABLE
    assert type(model.weight) is Scaled  # the user's class, not a released one
    assert torch.isfinite(model.weight.sum())
    c.release_sub_module(model)
    c.end_pass(state.params)
    assert type(model.weight).__name__ == "ReleasedScaled"

    weight.set_status(ParamStatus.INFLIGHT)  # not whole either: stays dressed
    assert isinstance(model.weight, ReleasedParameter)
    weight.set_status(ParamStatus.NOT_AVAILABLE)


def test_status_is_read_only():
    state = _state(nn.Linear(4, 3))
    with pytest.raises(AttributeError):
        state.params[0].status = ParamStatus.AVAILABLE  # type: ignore[misc]
