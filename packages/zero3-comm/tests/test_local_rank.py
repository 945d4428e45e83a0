"""Device choice follows the rank on the node, never the global rank."""

from __future__ import annotations

import pytest
import torch

from zero3.comm import BackendUnavailableError, HCCLBackend, NCCLBackend
from zero3.comm._launch import local_device_index, local_rank

_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "RANK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)


def test_second_node_ranks_pick_their_local_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Global rank 3 of two nodes with two devices each: local rank 1, device 1.
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_rank() == (1, "LOCAL_RANK")
    assert local_device_index(2, "nccl") == 1


def test_the_global_rank_alone_chooses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert local_rank() is None
    assert local_device_index(4, "nccl") is None  # the caller keeps the current device


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"])
def test_mpi_and_slurm_launchers_give_the_local_rank(
    monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.setenv(var, "1")
    monkeypatch.setenv("RANK", "5")
    assert local_device_index(2, "hccl") == 1
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's variable wins
    assert local_device_index(2, "hccl") == 0


def test_one_visible_device_per_rank_is_device_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")  # CUDA_VISIBLE_DEVICES gave this rank one GPU
    assert local_device_index(1, "nccl") == 0


def test_more_ranks_than_devices_on_a_node_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The old choice (LOCAL_RANK modulo devices) put local ranks 0 and 2 on one GPU.
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError) as info:
        local_device_index(2, "nccl")
    message = str(info.value)
    assert "local rank 2 (LOCAL_RANK=2)" in message and "only 2 devices" in message
    assert "--nproc-per-node 2" in message and "CUDA_VISIBLE_DEVICES" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_backends_refuse_to_start_without_their_device() -> None:
    with pytest.raises(BackendUnavailableError, match="nccl backend cannot run here"):
        NCCLBackend()
    with pytest.raises(BackendUnavailableError, match="hccl backend cannot run here"):
        HCCLBackend()
