"""Small value types shared by every backend: reduction ops, capabilities, errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

__all__ = [
    "BackendUnavailableError",
    "Capabilities",
    "CommError",
    "CommTimeoutError",
    "PeerGoneError",
    "ReduceOp",
    "UnknownBackendError",
    "UnsupportedDTypeError",
]


class ReduceOp(enum.Enum):
    """Reduction applied by :meth:`~zero3.comm.CommBackend.all_reduce` and ``reduce_scatter``.

    ``AVG`` is the sum divided by the world size. Backends without a native average
    (MPI, for example) compute it as ``SUM`` followed by an in-place division.
    """

    #: Elementwise sum over ranks.
    SUM = "sum"
    #: Elementwise sum over ranks divided by the world size.
    AVG = "avg"
    #: Elementwise maximum over ranks.
    MAX = "max"
    #: Elementwise minimum over ranks.
    MIN = "min"


FLOAT_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16}
)
INT_DTYPES: frozenset[torch.dtype] = frozenset({torch.uint8, torch.int8, torch.int32, torch.int64})


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; core reads it to pick its communication path.

    Attributes:
        native_reduce_scatter: The backend has a real reduce-scatter. When False, core's
            gradient path all-reduces each bucket's whole buffer and keeps this rank's
            region of it, which moves twice the bytes.
        reduce_dtypes: dtypes the backend can reduce (sum/avg/max/min). Gathers and
            broadcasts move bytes and accept any dtype.
        needs_progress_helper: Outstanding requests only advance while something polls
            them (MPI); the backend runs a helper thread for that.
        async_host: Collectives run asynchronously with respect to the calling host
            thread (gloo's own thread, an MPI progress thread, a device stream).
    """

    native_reduce_scatter: bool = True
    reduce_dtypes: frozenset[torch.dtype] = field(default_factory=lambda: FLOAT_DTYPES | INT_DTYPES)
    needs_progress_helper: bool = False
    async_host: bool = True


class CommError(RuntimeError):
    """A collective failed: a peer died, a transport error, or a mismatch between ranks."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not complete within the backend's timeout."""


class PeerGoneError(CommError):
    """A collective failed because a peer's process is gone (it left the job or died).

    Attributes:
        gone: What is known of the peers that are gone: ``{rank in the group: how}``
            (empty when no peer left a notice and none is known dead).
        transport: The collective and the transport's own words.
    """

    def __init__(
        self, message: str, gone: dict[int, str] | None = None, transport: str = ""
    ) -> None:
        super().__init__(message)
        self.gone: dict[int, str] = dict(gone or {})
        self.transport = transport or message

    def who(self) -> str:
        """The peers that are gone, in words (for messages that wrap this one)."""
        if self.gone:
            return "; ".join(f"rank {rank} {how}" for rank, how in sorted(self.gone.items()))
        return (
            "a peer is gone and left no notice saying why: it crashed or was killed (its "
            "own output says why), or it ran on another host"
        )


class UnknownBackendError(LookupError):
    """No backend is registered under the requested name."""


class BackendUnavailableError(RuntimeError):
    """A registered backend cannot run on this machine (missing library or hardware)."""


class UnsupportedDTypeError(TypeError):
    """The backend cannot reduce tensors of this dtype."""
