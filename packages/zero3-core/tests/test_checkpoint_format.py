"""The checkpoint format in one process: boxes, checked reads, restricted unpickling."""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from zero3.core import (
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from zero3.core.engine import (
    CheckpointLoadPlanner,
    CheckpointReader,
    CheckpointStorageReader,
    CheckpointStorageWriter,
    quiet_dcp_warnings,
)
from zero3.core.files._boxes import flat_boxes
from zero3.core.files._reader import nest
from zero3.core.state_dict._sharded import _rank_boxes


def _read_boxes(tensor: torch.Tensor, boxes: list) -> list[int]:
    out: list[int] = []
    for offsets, sizes in boxes:
        view = tensor
        for dim, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
            view = view.narrow(dim, o, s)
        out += view.reshape(-1).tolist()
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_boxes_are_the_range_in_order(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_boxes(start, stop, tuple(shape))
    assert _read_boxes(torch.arange(numel).view(shape), boxes) == list(range(start, stop))
    assert len(boxes) <= 2 * (len(shape) - 1) + 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3), st.integers(1, 9))
def test_every_rank_boxes_tile_the_tensor(shape, world):
    numel = math.prod(shape)
    per_rank = _rank_boxes(tuple(shape), world)
    assert len(per_rank) == world
    flat = [i for boxes in per_rank for i in _read_boxes(torch.arange(numel).view(shape), boxes)]
    assert flat == list(range(numel))


def test_a_scalar_is_one_box():
    assert flat_boxes(0, 1, ()) == [((), ())]
    assert flat_boxes(1, 1, ()) == []


def test_nest_rebuilds_lists_and_dicts():
    flat = {("a", "0"): 1, ("b", 0): "x", ("b", 1): "y", ("c", 0, "k"): 2.5}
    assert nest(flat) == {"a": {"0": 1}, "b": ["x", "y"], "c": [{"k": 2.5}]}


def _save(path: Path, state: dict) -> None:
    with quiet_dcp_warnings():
        dcp.save(state, storage_writer=CheckpointStorageWriter(path), no_dist=True)


def _load(path: Path, state: dict) -> dict:
    with quiet_dcp_warnings():
        dcp.load(
            state, storage_reader=CheckpointStorageReader(path),
            planner=CheckpointLoadPlanner(), no_dist=True,
        )  # fmt: skip
    return state


def test_round_trip_and_checksum_records(tmp_path):
    state = {"w": torch.arange(12.0).view(3, 4), "meta": {"step": 3, "name": "x", "p": (1, 2)}}
    _save(tmp_path, state)
    records = list(tmp_path.glob("*zero3-checksums.json"))
    assert [p.name for p in records] == ["__0_zero3-checksums.json"]
    got = _load(tmp_path, {"w": torch.zeros(3, 4), "meta": {"step": 0, "name": "", "p": None}})
    assert torch.equal(got["w"], state["w"])
    assert got["meta"] == {"step": 3, "name": "x", "p": (1, 2)}


def test_flipped_and_truncated_bytes_are_caught(tmp_path):
    _save(tmp_path, {"w": torch.arange(4096.0)})
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(BaseException, match="fail their CRC-32 check") as info:
        _load(tmp_path, {"w": torch.zeros(4096)})
    assert str(tmp_path) in str(info.value)
    data.write_bytes(bytes(raw[:100]))
    with pytest.raises(BaseException, match=r"__0_0\.distcp is truncated"):
        _load(tmp_path, {"w": torch.zeros(4096)})


def test_missing_checksum_record_is_refused(tmp_path):
    _save(tmp_path, {"w": torch.ones(3)})
    (tmp_path / "__0_zero3-checksums.json").unlink()
    with pytest.raises(BaseException, match="no checksum recorded"):
        _load(tmp_path, {"w": torch.zeros(3)})


class _Evil:
    """Unpickling it creates a directory: proof that code ran."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.makedirs, (self.flag,))


def test_values_and_index_never_unpickle_code(tmp_path):
    flag = tmp_path / "code-ran"
    ckpt = tmp_path / "ckpt"
    _save(ckpt, {"w": torch.ones(2), "evil": _Evil(str(flag))})
    assert not flag.exists()
    with pytest.raises(BaseException, match="does not load as plain data"):
        _load(ckpt, {"w": torch.zeros(2), "evil": None})
    assert not flag.exists()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil(str(flag))))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata index cannot be read"):
        CheckpointStorageReader(ckpt).read_metadata()
    assert not flag.exists()


def test_reader_refuses_missing_partial_and_foreign(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=f"^no checkpoint at {tmp_path / 'x'}"):
        CheckpointReader(tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointNotFoundError, match="it is a file"):
        CheckpointReader(tmp_path / "file")
    (tmp_path / "partial").mkdir()
    with pytest.raises(IncompleteCheckpointError, match=r"^incomplete checkpoint .*no \.metadata"):
        CheckpointReader(tmp_path / "partial")
    _save(tmp_path / "plain", {"model": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointVersionError, match=r"^not a zero3 checkpoint"):
        CheckpointReader(tmp_path / "plain")
    _save(tmp_path / "v2", {"zero3": {"format_version": 2}, "model": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointVersionError, match=r"^incompatible checkpoint .*format 2"):
        CheckpointReader(tmp_path / "v2")


def test_reader_reads_flat_ranges_and_sections(tmp_path):
    w = torch.randn(5, 7, 3)
    state = {
        "zero3": {"format_version": 1, "info": {"aliases": [["b", "a"]]}},
        "model": {"a": w, "b": w.clone(), "scalar": torch.tensor(2.5)},
        "extra": {"lst": [torch.ones(2), torch.zeros(1)], "n": 4},
    }
    _save(tmp_path, state)
    reader = CheckpointReader(tmp_path)
    assert reader.entries() == {
        "a": ((5, 7, 3), torch.float32),
        "b": ((5, 7, 3), torch.float32),
        "scalar": ((), torch.float32),
    }
    flat = w.reshape(-1)
    for start, stop in [(0, 105), (10, 11), (20, 86), (50, 50)]:
        assert torch.equal(reader.read_flat("a", start, stop), flat[start:stop])
    assert reader.read_flat("scalar", 0, 1).item() == 2.5
    extra = reader.read_section("extra")
    assert extra["n"] == 4 and torch.equal(extra["lst"][0], torch.ones(2))
    template = reader.template("extra")
    assert template["n"] is None and template["lst"][1].shape == (1,)
    with pytest.raises(ValueError, match="has 105 elements"):
        reader.read_flat("a", 0, 106)
