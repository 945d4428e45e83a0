"""zero3.comm: one asynchronous collective interface over every backend.

Install ``zero3-comm`` alone and it is a usable async-collective library::

    from zero3.comm import create_backend

    comm = create_backend("gloo", timeout_s=60)       # or "auto", "nccl", "mpi", ...
    out = torch.empty(comm.world_size * 4)
    work = comm.all_gather(out, torch.ones(4))        # returns at once
    ...                                               # overlap host work here
    work.wait()                                       # out is valid from here on

Backends are classes registered through pluggy (built-ins first, then plugins from
the ``zero3.comm`` entry-point group). See :class:`CommBackend` for the interface.
"""

from zero3.comm._backend import DEFAULT_TIMEOUT_S, CommBackend
from zero3.comm._cupy import CupyNCCLBackend
from zero3.comm._hccl import HCCLBackend
from zero3.comm._launch import (
    default_device_type,
    launched_by_mpi,
    launched_by_torch,
    local_device_index,
    local_rank,
)
from zero3.comm._mpi import MPIBackend
from zero3.comm._nccl import NCCLBackend
from zero3.comm._plugins import BackendRegistry, hookimpl
from zero3.comm._registry import (
    available_backends,
    backend_class,
    create_backend,
    registered_backends,
)
from zero3.comm._stream import Event, HostStream, Stream, TorchDeviceStream
from zero3.comm._teardown import release_groups
from zero3.comm._torch_dist import GlooBackend, TorchDistBackend
from zero3.comm._types import (
    BackendUnavailableError,
    Capabilities,
    CommError,
    CommTimeoutError,
    ReduceOp,
    UnknownBackendError,
    UnsupportedDTypeError,
)
from zero3.comm._work import CompletedWork, ThenWork, Work

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "BackendRegistry",
    "BackendUnavailableError",
    "Capabilities",
    "CommBackend",
    "CommError",
    "CommTimeoutError",
    "CompletedWork",
    "CupyNCCLBackend",
    "Event",
    "GlooBackend",
    "HCCLBackend",
    "HostStream",
    "MPIBackend",
    "NCCLBackend",
    "ReduceOp",
    "Stream",
    "ThenWork",
    "TorchDeviceStream",
    "TorchDistBackend",
    "UnknownBackendError",
    "UnsupportedDTypeError",
    "Work",
    "available_backends",
    "backend_class",
    "create_backend",
    "default_device_type",
    "hookimpl",
    "launched_by_mpi",
    "launched_by_torch",
    "local_device_index",
    "local_rank",
    "registered_backends",
    "release_groups",
]
