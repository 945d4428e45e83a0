"""Which launcher started this process, and where on its node it runs (local rank, device)."""

from __future__ import annotations

import os

import torch

__all__ = [
    "TORCH_LAUNCH_VARS",
    "default_device_type",
    "launched_by_mpi",
    "launched_by_torch",
    "local_device_index",
    "local_rank",
]

#: Set by torchrun (and zero3's own launchers): the rendezvous of ``torch.distributed``.
TORCH_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Set by mpiexec: Open MPI, MPICH's hydra, PMIx launchers, Intel MPI.
MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
#: Where launchers put a process's rank *on its node*, most specific first: torchrun (and
#: zero3's own launchers), Open MPI, MPICH's hydra, Slurm's srun.
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def launched_by_torch() -> bool:
    """Torchrun (or a launcher like it) set every rendezvous variable."""
    return all(v in os.environ for v in TORCH_LAUNCH_VARS)


def launched_by_mpi() -> bool:
    """An MPI launcher (mpiexec, srun --mpi) started this process."""
    return any(v in os.environ for v in MPI_LAUNCH_VARS)


def default_device_type() -> str:
    """The accelerator this process would use: ``"cuda"``, ``"npu"`` or ``"cpu"``."""
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)  # present only when torch_npu is loaded
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def local_rank() -> tuple[int, str] | None:
    """This process's rank on its node, and the variable it was read from; None if no
    launcher said (a single process, or a launcher that sets none of them).

    Note:
        Device choice and anything kept per node must use this, never the global
        ``RANK``: on the second node of two with 8 GPUs each, global ranks 8-15 are
        local ranks 0-7.
    """
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value), var
    return None


def local_device_index(device_count: int, backend: str) -> int | None:
    """The accelerator index this process should use, from its local rank.

    Args:
        device_count: Devices visible to this process.
        backend: The backend asking (for the error message).

    Returns:
        The local rank when it names a visible device; 0 when the process sees a single
        device (a launcher gave each rank its own, e.g. ``CUDA_VISIBLE_DEVICES`` per rank);
        None when no launcher set a local rank (the caller keeps the current device).

    Raises:
        ValueError: The local rank has no device of its own: more ranks were started on
            this node than it has visible devices (two ranks on one device would fail
            later inside NCCL/HCCL, or silently share it).
    """
    found = local_rank()
    if found is None:
        return None
    rank, var = found
    if device_count == 1:
        return 0
    if 0 <= rank < device_count:
        return rank
    raise ValueError(
        f"zero3.comm {backend}: this process is local rank {rank} ({var}={rank}) but only "
        f"{device_count} devices are visible on its node; start at most {device_count} "
        f"ranks per node (torchrun --nproc-per-node {device_count}), or give each rank "
        "its own device (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES)"
    )
