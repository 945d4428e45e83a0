"""The built-in backends, registered through the same hook plugins use."""

from __future__ import annotations

from zero3.comm._registry import BackendRegistry, hookimpl


@hookimpl(tryfirst=True)
def zero3_comm_register_backends(registry: BackendRegistry) -> None:
    """Register gloo, nccl, hccl, mpi and cupy-nccl (built-ins go first)."""
    # Imports are local: each module imports its optional library lazily anyway, and
    # keeping them here makes the registry the only place that knows every backend.
    from zero3.comm._cupy import CupyNCCLBackend
    from zero3.comm._hccl import HCCLBackend
    from zero3.comm._mpi import MPIBackend
    from zero3.comm._nccl import NCCLBackend
    from zero3.comm._torch_dist import GlooBackend

    registry.register("gloo", GlooBackend)
    registry.register("nccl", NCCLBackend)
    registry.register("hccl", HCCLBackend)
    registry.register("mpi", MPIBackend)
    registry.register("cupy-nccl", CupyNCCLBackend)
