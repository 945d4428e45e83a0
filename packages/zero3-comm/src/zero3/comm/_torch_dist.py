"""Backends built on torch.distributed process groups (gloo, nccl, hccl)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import logging
import math
import os
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from zero3.comm import _teardown
from zero3.comm._backend import DEFAULT_TIMEOUT_S, CommBackend
from zero3.comm._departures import describe_gone, looks_like_peer_gone, note_arrival
from zero3.comm._launch import TORCH_LAUNCH_VARS, launched_by_mpi, launched_by_torch
from zero3.comm._stream import Stream
from zero3.comm._types import (
    Capabilities,
    CommError,
    CommTimeoutError,
    PeerGoneError,
    ReduceOp,
)
from zero3.comm._work import ThenWork, Work

__all__ = ["GlooBackend", "TorchDistBackend", "TorchWork"]

_log = logging.getLogger(__name__)

_LAUNCH_VARS = TORCH_LAUNCH_VARS

# A backend looks for finished works among its pending ones once this many are listed
# (works nobody waits for would otherwise stay listed, buffers and all, until exit).
_PRUNE_PENDING_AT = 16

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
_reduce_scatter_flat: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


def _refuse_partial_launch(backend: str) -> None:
    """A launcher ran this process, but not with torch's rendezvous variables: a world of
    one here would silently train N separate models, so say what is missing instead.
    """
    missing = [v for v in _LAUNCH_VARS if v not in os.environ]
    if any(v in os.environ for v in _LAUNCH_VARS):
        raise ValueError(
            f"zero3.comm {backend}: the rendezvous environment is incomplete (missing "
            f"{', '.join(missing)}); torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    if launched_by_mpi():
        raise ValueError(
            f"zero3.comm {backend}: this process was started by mpiexec but "
            f"{', '.join(missing)} are not set, so the ranks cannot meet over "
            "torch.distributed. Use the 'mpi' backend (zero3.comm.create_backend('mpi')), or "
            "export MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE from MPI first "
            "(tools/train.py --backend gloo under mpiexec does this)"
        )


def _import_before_init() -> None:
    """Import ``torch.distributed.nn`` before the default group exists.

    Note:
        Imported after ``init_process_group`` (any torch optimizer imports it, through
        ``torch._dynamo``), its functions' default arguments keep the default group for
        good, and the group's gloo threads live into finalization, where they can abort
        the process (:ref:`fact-gloo-teardown`). Imported first, the defaults are None.
    """
    with contextlib.suppress(ImportError):  # a torch build without it has nothing to fix
        importlib.import_module("torch.distributed.nn")


class TorchWork(Work):
    """A torch.distributed ``Work`` with a bounded host wait and errors naming the collective.

    Note:
        The torch ``Work`` (and through it the collective's tensors) is dropped as soon as
        the collective is known to be complete, so nothing zero3 holds keeps a finished
        collective's buffers alive. Until then the work is also listed in its backend's
        ``pending`` table, which the exit handler uses to wait for collectives nobody
        waited for (:ref:`exit-abort`). The process group is held only weakly: a work the
        program keeps (a variable at module level) must not keep a group that
        :meth:`~zero3.comm.TorchDistBackend.close` destroyed alive into interpreter finalization,
        where its gloo threads can abort the process (:ref:`fact-gloo-teardown`).
    """

    def __init__(
        self,
        work: Any,
        description: str,
        timeout_s: float,
        device_type: str,
        pending: dict[int, TorchWork] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._work: Any = work
        # Whose peers a lost connection is looked up among (weakly: see the Note).
        self._group = weakref.ref(group) if group is not None else None
        self._description = description
        self._timeout = _timedelta(timeout_s)
        self._device_type = device_type
        self._done = False
        self._pending = pending
        if pending is not None:
            pending[id(self)] = self

    def wait(self, stream: Stream | None = None) -> None:
        work = self._work
        if self._done or work is None:
            return
        try:
            if self._device_type == "cpu":
                work.wait(timeout=self._timeout)
            elif stream is None:
                # Device backends: wait() makes the current stream wait, no host sync.
                work.wait()
            else:
                with stream.use():
                    work.wait()
        except RuntimeError as exc:
            message = str(exc)
            first = message.strip().splitlines()[0]
            if "imed out" in message or "imeout" in message:
                raise CommTimeoutError(f"{self._description} failed: {first}") from exc
            if looks_like_peer_gone(message):
                gone, _ = describe_gone(self._group() if self._group is not None else None)
                transport = f"{self._description} failed: {first}"
                who = PeerGoneError(transport, gone).who()
                raise PeerGoneError(f"{transport} ({who})", gone, transport) from exc
            raise CommError(f"{self._description} failed: {first}") from exc
        self._done = True
        if self._device_type == "cpu":  # the data is here: the collective is over
            self._drop()

    def is_completed(self) -> bool:
        work = self._work
        if work is None:
            return True
        # On devices wait() only orders streams; the collective may still be running.
        if not work.is_completed():
            return False
        self._untrack()
        if self._done:
            self._drop()
        return True

    def settle(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for the collective to end,
        raising nothing; True if it has ended, successfully or not.
        """
        while not self.is_completed():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            work = self._work
            if self._device_type != "cpu" or work is None:
                time.sleep(min(remaining, 0.01))
                continue
            with contextlib.suppress(RuntimeError):  # a timeout, or the collective failed
                work.wait(timeout=_timedelta(remaining))
        return True

    def _untrack(self) -> None:
        if self._pending is not None:
            self._pending.pop(id(self), None)
            self._pending = None

    def _drop(self) -> None:
        self._untrack()
        self._work = None


def _timedelta(seconds: float) -> datetime.timedelta:
    """A torch wait timeout: whole milliseconds, at least one (zero means no timeout)."""
    return datetime.timedelta(milliseconds=max(1, math.ceil(seconds * 1000)))


class TorchDistBackend(CommBackend):
    """Common code for backends on a torch.distributed process group.

    Construction uses ``group`` if given, else the default process group if one is
    initialized, else initializes one from the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as torchrun sets them) or from
    ``init_method``/``rank``/``world_size``. With none of those, it makes a world of
    one process so single-process scripts run unchanged. A group created here is
    destroyed by :meth:`close`, or at interpreter exit if the program never closed the
    backend (why that matters for gloo: :ref:`fact-gloo-teardown`); a duplicate's
    group also by :func:`~zero3.comm.release_groups`.

    Note:
        Every collective is issued with ``async_op=True``. On CPU the host waits with the
        backend's timeout, so a peer that never joins raises
        :class:`~zero3.comm.CommTimeoutError` naming the collective after ``timeout_s``
        seconds, even on a process group created elsewhere with torch's 30-minute
        default. On CUDA and NPU ``wait`` only orders streams (no host wait to bound):
        there the process group's own timeout (the NCCL/HCCL watchdog) applies, which
        is ``timeout_s`` when this class creates the group.
    """

    #: The torch.distributed backend name (``"gloo"``, ``"nccl"``, ``"hccl"``).
    dist_backend: ClassVar[str] = ""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self._owns_group = False  # the default group, created here
        self._owns_subgroup = False  # a group created by duplicate()
        self._tmp_store: str | None = None
        # Collectives issued and not yet known to be complete (see TorchWork).
        self._pending: dict[int, TorchWork] = {}
        if group is None:
            if not dist.is_initialized():
                self._init_default_group(timeout_s, init_method, rank, world_size)
            group = dist.group.WORLD
        assert group is not None
        self._group: dist.ProcessGroup | None = group
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout_s=timeout_s)
        _teardown.track(self)
        note_arrival()  # so that peers can tell later whether this process is gone

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the collectives run on.

        Raises:
            CommError: The backend was closed (by :meth:`close`,
                :func:`~zero3.comm.release_groups` or at interpreter exit).
        """
        if self._group is None:
            raise self._closed_error(f"{self.name} backend (rank {self.rank} of {self.world_size})")
        return self._group

    @staticmethod
    def _closed_error(what: str) -> CommError:
        return CommError(
            f"{what}: the backend is closed (by close(), zero3.comm.release_groups() or "
            "at interpreter exit); create a new backend"
        )

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group, or None once the backend is closed."""
        return self._group

    def _init_default_group(
        self,
        timeout_s: float,
        init_method: str | None,
        rank: int | None,
        world_size: int | None,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict[str, Any] = {"backend": self.dist_backend, "timeout": timeout}
        if init_method is not None or rank is not None or world_size is not None:
            if rank is None or world_size is None:
                raise ValueError(
                    f"{self.name}: init_method needs both rank= and world_size= "
                    f"(got rank={rank}, world_size={world_size})"
                )
            kwargs.update(init_method=init_method or "env://", rank=rank, world_size=world_size)
        elif launched_by_torch():
            kwargs.update(init_method="env://")
        else:
            _refuse_partial_launch(self.name)
            # No launcher: a world of one, so `python train.py` works unsharded-but-sane.
            fd, self._tmp_store = tempfile.mkstemp(prefix="zero3-store-")
            os.close(fd)
            kwargs.update(init_method=f"file://{self._tmp_store}", rank=0, world_size=1)
            _log.info("zero3.comm: no launcher environment; running as a world of 1 process")
        self._before_init()
        _import_before_init()
        dist.init_process_group(**kwargs)
        self._owns_group = True
        assert dist.group.WORLD is not None
        _teardown.created_default(dist.group.WORLD)

    def _before_init(self) -> None:
        """Hook for device backends (select the local device before init)."""

    def duplicate(self) -> TorchDistBackend:
        """Open a second group over the same ranks (collective over them).

        Note:
            torch names a local-synchronization group (one only its own ranks create)
            after its ranks and the number of live groups, and destroying a group leaves
            its rendezvous keys in the store: made again, it gets the old name and a peer
            may read the old listener's address ("Connection refused", a flaky
            ``connectFullMesh`` in CI). So a duplicate of the whole world takes torch's
            counter name and may be destroyed by :meth:`close`; a duplicate of a subgroup
            lives until the world is destroyed (:ref:`release-groups`).
        """
        group, whole_world = self._new_group(self.dist_backend)
        twin = type(self)(group=group, timeout_s=self.timeout_s, **self._options())
        twin._owns_subgroup = whole_world
        return twin

    def _new_group(self, backend: str) -> tuple[dist.ProcessGroup, bool]:
        """A new group over this backend's ranks (see :meth:`duplicate`'s Note)."""
        ranks = dist.get_process_group_ranks(self.group)
        whole_world = len(ranks) == dist.get_world_size()
        group = dist.new_group(
            ranks=ranks,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            backend=backend,
            use_local_synchronization=not whole_world,
        )
        # Recorded either way: at exit the program is over, so even a local-name group
        # can be destroyed (nothing will make it again); release_groups() keeps it.
        _teardown.created_group(group, rank_named=not whole_world)
        return group, whole_world

    def host_channel(self) -> CommBackend | None:
        """A gloo group over the same ranks: a duplicate for gloo itself, a gloo group
        beside the device group for NCCL and HCCL (host tensors never wait for a device
        stream). None where this torch build has no gloo.
        """
        if self.device_type == "cpu":
            return super().host_channel()
        if not dist.is_gloo_available():
            return None
        group, whole_world = self._new_group("gloo")
        channel = GlooBackend(group=group, timeout_s=self.timeout_s)
        channel._owns_subgroup = whole_world
        return channel

    def _options(self) -> dict[str, Any]:
        """Constructor options a duplicate must repeat (subclasses extend it)."""
        return {}

    def close(self) -> None:
        """Destroy the group this backend created, if any, and close the backend.

        A closed backend drops its reference to its group (so a destroyed group is freed
        now, not when the interpreter finalizes) and refuses further collectives.
        """
        group = self._group
        if self._owns_subgroup and group is not None and dist.is_initialized():
            with contextlib.suppress(ValueError):  # the user destroyed it already
                dist.destroy_process_group(group)
        if self._owns_group and group is not None and dist.group.WORLD is group:
            dist.destroy_process_group()
        if (self._owns_subgroup or self._owns_group) and group is not None:
            _teardown.forget_group(group)  # this backend's group is the one it created
        self._owns_subgroup = self._owns_group = False
        self.release()

    def settle(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for collectives nobody waited
        for; True if none is still running. Used by the exit handler.
        """
        return all([work.settle(deadline) for work in list(self._pending.values())])

    def release(self) -> None:
        """Close without destroying anything: forget outstanding works and the group."""
        self._pending.clear()
        self._group = None
        _teardown.untrack(self)
        if self._tmp_store is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp_store)
            self._tmp_store = None

    # -- primitives ---------------------------------------------------------------

    def _issue(
        self,
        what: str,
        tensors: tuple[torch.Tensor, ...],
        stream: Stream | None,
        launch: Callable[[], Any],
    ) -> Work:
        description = self.describe(what, *tensors)
        if self._group is None:
            raise self._closed_error(description)
        if len(self._pending) >= _PRUNE_PENDING_AT:
            for pending in list(self._pending.values()):
                pending.is_completed()  # drops the finished ones from the table
        try:
            if stream is None:
                work = launch()
            else:
                with stream.use():
                    work = launch()
        except RuntimeError as exc:
            raise CommError(f"{description} failed to start: {exc}") from exc
        return TorchWork(
            work, description, self.timeout_s, self.device_type, self._pending, self._group
        )

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        return self._issue(
            "all_gather",
            (output, input),
            stream,
            lambda: _all_gather_flat(output, input, group=self.group, async_op=True),
        )

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        return self._issue(
            "reduce_scatter",
            (output, input),
            stream,
            lambda: _reduce_scatter_flat(
                output, input, op=_TORCH_OPS[op], group=self.group, async_op=True
            ),
        )

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: Stream | None) -> Work:
        return self._issue(
            "all_reduce",
            (tensor,),
            stream,
            lambda: dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self.group, async_op=True),
        )

    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        global_src = dist.get_global_rank(self.group, src)
        return self._issue(
            "broadcast",
            (tensor,),
            stream,
            lambda: dist.broadcast(tensor, global_src, group=self.group, async_op=True),
        )

    def _barrier(self) -> Work:
        return self._issue(
            "barrier", (), None, lambda: dist.barrier(group=self.group, async_op=True)
        )


class _AllOf:
    """Several torch.distributed works waited on as one (the same interface)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout=timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class GlooBackend(TorchDistBackend):
    """torch.distributed's gloo on CPU tensors.

    Collectives run on gloo's own thread, so an async all-gather overlaps with host
    compute. Reduces fp32, fp64, fp16, bf16 and integer tensors (SUM, AVG, MAX, MIN).

    Args:
        group: A process group (default: the default group, initialized if needed).
        timeout_s: Collective timeout.
        all_gather_via: ``"broadcast"`` (default): one broadcast per rank, straight into
            the output; ``"native"``: gloo's all-gather.
        reduce_scatter_via: ``"exchange"`` (default): every rank sends chunk ``r`` of
            its input straight to rank ``r`` and sums the ``N - 1`` chunks it receives
            (point-to-point, ``(N-1)/N`` of the input on the wire, the least a
            reduce-scatter can move); ``"all_reduce"``: all-reduce a copy of the input
            and keep this rank's chunk (twice the bytes; core then reduces gradients with
            its all-reduce path and counts them so); ``"native"``: gloo's reduce-scatter.
        **kwargs: ``init_method``, ``rank``, ``world_size`` as for
            :class:`TorchDistBackend`.

    Note:
        The defaults avoid gloo's own all-gather and reduce-scatter, which were slower
        here and allocate a full-size temporary per call (:ref:`fact-gloo-speeds`); the
        other options keep them for comparison. The exchange sends ``N - 1`` messages per
        rank: right for the small worlds gloo serves; a ring would need fewer at hundreds
        of ranks.
    """

    name = "gloo"
    device_type = "cpu"
    dist_backend = "gloo"
    capabilities = Capabilities()  # native reduce-scatter, every float and int dtype

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        all_gather_via: str = "broadcast",
        reduce_scatter_via: str = "exchange",
        **kwargs: Any,
    ) -> None:
        if all_gather_via not in ("broadcast", "native"):
            raise ValueError(
                f"all_gather_via must be 'broadcast' or 'native', got {all_gather_via!r}"
            )
        if reduce_scatter_via not in ("exchange", "all_reduce", "native"):
            raise ValueError(
                "reduce_scatter_via must be 'exchange', 'all_reduce' or 'native', "
                f"got {reduce_scatter_via!r}"
            )
        super().__init__(group, timeout_s=timeout_s, **kwargs)
        self.all_gather_via = all_gather_via
        self.reduce_scatter_via = reduce_scatter_via
        self.capabilities = dataclasses.replace(
            type(self).capabilities, native_reduce_scatter=reduce_scatter_via != "all_reduce"
        )
        self._exchange_tag = 0

    def _options(self) -> dict[str, Any]:
        return {
            "all_gather_via": self.all_gather_via,
            "reduce_scatter_via": self.reduce_scatter_via,
        }

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no gloo support (torch.distributed.is_gloo_available())"
        return None

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        if self.all_gather_via == "native":
            return super()._all_gather(output, input, stream)
        chunks = output.view(self.world_size, -1)
        if chunks[self.rank].data_ptr() != input.data_ptr():
            chunks[self.rank].copy_(input)

        def launch() -> _AllOf:
            return _AllOf(
                [
                    dist.broadcast(
                        chunks[r],
                        dist.get_global_rank(self.group, r),
                        group=self.group,
                        async_op=True,
                    )
                    for r in range(self.world_size)
                ]
            )

        return self._issue("all_gather", (output, input), stream, launch)

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        if self.reduce_scatter_via == "native":
            return super()._reduce_scatter(output, input, op, stream)
        if self.reduce_scatter_via == "exchange":
            return self._reduce_scatter_exchange(output, input, op, stream)
        scratch = input.clone()
        work = self._issue(
            "reduce_scatter",
            (output, input),
            stream,
            lambda: dist.all_reduce(scratch, op=_TORCH_OPS[op], group=self.group, async_op=True),
        )
        mine = scratch.view(self.world_size, -1)[self.rank]

        def keep_mine() -> None:
            output.copy_(mine)

        return ThenWork(work, keep_mine)

    def _reduce_scatter_exchange(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        """Reduce-scatter by direct exchange: send chunk ``r`` to rank ``r``, then reduce
        this rank's chunk with the ``N - 1`` that arrive (see the class note).
        """
        world, rank = self.world_size, self.rank
        chunks = input.view(world, -1)
        received = torch.empty((world - 1, chunks.shape[1]), dtype=input.dtype)
        # Every rank issues its reduce-scatters in the same order, so a per-call tag
        # pairs each message with its own call even when several are in flight.
        tag = self._exchange_tag
        self._exchange_tag = (self._exchange_tag + 1) % (1 << 24)

        def launch() -> _AllOf:
            works = []
            for k in range(1, world):
                to = dist.get_global_rank(self.group, (rank + k) % world)
                source = dist.get_global_rank(self.group, (rank - k) % world)
                works.append(dist.isend(chunks[(rank + k) % world], to, self.group, tag))
                works.append(dist.irecv(received[k - 1], source, self.group, tag))
            return _AllOf(works)

        work = self._issue("reduce_scatter", (output, input), stream, launch)

        def combine() -> None:
            # The first received chunk combines with this rank's own straight into the
            # output: one pass over it instead of a copy and then a reduction.
            fold = {ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}.get(op, torch.add)
            if world == 1:
                if output.data_ptr() != chunks[rank].data_ptr():  # in place: nothing to do
                    output.copy_(chunks[rank])
            else:
                fold(chunks[rank], received[0], out=output)
            for part in received[1:]:
                fold(output, part, out=output)
            if op is ReduceOp.AVG:
                if output.is_floating_point():
                    output.div_(world)
                else:
                    output.div_(world, rounding_mode="trunc")

        return ThenWork(work, combine)
