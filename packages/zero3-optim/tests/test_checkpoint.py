"""Checkpoints in one process (the loopback backend, a world of one): the API, the
atomic publication, consolidation and its command."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from zero3.comm import create_backend
from zero3.core import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    Zero3Config,
)
from zero3.core.engine import CheckpointReader
from zero3.hooks import full_state_dict, shard_module
from zero3.optim import (
    PartitionedOptimizer,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from zero3.optim import _checkpoint as checkpoint_module
from zero3.optim._consolidate import main, parse_size


class _Config:
    """Stands in for a transformers config: anything with ``to_json_string``."""

    def to_json_string(self) -> str:
        return json.dumps({"model_type": "toy", "hidden_size": 12})


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.out = nn.Linear(12, 6)
        self.back = nn.Linear(6, 12, bias=False)
        self.back.weight = self.inp.weight  # tied: one parameter under two names
        self.register_buffer("scale", torch.full((12,), 2.0))
        self.config = _Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.inp.bias.dtype)
        return self.out(torch.tanh(self.inp(x) * self.scale.to(x.dtype)) + self.back(x)).float()


def _build(seed=0, dtype=None, flat=False, optimizer=torch.optim.AdamW):
    torch.manual_seed(seed)
    model = Toy()
    shard_module(
        model,
        Zero3Config(param_persistence_threshold=0, param_dtype=dtype),
        comm=create_backend("loopback"),
    )
    return model, PartitionedOptimizer(model, optimizer, lr=1e-2, flat=flat)


def _train(model, opt, steps, first):
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("dtype", "flat"), [(None, False), (torch.bfloat16, True)])
def test_resume_is_exact(tmp_path, dtype, flat):
    model, opt = _build(dtype=dtype, flat=flat)
    _train(model, opt, 3, 0)
    save_checkpoint(tmp_path / "ckpt", model, opt, extra={"step": 3})
    straight = _train(model, opt, 3, 3)
    fresh, fresh_opt = _build(seed=1, dtype=dtype, flat=flat)
    extra = load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    assert extra == {"step": 3}
    assert _train(fresh, fresh_opt, 3, 3) == straight
    want, got = full_state_dict(model), full_state_dict(fresh)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_state_dict_keeps_torchs_contract():
    model, opt = _build()
    _train(model, opt, 1, 0)
    sd = opt.state_dict()
    assert {"state", "param_groups"} <= sd.keys()
    assert sd["param_groups"][0]["lr"] == 1e-2
    _, fresh_opt = _build(seed=1)
    fresh_opt.load_state_dict(sd)
    assert fresh_opt.state_dict()["param_groups"] == sd["param_groups"]


class KeepsAList(torch.optim.SGD):
    """An optimizer with state zero3 cannot reslice."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["history"] = [1.0, 2.0]


def test_unreshardable_optimizer_state_is_named():
    model, opt = _build(optimizer=KeepsAList)
    _train(model, opt, 1, 0)
    with pytest.raises(
        ValueError, match=r"keeps state 'history' of parameter 'inp\.weight' as a list"
    ):
        opt.sharded_state_dict()


def test_optimizer_state_must_be_in_the_checkpoint(tmp_path):
    model, opt = _build()
    save_checkpoint(tmp_path / "weights", model)
    with pytest.raises(CheckpointMismatchError, match=r"^no optimizer state in checkpoint"):
        load_checkpoint(tmp_path / "weights", model, opt)
    load_checkpoint(tmp_path / "weights", model)  # weights only


def test_publication_replaces_atomically_and_refuses_strangers(tmp_path):
    model, opt = _build()
    target = tmp_path / "ckpt"
    save_checkpoint(target, model, opt, extra={"n": 1})
    save_checkpoint(target, model, opt, extra={"n": 2})  # swapped with RENAME_EXCHANGE
    assert load_checkpoint(target, model, opt) == {"n": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left beside it
    stale = tmp_path / ".ckpt.zero3-saving-0123"
    stale.mkdir()
    save_checkpoint(target, model, opt, extra={"n": 3})
    assert not stale.exists()  # an interrupted save's leftovers go at the next save
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="holds files that are not part of a checkpoint"):
        save_checkpoint(tmp_path / "mine", model, opt)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "afile").write_text("")
    with pytest.raises(CheckpointError, match="a file is in the way"):
        save_checkpoint(tmp_path / "afile", model, opt)


def test_a_link_keeps_pointing_at_the_new_checkpoint(tmp_path):
    model, opt = _build()
    save_checkpoint(tmp_path / "real", model, opt, extra={"n": 1})
    (tmp_path / "link").symlink_to(tmp_path / "real")
    save_checkpoint(tmp_path / "link", model, opt, extra={"n": 2})
    assert (tmp_path / "link").is_symlink()
    assert load_checkpoint(tmp_path / "link", model, opt) == {"n": 2}


def test_without_rename_exchange_two_renames_and_a_clear_hint(tmp_path, monkeypatch):
    model, opt = _build()
    target = tmp_path / "ckpt"
    save_checkpoint(target, model, opt, extra={"n": 1})
    monkeypatch.setattr(checkpoint_module, "_exchange", lambda a, b: False)
    save_checkpoint(target, model, opt, extra={"n": 2})
    assert load_checkpoint(target, model, opt) == {"n": 2}
    # A crash between the two renames: the previous checkpoint sits aside.
    os.rename(target, tmp_path / ".ckpt.zero3-old-abc")
    with pytest.raises(CheckpointNotFoundError, match=r"previous checkpoint is at .*zero3-old-abc"):
        load_checkpoint(target, model, opt)


def test_extra_holds_plain_data_only(tmp_path):
    model, opt = _build()
    with pytest.raises(TypeError, match=r"extra\['a'\]\[1\] is a set"):
        save_checkpoint(tmp_path / "c", model, opt, extra={"a": [1, {2}]})
    with pytest.raises(TypeError, match="dict keys must be strings"):
        save_checkpoint(tmp_path / "c", model, opt, extra={"a": {1: 2}})


def test_parse_size():
    assert parse_size("40KB") == 40_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max shard size"):
        parse_size("lots")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_consolidate_writes_the_transformers_layout(tmp_path, dtype):
    model, opt = _build(dtype=dtype)
    _train(model, opt, 2, 0)
    save_checkpoint(tmp_path / "ckpt", model, opt)
    expected = full_state_dict(model)
    one = consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "one")
    assert [p.name for p in one] == ["model.safetensors", "config.json"]
    weights = load_file(tmp_path / "one" / "model.safetensors")
    assert weights.keys() == expected.keys()  # the tied name too, as state_dict() has it
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config == {"architectures": ["Toy"], "hidden_size": 12, "model_type": "toy"}
    # Several files and an index; fp32 output comes from the fp32 masters.
    many = consolidate_checkpoint(
        tmp_path / "ckpt", tmp_path / "many", dtype="float32", max_shard_size=300
    )
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len({p.name for p in many if p.suffix == ".safetensors"}) > 1
    assert index["weight_map"].keys() == expected.keys()
    reader = CheckpointReader(tmp_path / "ckpt")
    for key, name in index["weight_map"].items():
        with safe_open(tmp_path / "many" / name, "pt") as f:
            got = f.get_tensor(key)
        assert got.dtype == torch.float32
        assert torch.equal(got, reader.read_tensor(reader.source_fqn(key)))
        if dtype is not None and key.endswith("weight"):
            assert reader.source_fqn(key).startswith("optim.master.")


def test_consolidate_command(tmp_path, capsys):
    model, opt = _build()
    save_checkpoint(tmp_path / "ckpt", model, opt)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dtype", "float16"]) == 0
    assert load_file(tmp_path / "out" / "model.safetensors")["inp.bias"].dtype == torch.float16
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zero3-consolidate: error: no checkpoint at {tmp_path / 'nowhere'}")
