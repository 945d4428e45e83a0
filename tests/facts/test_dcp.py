"""What torch.distributed.checkpoint (DCP) does that zero3's checkpoints build on
(docs/facts.rst, "Checkpoints"), in one process (DCP runs without a process group)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

# Without a process group DCP says it assumes one process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_fact_dcp_exception():
    """fact-dcp-exception: ``CheckpointException`` is a ``BaseException`` but not an
    ``Exception``: ``except Exception`` does not catch a failed DCP call."""
    assert issubclass(CheckpointException, BaseException)
    assert not issubclass(CheckpointException, Exception)


class _Order(dcp.FileSystemWriter):
    """Records the order of DCP's calls into its writer."""

    calls: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        _Order.calls.append("write_data")
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        _Order.calls.append("finish")
        assert not (Path(self.path) / ".metadata").exists()
        super().finish(metadata, results)


def test_fact_dcp_metadata_last(tmp_path):
    """fact-dcp-metadata-last: DCP writes the data files first and its ``.metadata``
    index last, in ``finish``: a directory without it is an unfinished save."""
    _Order.calls = []
    dcp.save({"w": torch.arange(8.0)}, storage_writer=_Order(tmp_path))
    assert _Order.calls == ["write_data", "finish"]
    assert (tmp_path / ".metadata").is_file()


def test_fact_dcp_pickled_metadata(tmp_path):
    """fact-dcp-pickled-metadata: ``.metadata`` is a pickle, read with ``pickle.load``."""
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    assert type(metadata).__module__ == "torch.distributed.checkpoint.metadata"
    assert "w" in metadata.state_dict_metadata


def test_fact_dcp_no_checksum(tmp_path):
    """fact-dcp-no-checksum: DCP's data files carry no checksum: a changed byte loads
    without an error, as a changed value."""
    saved = torch.full((1024,), 1.0)
    dcp.save({"w": saved}, checkpoint_id=tmp_path)
    (data,) = tmp_path.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    at = raw.find(saved.numpy().tobytes()[:16])  # the tensor's bytes are stored as they are
    assert at >= 0
    raw[at + 3] ^= 0x01
    data.write_bytes(bytes(raw))
    loaded = {"w": torch.zeros(1024)}
    dcp.load(loaded, checkpoint_id=tmp_path)
    assert not torch.equal(loaded["w"], saved)
    assert int((loaded["w"] != saved).sum()) == 1
