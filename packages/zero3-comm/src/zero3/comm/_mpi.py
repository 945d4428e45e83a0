"""MPI backend: mpi4py non-blocking collectives on CPU tensors, with a progress thread.

Note:
    mpi4py is imported lazily (inside functions), never when ``zero3.comm`` is
    imported: importing ``mpi4py.MPI`` initializes MPI, and a machine without it must
    still be able to use every other backend.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import torch

from zero3.comm._backend import DEFAULT_TIMEOUT_S, CommBackend
from zero3.comm._stream import Stream
from zero3.comm._types import (
    FLOAT_DTYPES,
    Capabilities,
    CommError,
    CommTimeoutError,
    ReduceOp,
    UnsupportedDTypeError,
)
from zero3.comm._work import Work

__all__ = ["MPIBackend", "MPIWork", "bf16_reduce_local", "import_mpi"]

_log = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'zero3-comm[mpi]' (mpi4py plus an MPI library such as mpich)"

# Wire typecodes for reductions (``MPI.Datatype.fromcode``). bfloat16 has no MPI
# datatype in most MPI libraries: it travels as uint16 ("H") and is reduced by the
# user-defined ops below. Gathers and broadcasts move raw bytes whatever the dtype.
_REDUCE_CODES: dict[torch.dtype, str] = {
    torch.float32: "f",
    torch.float64: "d",
    torch.float16: "e",
    torch.bfloat16: "H",
    torch.uint8: "B",
    torch.int8: "b",
    torch.int32: "i",
    torch.int64: "q",
}

# Poll pacing for callers blocked in wait(): spin flat out first (short collectives
# finish within microseconds), then back off so a long wait for a late peer does not
# take a whole core away from the ranks that are still computing.
_SPIN_S = 2e-3
_BACKOFF_SLEEP_S = 50e-6
_LONG_WAIT_S = 0.1
_LONG_SLEEP_S = 1e-3


def _reducible_dtypes(mpi: Any) -> frozenset[torch.dtype]:
    """The dtypes this MPI library can reduce: those whose wire type it defines.

    MPICH maps numpy's float16 to ``MPIX_C_FLOAT16``; an MPI without a 16-bit float
    type leaves float16 out, so reducing it raises UnsupportedDTypeError up front.
    """
    supported = set()
    for dtype, code in _REDUCE_CODES.items():
        try:
            datatype = mpi.Datatype.fromcode(code)
        except (KeyError, ValueError):
            continue
        if datatype != mpi.DATATYPE_NULL:
            supported.add(dtype)
    return frozenset(supported)


def import_mpi() -> Any:
    """Import and return ``mpi4py.MPI`` (this initializes MPI on first use).

    Raises:
        ImportError: mpi4py is missing, or it is installed but the MPI library behind
            it cannot be loaded. The message says what to install.
    """
    try:
        return importlib.import_module("mpi4py.MPI")
    except ModuleNotFoundError as exc:
        raise ImportError(
            f"the mpi backend needs mpi4py, which is not installed: {_INSTALL_HINT}"
        ) from exc
    except (ImportError, OSError, RuntimeError) as exc:
        raise ImportError(
            f"mpi4py is installed but failed to load an MPI library ({exc}); {_INSTALL_HINT}"
        ) from exc


# -- bfloat16 reductions ------------------------------------------------------------


def _bf16_views(inbuf: Any, inoutbuf: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    source = memoryview(inbuf).cast("B")
    target = memoryview(inoutbuf).cast("B")
    if source.nbytes == 0:
        return None
    # torch.frombuffer shares the memory MPI handed us: no copy either way.
    return (
        torch.frombuffer(source, dtype=torch.bfloat16),
        torch.frombuffer(target, dtype=torch.bfloat16),
    )


def _bf16_sum(inbuf: Any, inoutbuf: Any, datatype: Any = None) -> None:
    views = _bf16_views(inbuf, inoutbuf)
    if views is not None:
        views[1].add_(views[0])


def _bf16_max(inbuf: Any, inoutbuf: Any, datatype: Any = None) -> None:
    views = _bf16_views(inbuf, inoutbuf)
    if views is not None:
        torch.maximum(views[1], views[0], out=views[1])


def _bf16_min(inbuf: Any, inoutbuf: Any, datatype: Any = None) -> None:
    views = _bf16_views(inbuf, inoutbuf)
    if views is not None:
        torch.minimum(views[1], views[0], out=views[1])


_BF16_FUNCS: dict[ReduceOp, Callable[[Any, Any, Any], None]] = {
    ReduceOp.SUM: _bf16_sum,
    ReduceOp.AVG: _bf16_sum,
    ReduceOp.MAX: _bf16_max,
    ReduceOp.MIN: _bf16_min,
}


class _Ops:
    """Process-wide MPI reduction ops, created on first use (MPI must be initialized)."""

    lock = threading.Lock()
    bf16: dict[ReduceOp, Any] = {}


def _bf16_op(mpi: Any, op: ReduceOp) -> Any:
    """The user-defined MPI op that reduces uint16 storage as bfloat16.

    Note:
        The built-in ``MPI.SUM`` on the uint16 view adds the bit patterns (garbage), and
        bf16 has no MPI datatype: passing bf16 bytes as-is is an error under MPICH and
        NaN under Open MPI (:ref:`fact-mpi-bf16`). The op reads the buffers as bf16 through
        torch, whose bf16 arithmetic computes in fp32 and rounds to nearest-even: each
        pairwise step rounds exactly as gloo's bf16 reduction does, so results match
        gloo bit for bit wherever gloo's result is exact (and differ only by summation
        order otherwise).
    """
    with _Ops.lock:
        created = _Ops.bf16.get(op)
        if created is None:
            created = mpi.Op.Create(_BF16_FUNCS[op], commute=True)
            _Ops.bf16[op] = created
        return created


def bf16_reduce_local(inbuf: Any, inoutbuf: Any, op: ReduceOp = ReduceOp.SUM) -> None:
    """Apply the bf16 reduction ``inoutbuf = inbuf (op) inoutbuf`` through MPI locally.

    Both buffers hold bfloat16 values as raw storage (``t.view(torch.uint16).numpy()``).
    Uses ``MPI_Reduce_local`` with the same user-defined op the collectives use, so it
    is a single-process check of exactly what runs inside a reduction.
    """
    mpi = import_mpi()
    dtype = mpi.Datatype.fromcode("H")
    _bf16_op(mpi, op).Reduce_local([inbuf, dtype], [inoutbuf, dtype])


# -- requests and progress ----------------------------------------------------------


class _Pending:
    """One outstanding MPI request and the tensors its buffers point into."""

    __slots__ = ("done", "error", "keep", "request")

    def __init__(self, request: Any, keep: tuple[Any, ...]) -> None:
        self.request = request
        # Buffers must outlive the request: MPI reads and writes them until completion.
        self.keep: tuple[Any, ...] = keep
        self.done = False
        self.error: BaseException | None = None

    def complete(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done = True
        self.keep = ()


class _Progress:
    """Owns the outstanding requests of one backend and drives them to completion.

    Every MPI call this backend makes goes through ``lock``: a request may be completed
    by one thread only, and a single lock makes the backend safe even where the MPI
    library serializes threads poorly. When ``use_thread`` is set, a daemon thread
    (started with the first request) polls the outstanding requests with ``Testsome``
    every ``interval_s`` seconds and sleeps on a condition while there are none.
    """

    def __init__(self, mpi: Any, *, use_thread: bool, interval_s: float) -> None:
        self._mpi = mpi
        self.use_thread = use_thread
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self._wakeup = threading.Condition(self.lock)
        self._pending: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Callers inside wait() poll for themselves; the thread stands aside meanwhile
        # (two pollers would only fight over the lock and the GIL).
        self._waiters = 0

    @property
    def thread(self) -> threading.Thread | None:
        """The progress thread, or None before the first request (or without one)."""
        return self._thread

    def submit(self, start: Callable[[], Any], keep: tuple[Any, ...]) -> _Pending:
        """Start a request with ``start()`` under the lock and track it."""
        with self.lock:
            entry = _Pending(start(), keep)
            self._pending.append(entry)
            self._wakeup.notify()
            if self.use_thread and self._thread is None and not self._stopping:
                self._thread = threading.Thread(
                    target=self._run, name="zero3-mpi-progress", daemon=True
                )
                self._thread.start()
        return entry

    def poll_locked(self) -> None:
        """Test every outstanding request once (the caller holds ``lock``)."""
        if not self._pending:
            return
        try:
            finished = self._mpi.Request.Testsome([e.request for e in self._pending])
        except self._mpi.Exception:
            self._poll_each_locked()
            return
        if not finished:
            return
        for index in finished:
            self._pending[index].complete()
        self._pending = [e for e in self._pending if not e.done]

    def _poll_each_locked(self) -> None:
        # Testsome failed: find out which request the error belongs to.
        for entry in self._pending:
            try:
                if entry.request.Test():
                    entry.complete()
            except self._mpi.Exception as exc:
                entry.complete(exc)
        self._pending = [e for e in self._pending if not e.done]

    def test(self, entry: _Pending) -> bool:
        """Non-blocking completion check (drives progress only without a thread)."""
        if entry.done or self.use_thread:
            return entry.done
        if self.lock.acquire(blocking=False):
            try:
                if not entry.done:
                    self.poll_locked()
            finally:
                self.lock.release()
        return entry.done

    def wait(self, entry: _Pending, timeout_s: float, description: str) -> None:
        """Poll until ``entry`` completes or ``timeout_s`` passes."""
        if entry.done:
            self._raise_if_failed(entry, description)
            return
        with self.lock:
            self._waiters += 1
        try:
            self._poll_until_done(entry, timeout_s, description)
        finally:
            with self._wakeup:
                self._waiters -= 1
                self._wakeup.notify()
        self._raise_if_failed(entry, description)

    @staticmethod
    def _raise_if_failed(entry: _Pending, description: str) -> None:
        if entry.error is not None:
            raise CommError(f"{description} failed: {entry.error}") from entry.error

    def _poll_until_done(self, entry: _Pending, timeout_s: float, description: str) -> None:
        start = time.monotonic()
        while not entry.done:
            with self.lock:
                if not entry.done:
                    self.poll_locked()
            if entry.done:
                break
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise CommTimeoutError(
                    f"{description} did not complete within {timeout_s:g} s (a peer "
                    "that never issued the same collective, or issued them in another "
                    "order?); the request stays outstanding"
                )
            if waited > _LONG_WAIT_S:
                time.sleep(_LONG_SLEEP_S)
            elif waited > _SPIN_S:
                time.sleep(_BACKOFF_SLEEP_S)

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while (not self._pending or self._waiters) and not self._stopping:
                    self._wakeup.wait()
                if self._stopping:
                    return
            # Sleep first, outside the lock: a caller that waits right after issuing
            # (the common case for small messages) then finds the lock free and polls
            # alone, and the thread only works for requests left outstanding.
            time.sleep(self.interval_s)
            with self.lock:
                if not self._waiters:
                    self.poll_locked()

    def stop(self) -> list[_Pending]:
        """Stop the thread; return the requests still outstanding."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
        with self.lock:
            left, self._pending = self._pending, []
        return left


# Requests still in flight when their backend closed: their buffers must stay alive
# until MPI is done with them, which may be never (a peer that left).
_ORPHANS: list[_Pending] = []
_LIVE: weakref.WeakSet[MPIBackend] = weakref.WeakSet()


@atexit.register
def _stop_all_progress_threads() -> None:
    # Python atexit handlers run before mpi4py's finalizer (a Py_AtExit hook), so the
    # threads are stopped before MPI_Finalize: a daemon thread still inside
    # MPI_Testsome during MPI_Finalize would be undefined behaviour.
    for backend in list(_LIVE):
        backend.close()


class MPIWork(Work):
    """An outstanding MPI request with a bounded wait.

    ``wait()`` polls the request until it completes (raising
    :class:`~zero3.comm.CommTimeoutError` naming the collective after the backend's
    timeout), then runs the completion step (the division of ``ReduceOp.AVG``) once.
    """

    def __init__(
        self,
        progress: _Progress,
        entry: _Pending,
        description: str,
        timeout_s: float,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._progress = progress
        self._entry = entry
        self._description = description
        self._timeout_s = timeout_s
        self._finish = finish
        self._waited = False

    def wait(self, stream: Stream | None = None) -> None:
        if self._waited:
            return
        self._progress.wait(self._entry, self._timeout_s, self._description)
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        self._waited = True

    def is_completed(self) -> bool:
        return self._waited or self._progress.test(self._entry)


def _is_own_chunk(output: torch.Tensor, input: torch.Tensor, rank: int) -> bool:
    """True when ``input`` is ``output``'s chunk ``rank`` (an in-place all-gather)."""
    chunk = input.numel() * input.element_size()
    return input.data_ptr() == output.data_ptr() + rank * chunk and chunk > 0


class MPIBackend(CommBackend):
    """MPI collectives on CPU tensors through mpi4py (``Iallgather``, ``Ireduce_scatter_block``...).

    Tensors are handed to MPI as numpy views of their storage: no copies. Gathers and
    broadcasts move raw bytes, so every dtype works; reductions use MPI's typed ops,
    with user-defined ops for bfloat16 (no MPI datatype) and ``ReduceOp.AVG`` computed
    as a sum followed by an in-place division inside ``wait()``.

    Args:
        comm: An mpi4py communicator (default ``MPI.COMM_WORLD``). The backend works on
            a duplicate of it, so its collectives never match the caller's own MPI
            calls; every rank of ``comm`` must construct the backend together.
        timeout_s: How long ``Work.wait()`` polls before raising
            :class:`~zero3.comm.CommTimeoutError`.
        progress_thread: Run the background progress thread (default). Disable it to
            have requests advance only while the caller waits or polls.

    Note:
        MPI makes no progress on outstanding non-blocking collectives unless something
        calls into it (:ref:`fact-mpi-progress`): a daemon thread, started with the first
        collective, polls the outstanding requests while the caller computes. Calling MPI
        from a second thread needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default request);
        with less, the backend runs without the thread and reports
        ``capabilities.async_host = False``. One lock serializes a backend's MPI calls.
    """

    name = "mpi"
    device_type = "cpu"
    capabilities = Capabilities(needs_progress_helper=True)
    #: Sleep between two polls of the progress thread while requests are outstanding.
    progress_interval_s: ClassVar[float] = 50e-6

    def __init__(
        self,
        comm: Any = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        progress_thread: bool = True,
    ) -> None:
        mpi = import_mpi()
        base = mpi.COMM_WORLD if comm is None else comm
        super().__init__(base.Get_rank(), base.Get_size(), timeout_s=timeout_s)
        self._mpi = mpi
        self._comm: Any = base.Dup()
        multiple = mpi.Query_thread() >= mpi.THREAD_MULTIPLE
        if progress_thread and not multiple:
            _log.warning(
                "zero3.comm mpi: the MPI library gives thread level %s, not "
                "MPI_THREAD_MULTIPLE; running without a progress thread (collectives "
                "advance only while the caller waits or polls)",
                mpi.Query_thread(),
            )
        use_thread = progress_thread and multiple
        self.capabilities = replace(
            type(self).capabilities,
            reduce_dtypes=_reducible_dtypes(mpi),
            async_host=use_thread,
        )
        self._progress = _Progress(mpi, use_thread=use_thread, interval_s=self.progress_interval_s)
        self._closed = False
        _LIVE.add(self)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import_mpi()
        except ImportError as exc:
            return str(exc)
        return None

    def duplicate(self) -> MPIBackend:
        """A backend on a fresh ``Dup()`` of this communicator (collective over its ranks)."""
        return MPIBackend(
            self._comm, timeout_s=self.timeout_s, progress_thread=self._progress.use_thread
        )

    @property
    def comm(self) -> Any:
        """The (duplicated) mpi4py communicator the collectives run on."""
        return self._comm

    @property
    def progress_thread(self) -> threading.Thread | None:
        """The running progress thread, or None (not started yet, disabled or closed)."""
        return self._progress.thread

    def close(self) -> None:
        """Stop the progress thread and free the duplicated communicator (idempotent).

        Requests still outstanding keep their buffers alive (they are never freed) and
        are left to MPI, since a collective cannot be cancelled.
        """
        if self._closed:
            return
        self._closed = True
        left = self._progress.stop()
        if left:
            _log.warning("zero3.comm mpi: closed with %d collective(s) in flight", len(left))
            _ORPHANS.extend(left)
        if not self._mpi.Is_finalized() and not left:
            self._comm.Free()
        _LIVE.discard(self)

    # -- primitives -----------------------------------------------------------------

    def _issue(
        self,
        what: str,
        tensors: tuple[torch.Tensor, ...],
        start: Callable[[], Any],
        finish: Callable[[], None] | None = None,
    ) -> Work:
        description = self.describe(what, *tensors)
        if self._closed:
            raise CommError(f"{description}: the backend is closed")
        try:
            entry = self._progress.submit(start, tensors)
        except self._mpi.Exception as exc:
            raise CommError(f"{description} failed to start: {exc}") from exc
        return MPIWork(self._progress, entry, description, self.timeout_s, finish)

    def _bytes(self, tensor: torch.Tensor) -> list[Any]:
        # Raw-byte message: one numpy view of the storage, no copy, any dtype.
        return [tensor.detach().view(torch.uint8).numpy(), self._mpi.BYTE]

    def _typed(self, tensor: torch.Tensor) -> list[Any]:
        code = _REDUCE_CODES[tensor.dtype]
        view = tensor.detach()
        if tensor.dtype == torch.bfloat16:
            view = view.view(torch.uint16)
        return [view.numpy(), self._mpi.Datatype.fromcode(code)]

    def _mpi_op(self, dtype: torch.dtype, op: ReduceOp, what: str) -> Any:
        if op is ReduceOp.AVG and dtype not in FLOAT_DTYPES:
            raise UnsupportedDTypeError(
                f"{self.name}.{what}: ReduceOp.AVG needs a floating dtype, got {dtype}; "
                "use ReduceOp.SUM and divide as your integer semantics require"
            )
        if dtype == torch.bfloat16:
            return _bf16_op(self._mpi, op)
        table = {
            ReduceOp.SUM: self._mpi.SUM,
            ReduceOp.AVG: self._mpi.SUM,
            ReduceOp.MAX: self._mpi.MAX,
            ReduceOp.MIN: self._mpi.MIN,
        }
        return table[op]

    def _averager(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], None] | None:
        if op is not ReduceOp.AVG or self.world_size == 1:
            return None

        def average() -> None:
            tensor.div_(self.world_size)

        return average

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        recv = self._bytes(output)
        # MPI forbids overlapping send and receive buffers; in place is MPI_IN_PLACE.
        send = self._mpi.IN_PLACE if _is_own_chunk(output, input, self.rank) else self._bytes(input)
        return self._issue("all_gather", (output, input), lambda: self._comm.Iallgather(send, recv))

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        mpi_op = self._mpi_op(input.dtype, op, "reduce_scatter")
        send, recv = self._typed(input), self._typed(output)
        return self._issue(
            "reduce_scatter",
            (output, input),
            lambda: self._comm.Ireduce_scatter_block(send, recv, mpi_op),
            self._averager(output, op),
        )

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: Stream | None) -> Work:
        mpi_op = self._mpi_op(tensor.dtype, op, "all_reduce")
        buf = self._typed(tensor)
        return self._issue(
            "all_reduce",
            (tensor,),
            lambda: self._comm.Iallreduce(self._mpi.IN_PLACE, buf, mpi_op),
            self._averager(tensor, op),
        )

    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        buf = self._bytes(tensor)
        return self._issue("broadcast", (tensor,), lambda: self._comm.Ibcast(buf, root=src))

    def _barrier(self) -> Work:
        return self._issue("barrier", (), self._comm.Ibarrier)
