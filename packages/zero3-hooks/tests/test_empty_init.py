"""empty_init and construct-time sharding in one process (a world of one, or a simulated
rank of a larger world)."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from zero3.comm import create_backend
from zero3.core import SafetensorsSource, Zero3Config, local_shard
from zero3.core.engine import sharded_state
from zero3.hooks import empty_init, shard_module
from zero3.testing.recording import RecordingBackend


class Rotary(nn.Module):
    """A computed buffer next to parameters, and a weight tied to a child's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), persistent=False
        )
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def test_empty_init_puts_parameters_on_meta_and_keeps_buffers_real():
    with empty_init():
        model = Rotary()
    assert all(p.is_meta for p in model.parameters())
    assert not model.inv_freq.is_meta
    assert torch.equal(model.inv_freq, Rotary().inv_freq)
    assert model.head.weight is model.emb.weight
    assert not model.frozen.weight.requires_grad
    after = nn.Linear(2, 2)  # the hook is gone after the block
    assert not after.weight.is_meta


def _net():
    return nn.Sequential(
        nn.Linear(6, 12), nn.LayerNorm(12), nn.MultiheadAttention(12, 3), nn.Linear(12, 5)
    )


def test_world_of_one_meta_reset_parameters_equals_eager_construction():
    torch.manual_seed(0)
    eager = _net()
    torch.manual_seed(0)
    with empty_init():
        model = _net()
    shard_module(model, Zero3Config(), comm=create_backend("loopback"))
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert not p.is_meta and torch.equal(p.detach(), q.detach()), name
    # The draws after sharding continue where eager construction's would.
    assert torch.equal(torch.rand(3), (torch.manual_seed(0), _net(), torch.rand(3))[2])


def _checkpoint(tmp_path):
    torch.manual_seed(1)
    weights = {
        k: v.clone()
        for k, v in nn.Sequential(nn.Linear(7, 9), nn.Linear(9, 3)).state_dict().items()
    }
    path = tmp_path / "w.safetensors"
    save_file(weights, str(path))
    return weights, path


class Recorded(SafetensorsSource):
    """Logs the ranges read."""

    def __init__(self, path):
        super().__init__(path)
        self.reads = []

    def read_flat(self, key, start, stop):
        self.reads.append((key, start, stop))
        return super().read_flat(key, start, stop)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_rank_reads_only_its_own_elements(tmp_path, rank):
    weights, path = _checkpoint(tmp_path)
    source = Recorded(path)
    with empty_init():
        model = nn.Sequential(nn.Linear(7, 9), nn.Linear(9, 3))
    comm = RecordingBackend(world_size=3, rank=rank)
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm, checkpoint=source)
    for sp in sharded_state(model).params:
        start, stop = sp.valid_range(rank)
        want = weights[sp.name].reshape(-1)[start:stop]
        assert torch.equal(local_shard(sp.param), want), sp.name
        assert sp.param.untyped_storage().nbytes() == 0  # never whole here
    assert sorted(source.reads) == sorted(
        (sp.name, *sp.valid_range(rank)) for sp in sharded_state(model).params if sp.local_numel
    )


def test_checkpoint_and_param_init_fn_are_exclusive(tmp_path):
    _, path = _checkpoint(tmp_path)
    with empty_init():
        model = nn.Sequential(nn.Linear(7, 9), nn.Linear(9, 3))
    with pytest.raises(ValueError, match="not both"):
        shard_module(model, comm=create_backend("loopback"), checkpoint=path, param_init_fn=print)


class Replacing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))

    def reset_parameters(self) -> None:
        self.weight = nn.Parameter(torch.zeros(3))


def test_an_initialiser_that_replaces_its_parameter_is_an_error():
    with empty_init():
        model = Replacing()
    with pytest.raises(ValueError, match=r"\(Replacing\) replaced parameter\(s\) \['weight'\]"):
        shard_module(model, comm=create_backend("loopback"))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)


def test_meta_buffers_come_from_the_checkpoint(tmp_path):
    torch.manual_seed(2)
    source = Normed()
    source.norm.running_mean.uniform_()
    save_file(source.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = Normed()
    assert model.norm.running_mean.is_meta
    shard_module(model, comm=create_backend("loopback"), checkpoint=tmp_path)
    for key, value in source.state_dict().items():
        got = model.state_dict()[key]
        assert not got.is_meta and torch.equal(got, value), key
