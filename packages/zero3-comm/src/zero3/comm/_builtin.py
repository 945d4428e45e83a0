"""The built-in backends, registered through the same hook plugins use."""

from __future__ import annotations

from zero3.comm._cupy import CupyNCCLBackend
from zero3.comm._hccl import HCCLBackend
from zero3.comm._mpi import MPIBackend
from zero3.comm._nccl import NCCLBackend
from zero3.comm._plugins import BackendRegistry, hookimpl
from zero3.comm._torch_dist import GlooBackend


@hookimpl(tryfirst=True)
def zero3_comm_register_backends(registry: BackendRegistry) -> None:
    """Register gloo, nccl, hccl, mpi and cupy-nccl (built-ins go first)."""
    registry.register("gloo", GlooBackend)
    registry.register("nccl", NCCLBackend)
    registry.register("hccl", HCCLBackend)
    registry.register("mpi", MPIBackend)
    registry.register("cupy-nccl", CupyNCCLBackend)
