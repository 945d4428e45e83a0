"""Which launcher started this process: the environment variables each one sets."""

from __future__ import annotations

import os

__all__ = ["TORCH_LAUNCH_VARS", "launched_by_mpi", "launched_by_torch"]

#: Set by torchrun (and zero3's own launchers): the rendezvous of ``torch.distributed``.
TORCH_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Set by mpiexec: Open MPI, MPICH's hydra, PMIx launchers, Intel MPI.
MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_torch() -> bool:
    """Torchrun (or a launcher like it) set every rendezvous variable."""
    return all(v in os.environ for v in TORCH_LAUNCH_VARS)


def launched_by_mpi() -> bool:
    """An MPI launcher (mpiexec, srun --mpi) started this process."""
    return any(v in os.environ for v in MPI_LAUNCH_VARS)
