"""NCCL through cupy (``cupy.cuda.nccl``) on torch CUDA tensors, without torch.distributed.

Note:
    cupy is imported lazily, never when ``zero3.comm`` is imported: it is a large
    optional dependency, and without a GPU it imports but cannot allocate
    (:ref:`fact-accelerator-libraries`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import itertools
import os
import time
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zero3.comm._backend import DEFAULT_TIMEOUT_S, CommBackend
from zero3.comm._launch import local_device_index
from zero3.comm._stream import Event, HostStream, Stream, TorchDeviceStream
from zero3.comm._types import (
    FLOAT_DTYPES,
    INT_DTYPES,
    BackendUnavailableError,
    Capabilities,
    CommError,
    CommTimeoutError,
    ReduceOp,
    UnsupportedDTypeError,
)
from zero3.comm._work import Work

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["CupyEvent", "CupyNCCLBackend", "CupyStream", "CupyWork", "import_cupy"]

_INSTALL_HINT = "pip install 'zero3-comm[cupy]' (a cupy-cuda12x wheel matching your CUDA)"
_NCCL_HINT = (
    "install NCCL where cupy finds it (pip install nvidia-nccl-cu12, or cupy from conda-forge)"
)
# NCCL 2.10 brought ncclAvg and ncclBfloat16.
_NCCL_2_10 = 21000
_STORE_PREFIX = "zero3/cupy-nccl"
_exchange_counter = itertools.count()


def import_cupy() -> ModuleType:
    """Import cupy, turning every way it can fail into one clear ImportError."""
    try:
        return importlib.import_module("cupy")
    except ModuleNotFoundError as exc:
        raise ImportError(
            f"the cupy-nccl backend needs cupy, which is not installed: {_INSTALL_HINT}"
        ) from exc
    except (ImportError, OSError, RuntimeError) as exc:
        raise ImportError(
            f"cupy is installed but failed to import ({exc}); {_INSTALL_HINT}"
        ) from exc


def import_nccl() -> ModuleType:
    """Import ``cupy.cuda.nccl`` (quietly: without NCCL it warns on import)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module("cupy.cuda.nccl")
    except (ImportError, OSError, RuntimeError) as exc:
        raise ImportError(f"cupy.cuda.nccl failed to import ({exc}); {_NCCL_HINT}") from exc


# -- streams and events ---------------------------------------------------------------


def torch_external_stream(ptr: int, device: torch.device | None = None) -> torch.cuda.Stream:
    """A torch view of an existing CUDA stream (for ``torch.cuda.stream(...)``)."""
    stream: torch.cuda.Stream = torch.cuda.ExternalStream(ptr, device=device)
    return stream


class CupyEvent(Event):
    """A ``cupy.cuda.Event`` behind the zero3 :class:`~zero3.comm.Event` interface."""

    def query(self) -> bool:
        return bool(self.native.done)


class CupyStream(Stream):
    """A cupy stream (``cupy.cuda.Stream`` or ``ExternalStream``) as a zero3 stream.

    Args:
        native: The cupy stream to wrap; default the current cupy stream.
        new: Create a fresh non-blocking stream instead.
    """

    device_type = "cuda"

    def __init__(self, native: Any = None, *, new: bool = False) -> None:
        cupy = import_cupy()
        if native is None:
            native = cupy.cuda.Stream(non_blocking=True) if new else cupy.cuda.get_current_stream()
        self.native = native

    @property
    def ptr(self) -> int:
        """The ``cudaStream_t`` handle."""
        return int(self.native.ptr)

    def wait_stream(self, other: Stream) -> None:
        if other.native_id() != self.native_id():
            self.wait_event(other.record_event())

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CupyEvent):
            self.native.wait_event(event.native)
        elif event.native is not None:  # a torch.cuda.Event: wait through torch
            torch_external_stream(self.ptr).wait_event(event.native)

    def record_event(self) -> Event:
        event = import_cupy().cuda.Event(block=False, disable_timing=True)
        event.record(self.native)
        return CupyEvent(event)

    def synchronize(self) -> None:
        self.native.synchronize()

    @contextlib.contextmanager
    def use(self) -> Iterator[Stream]:
        # Current for both libraries, so torch ops and DLPack exchanges inside the
        # block are ordered on this stream too.
        with self.native, torch.cuda.stream(torch_external_stream(self.ptr)):
            yield self

    def native_id(self) -> object:
        return ("cuda-ptr", self.ptr)


def as_cupy_stream(stream: Stream | None, device: torch.device) -> Any:
    """The cupy stream for a zero3 stream (default: torch's current stream on ``device``).

    Raises:
        ValueError: ``stream`` is not a CUDA stream.
    """
    cupy = import_cupy()
    if isinstance(stream, CupyStream):
        return stream.native
    if stream is None:
        return cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
    if isinstance(stream, TorchDeviceStream) and stream.device_type == "cuda":
        return cupy.cuda.ExternalStream(stream.native.cuda_stream)
    raise ValueError(f"cupy-nccl: expected a CUDA stream, got {type(stream).__name__}")


class CupyWork(Work):
    """A collective queued on the backend's NCCL stream, marked by a cupy event.

    ``wait(stream)`` makes ``stream`` wait for the event (no host synchronization);
    ``wait(HostStream())`` blocks the host, up to the backend's timeout.
    """

    def __init__(
        self, backend: CupyNCCLBackend, event: Any, description: str, timeout_s: float
    ) -> None:
        self._backend = backend
        self._event = event
        self._description = description
        self._timeout_s = timeout_s

    def wait(self, stream: Stream | None = None) -> None:
        if isinstance(stream, HostStream):
            self._host_wait()
            return
        device = self._backend.device()
        with import_cupy().cuda.Device(device.index):
            as_cupy_stream(stream, device).wait_event(self._event)

    def _host_wait(self) -> None:
        deadline = time.monotonic() + self._timeout_s
        while not self._event.done:
            if time.monotonic() > deadline:
                self._backend.check_async_error(self._description)
                raise CommTimeoutError(
                    f"{self._description} did not complete within {self._timeout_s:g} s"
                )
            time.sleep(1e-4)

    def is_completed(self) -> bool:
        return bool(self._event.done)


# -- unique-id exchange -----------------------------------------------------------------


def _encode_id(unique_id: tuple[int, ...]) -> str:
    # NCCL's id is 128 C chars (signed on x86): as hex text it travels through any
    # store or object broadcast unchanged.
    return bytes(b & 0xFF for b in unique_id).hex()


def _decode_id(text: str | bytes) -> tuple[int, ...]:
    raw = bytes.fromhex(text.decode() if isinstance(text, bytes) else text)
    return tuple(b - 256 if b > 127 else b for b in raw)


def _exchange_over_group(
    nccl: ModuleType, group: dist.ProcessGroup | None, rank: int
) -> tuple[int, ...]:
    """Rank 0 of ``group`` makes the id; a torch.distributed broadcast shares it."""
    payload: list[Any] = [_encode_id(nccl.get_unique_id()) if rank == 0 else None]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(payload, src=source, group=group)
    return _decode_id(payload[0])


def _exchange_over_store(
    nccl: ModuleType, store: Store, rank: int, timeout_s: float
) -> tuple[int, ...]:
    """Rank 0 makes the id and sets it in ``store``; the others wait for the key."""
    key = f"{_STORE_PREFIX}/uid/{next(_exchange_counter)}"
    if rank == 0:
        store.set(key, _encode_id(nccl.get_unique_id()))
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CommTimeoutError(
            f"cupy-nccl: rank {rank} waited {timeout_s:g} s for rank 0 to publish the NCCL "
            f"unique id under {key!r} in the store ({exc})"
        ) from exc
    return _decode_id(store.get(key))


def _store_from_env(rank: int, world_size: int, timeout_s: float) -> Store:
    # Under torchrun the agent already serves a store on MASTER_PORT: join it as a
    # client. Otherwise rank 0 serves one there.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(  # type: ignore[attr-defined]  # not re-exported in torch's stubs
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _launcher_env() -> tuple[int, int] | None:
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if all(k in os.environ for k in keys):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


# -- the backend ---------------------------------------------------------------------


class CupyNCCLBackend(CommBackend):
    """NCCL collectives through ``cupy.cuda.nccl.NcclCommunicator`` on torch CUDA tensors.

    Tensors reach NCCL as DLPack views (``cupy.from_dlpack``): no copies. Every
    collective runs on the backend's own NCCL stream, which first waits for the issuing
    stream (``stream=``, default torch's current stream) through an event; a second
    event recorded after the collective is what :class:`~zero3.comm._cupy.CupyWork`
    waits on. Nothing synchronizes the host.

    The ranks agree on the communicator's unique id through, in this order: ``group``
    (or the initialized default torch.distributed group), an explicit ``store`` with
    ``rank``/``world_size``, the launcher environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``: a TCPStore), else a world of one. A program that
    also uses torch.distributed should initialize it first: outside torchrun (whose
    agent serves the store) rank 0 would otherwise serve a store on ``MASTER_PORT``
    and a later ``init_process_group("env://")`` could not bind it.

    Args:
        group: A torch.distributed group to take rank, size and the id exchange from.
        store: A torch.distributed ``Store`` (``FileStore``, ``TCPStore``) for the exchange.
        rank: This process's rank (with ``store``).
        world_size: Number of ranks (with ``store``).
        device: CUDA device index (default: the local rank, from ``LOCAL_RANK`` or the MPI
            launcher, never the global rank; else the current device).
        timeout_s: Bound for the id exchange and for host-side waits.

    Note:
        One dedicated stream per backend, as torch's NCCL process group does: NCCL
        kernels of one communicator issued on several streams can run concurrently in
        different orders on different ranks and deadlock. Tensors used on that stream
        are marked with ``record_stream`` so torch's caching allocator does not reuse
        their memory before the collective is done. ``ReduceOp.AVG`` and bfloat16 use
        NCCL's own ``ncclAvg``/``ncclBfloat16`` when cupy exposes them and NCCL is
        2.10 or newer; otherwise AVG is a sum then a division queued on the NCCL stream,
        and bf16 reductions raise :class:`~zero3.comm.UnsupportedDTypeError` (bf16
        gathers and broadcasts always work: they move bytes).
    """

    name = "cupy-nccl"
    device_type = "cuda"
    capabilities = Capabilities()  # native reduce-scatter, every float and int dtype

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: int | torch.device | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"the cupy-nccl backend cannot run here: {reason}")
        self._cupy = import_cupy()
        self._nccl = import_nccl()
        self._index = self._pick_device(device)
        torch.cuda.set_device(self._index)
        # A store made here stays referenced for the backend's life: when rank 0 serves
        # it, dropping it early would take the id away from ranks still reading it.
        self._store: Store | None = None
        rank, world_size, unique_id = self._rendezvous(group, store, rank, world_size, timeout_s)
        super().__init__(rank, world_size, timeout_s=timeout_s)
        version = int(self._nccl.get_version())
        self._avg = getattr(self._nccl, "NCCL_AVG", None) if version >= _NCCL_2_10 else None
        self._bf16 = getattr(self._nccl, "NCCL_BFLOAT16", None) if version >= _NCCL_2_10 else None
        dtypes = FLOAT_DTYPES | INT_DTYPES
        if self._bf16 is None:
            dtypes = dtypes - {torch.bfloat16}
        self.capabilities = Capabilities(reduce_dtypes=dtypes)
        with self._cupy.cuda.Device(self._index):
            self._comm: Any = self._nccl.NcclCommunicator(world_size, unique_id, rank)
            self._stream: Any = self._cupy.cuda.Stream(non_blocking=True)
        self._torch_stream = torch_external_stream(self._stream.ptr, self.device())

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            cupy = import_cupy()
        except ImportError as exc:
            return str(exc)
        try:
            has_gpu = bool(cupy.is_available())
        except Exception:  # a broken driver may raise instead of answering False
            has_gpu = False
        if not has_gpu:
            return (
                "cupy is installed but finds no usable CUDA GPU (cupy.is_available() is "
                "False: no GPU, or no CUDA driver matching the cupy wheel)"
            )
        try:
            nccl = import_nccl()
        except ImportError as exc:
            return str(exc)
        if not getattr(nccl, "available", False):
            return f"cupy was loaded without NCCL (cupy.cuda.nccl.available is False); {_NCCL_HINT}"
        if not torch.cuda.is_available():
            return (
                "torch sees no CUDA device (torch.cuda.is_available() is False); the "
                "cupy-nccl backend moves torch CUDA tensors: install a CUDA build of torch"
            )
        return None

    @staticmethod
    def _pick_device(device: int | torch.device | None) -> int:
        if isinstance(device, torch.device):
            return device.index if device.index is not None else torch.cuda.current_device()
        if device is not None:
            return int(device)
        local = local_device_index(torch.cuda.device_count(), CupyNCCLBackend.name)
        return torch.cuda.current_device() if local is None else local

    def _rendezvous(
        self,
        group: dist.ProcessGroup | None,
        store: Store | None,
        rank: int | None,
        world_size: int | None,
        timeout_s: float,
    ) -> tuple[int, int, tuple[int, ...]]:
        nccl = self._nccl
        if group is not None or (store is None and dist.is_available() and dist.is_initialized()):
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            return rank, world_size, _exchange_over_group(nccl, group, rank)
        if store is not None:
            if rank is None or world_size is None:
                raise ValueError("cupy-nccl: store= needs rank= and world_size=")
            return rank, world_size, _exchange_over_store(nccl, store, rank, timeout_s)
        env = _launcher_env()
        if env is not None and env[1] > 1:
            rank, world_size = env
            self._store = _store_from_env(rank, world_size, timeout_s)
            return rank, world_size, _exchange_over_store(nccl, self._store, rank, timeout_s)
        # A world of one: no one to exchange with.
        return 0, 1, tuple(nccl.get_unique_id())

    def device(self) -> torch.device:
        return torch.device("cuda", self._index)

    def duplicate(self) -> CupyNCCLBackend:
        """A backend on a new NCCL communicator over the same ranks.

        Collective over the ranks: rank 0 makes a new unique id and this backend's own
        broadcast carries it, so no store is needed.
        """
        from zero3.comm._stream import HostStream

        nccl = self._nccl
        uid = list(nccl.get_unique_id()) if self.rank == 0 else [0] * len(nccl.get_unique_id())
        carrier = torch.tensor(uid, dtype=torch.int32, device=self.device())
        self.broadcast(carrier, src=0).wait(HostStream())
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._store = None
        with self._cupy.cuda.Device(self._index):
            clone._comm = nccl.NcclCommunicator(
                self.world_size, tuple(carrier.cpu().tolist()), self.rank
            )
            clone._stream = self._cupy.cuda.Stream(non_blocking=True)
        clone._torch_stream = torch_external_stream(clone._stream.ptr, self.device())
        return clone

    @property
    def nccl_stream(self) -> CupyStream:
        """The stream every collective of this backend runs on."""
        return CupyStream(self._stream)

    def close(self) -> None:
        """Finish queued collectives, then destroy the NCCL communicator (idempotent)."""
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            self._stream.synchronize()
            comm.destroy()
        self._store = None

    def check_async_error(self, description: str) -> None:
        """Raise :class:`~zero3.comm.CommError` if NCCL reported an asynchronous error."""
        if self._comm is None:
            return
        try:
            self._comm.check_async_error()
        except self._nccl.NcclError as exc:
            raise CommError(f"{description} failed: {exc}") from exc

    # -- primitives -----------------------------------------------------------------

    def _issue(
        self,
        what: str,
        tensors: tuple[torch.Tensor, ...],
        stream: Stream | None,
        launch: Callable[[int], None],
    ) -> Work:
        """Queue ``launch(nccl_stream_ptr)`` on the NCCL stream after ``stream``'s work."""
        description = self.describe(what, *tensors)
        if self._comm is None:
            raise CommError(f"{description}: the backend is closed")
        cuda = self._cupy.cuda
        try:
            with cuda.Device(self._index):
                producer = as_cupy_stream(stream, self.device())
                ready = cuda.Event(block=False, disable_timing=True)
                ready.record(producer)
                self._stream.wait_event(ready)
                # Both libraries' current stream is the NCCL stream here, so DLPack
                # exports add no cross-stream sync and the AVG division is queued
                # right behind the collective.
                with self._stream, torch.cuda.stream(self._torch_stream):
                    launch(int(self._stream.ptr))
                    for tensor in tensors:
                        tensor.record_stream(self._torch_stream)
                done = cuda.Event(block=False, disable_timing=True)
                done.record(self._stream)
        except RuntimeError as exc:  # NcclError and CUDARuntimeError are RuntimeErrors
            raise CommError(f"{description} failed to start: {exc}") from exc
        return CupyWork(self, done, description, self.timeout_s)

    def _ptr(self, tensor: torch.Tensor) -> int:
        """Device address of ``tensor`` through a zero-copy DLPack view."""
        if tensor.numel() == 0:
            return 0
        # As bytes: cupy has no bfloat16 dtype, and NCCL only needs the address.
        return int(self._cupy.from_dlpack(tensor.detach().view(torch.uint8)).data.ptr)

    def _nccl_dtype(self, dtype: torch.dtype) -> int:
        nccl = self._nccl
        if dtype == torch.bfloat16 and self._bf16 is not None:
            return int(self._bf16)
        table = {
            torch.float32: nccl.NCCL_FLOAT32,
            torch.float64: nccl.NCCL_FLOAT64,
            torch.float16: nccl.NCCL_FLOAT16,
            torch.uint8: nccl.NCCL_UINT8,
            torch.int8: nccl.NCCL_INT8,
            torch.int32: nccl.NCCL_INT32,
            torch.int64: nccl.NCCL_INT64,
        }
        return int(table[dtype])  # the base class already refused other dtypes

    def _nccl_op(self, op: ReduceOp, dtype: torch.dtype, what: str) -> tuple[int, bool]:
        """The NCCL op for ``op``, and whether a division must follow (AVG emulation)."""
        nccl = self._nccl
        if op is ReduceOp.AVG:
            if dtype not in FLOAT_DTYPES:
                raise UnsupportedDTypeError(
                    f"{self.name}.{what}: ReduceOp.AVG needs a floating dtype, got {dtype}"
                )
            if self._avg is not None:
                return int(self._avg), False
            return int(nccl.NCCL_SUM), self.world_size > 1
        table = {
            ReduceOp.SUM: nccl.NCCL_SUM,
            ReduceOp.MAX: nccl.NCCL_MAX,
            ReduceOp.MIN: nccl.NCCL_MIN,
        }
        return int(table[op]), False

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        def launch(s: int) -> None:
            nbytes = input.numel() * input.element_size()
            uint8 = self._nccl.NCCL_UINT8
            self._comm.allGather(self._ptr(input), self._ptr(output), nbytes, uint8, s)

        return self._issue("all_gather", (output, input), stream, launch)

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        nccl_op, divide = self._nccl_op(op, input.dtype, "reduce_scatter")
        dtype = self._nccl_dtype(input.dtype)

        def launch(s: int) -> None:
            count = output.numel()
            self._comm.reduceScatter(self._ptr(input), self._ptr(output), count, dtype, nccl_op, s)
            if divide:
                output.div_(self.world_size)

        return self._issue("reduce_scatter", (output, input), stream, launch)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: Stream | None) -> Work:
        nccl_op, divide = self._nccl_op(op, tensor.dtype, "all_reduce")
        dtype = self._nccl_dtype(tensor.dtype)

        def launch(s: int) -> None:
            ptr = self._ptr(tensor)
            self._comm.allReduce(ptr, ptr, tensor.numel(), dtype, nccl_op, s)
            if divide:
                tensor.div_(self.world_size)

        return self._issue("all_reduce", (tensor,), stream, launch)

    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        def launch(s: int) -> None:
            ptr, nbytes = self._ptr(tensor), tensor.numel() * tensor.element_size()
            self._comm.broadcast(ptr, ptr, nbytes, self._nccl.NCCL_UINT8, src, s)

        return self._issue("broadcast", (tensor,), stream, launch)

    def _barrier(self) -> Work:
        # NCCL has no barrier: a one-element all-reduce that every rank must join.
        # wait() orders the consumer stream after it; wait(HostStream()) blocks the host.
        token = torch.zeros(1, device=self.device())

        def launch(s: int) -> None:
            ptr = self._ptr(token)
            self._comm.allReduce(ptr, ptr, 1, self._nccl.NCCL_FLOAT32, self._nccl.NCCL_SUM, s)

        return self._issue("barrier", (token,), None, launch)
