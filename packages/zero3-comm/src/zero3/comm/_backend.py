"""The abstract communication interface every backend implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

import torch

from zero3.comm._stream import Stream
from zero3.comm._types import Capabilities, ReduceOp, UnsupportedDTypeError
from zero3.comm._work import ThenWork, Work

__all__ = ["DEFAULT_TIMEOUT_S", "CommBackend"]

#: Default collective timeout in seconds. Short on purpose: a stuck peer should surface as an
#: error naming the collective within minutes, not after torch's 30-minute default.
DEFAULT_TIMEOUT_S = 300.0


class CommBackend(abc.ABC):
    """Collectives over one fixed group of ranks.

    An instance is bound to one group (``rank``, ``world_size``) and serves one device
    type. Every collective takes its output and input tensors and an optional
    ``stream`` on which to issue the work, and returns a :class:`~zero3.comm.Work`
    whose ``wait(stream)`` makes the consumer wait. Outputs are valid only after
    ``wait``.

    Subclasses implement the ``_all_gather``, ``_reduce_scatter``, ``_all_reduce``,
    ``_broadcast`` and ``_barrier`` primitives; the public methods here validate
    arguments first (device, dtype, sizes, contiguity) so every backend reports bad
    input the same way. The coalesced forms have default implementations built on the
    flat ones (one collective on a packed buffer); a backend may override them.

    Attributes:
        name: The name the backend is registered under.
        device_type: The torch device type of the tensors it moves (``"cpu"``, ``"cuda"``...).
        capabilities: What the backend can do (see :class:`~zero3.comm.Capabilities`).
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"
    capabilities: Capabilities = Capabilities()

    def __init__(self, rank: int, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world size {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._rank = rank
        self._world_size = world_size
        self.timeout_s = float(timeout_s)

    # -- identity -----------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world_size

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here, or None if it can.

        The message says what to install or which hardware is missing. The default
        implementation says the backend is always available.
        """
        return None

    @classmethod
    def is_available(cls) -> bool:
        """Return True if this backend can run on this machine."""
        return cls.unavailable_reason() is None

    def device(self) -> torch.device:
        """The device this process's tensors should live on."""
        return torch.device(self.device_type)

    def current_stream(self) -> Stream:
        """The current (compute) stream of this backend's device."""
        return Stream.for_device(self.device_type)

    def new_stream(self) -> Stream:
        """A new side stream on this backend's device (for overlapping communication)."""
        return Stream.for_device(self.device_type, new=True)

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources the backend owns (a process group it created, threads)."""

    def duplicate(self) -> CommBackend:
        """A new backend over the same ranks with an independent collective sequence.

        Every rank of the group must call it, in the same order. zero3 gathers
        parameters on one instance and reduces gradients on a duplicate, so the two
        streams of collectives can interleave differently on different ranks (gradient
        arrival timing is data-dependent) without ever pairing a gather with a
        reduction. Backends that cannot duplicate raise NotImplementedError; core then
        defers gradient reductions to the end of backward.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement duplicate()")

    def host_channel(self) -> CommBackend | None:
        """A backend over the same ranks that moves host (CPU) tensors, for small
        control messages that must never wait for a device stream; None if this
        backend cannot provide one.

        Every rank of the group must call it, in the same order. The default is a
        :meth:`duplicate` for host backends and None for device backends; device
        backends built on ``torch.distributed`` open a gloo group beside themselves.
        The caller owns the result (and closes it).
        """
        if self.device_type != "cpu":
            return None
        try:
            return self.duplicate()
        except NotImplementedError:
            return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # -- public collectives (validated) ---------------------------------------------

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, stream: Stream | None = None
    ) -> Work:
        """Gather every rank's ``input`` into ``output`` (concatenated in rank order).

        Args:
            output: Contiguous tensor of ``world_size * input.numel()`` elements.
            input: This rank's contribution. It may be ``output``'s own chunk
                (``output.view(world_size, -1)[rank]``): an in-place all-gather, which
                every backend must support (it saves a copy of the send buffer).
            stream: Stream to issue the collective on (default: the current stream).
        """
        input = self._prepare_input(input, "all_gather")
        self._check_output(output, "all_gather", input.dtype)
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"{self.name}.all_gather: output has {output.numel()} elements but needs "
                f"world_size * input.numel() = {self.world_size} * {input.numel()}"
            )
        return self._all_gather(output.view(-1), input.view(-1), stream)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        op: ReduceOp = ReduceOp.AVG,
        stream: Stream | None = None,
    ) -> Work:
        """Reduce ``input`` over ranks and leave chunk ``rank`` of the result in ``output``.

        Args:
            output: Contiguous tensor of ``input.numel() // world_size`` elements.
            input: ``world_size`` equal chunks, chunk ``r`` destined for rank ``r``.
            op: The reduction (default: average over ranks).
            stream: Stream to issue the collective on.
        """
        input = self._prepare_input(input, "reduce_scatter")
        self._check_output(output, "reduce_scatter", input.dtype)
        self._check_reduce(input.dtype, op, "reduce_scatter")
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"{self.name}.reduce_scatter: input has {input.numel()} elements but needs "
                f"world_size * output.numel() = {self.world_size} * {output.numel()}"
            )
        return self._reduce_scatter(output.view(-1), input.view(-1), op, stream)

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp = ReduceOp.SUM, stream: Stream | None = None
    ) -> Work:
        """Reduce ``tensor`` over ranks in place."""
        self._check_output(tensor, "all_reduce", tensor.dtype)
        self._check_reduce(tensor.dtype, op, "all_reduce")
        return self._all_reduce(tensor.view(-1), op, stream)

    def broadcast(self, tensor: torch.Tensor, src: int, *, stream: Stream | None = None) -> Work:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
        self._check_output(tensor, "broadcast", tensor.dtype)
        if not 0 <= src < self.world_size:
            raise ValueError(
                f"{self.name}.broadcast: src={src} is not a rank of a group of {self.world_size}"
            )
        return self._broadcast(tensor.view(-1), src, stream)

    def barrier(self) -> Work:
        """Synchronize all ranks; the returned work completes once every rank arrived."""
        return self._barrier()

    def all_gather_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        stream: Stream | None = None,
    ) -> Work:
        """All-gather a list of tensors in one collective.

        ``outputs[i]`` receives every rank's ``inputs[i]`` concatenated in rank order.
        The default packs the inputs into one buffer, gathers once and unpacks on wait.
        All tensors must share one dtype.
        """
        self._check_lists(outputs, inputs, "all_gather_coalesced")
        sizes = [t.numel() for t in inputs]
        for out, n in zip(outputs, sizes, strict=True):
            if out.numel() != n * self.world_size:
                raise ValueError(
                    f"{self.name}.all_gather_coalesced: an output has {out.numel()} elements "
                    f"but its input needs {self.world_size} * {n}"
                )
        send = torch.cat([t.reshape(-1) for t in inputs])
        recv = send.new_empty(send.numel() * self.world_size)
        self._after_packing(stream)
        work = self.all_gather(recv, send, stream=stream)

        def unpack() -> None:
            per_rank = recv.view(self.world_size, -1).split(sizes, dim=1)
            for out, chunk in zip(outputs, per_rank, strict=True):
                out.view(self.world_size, -1).copy_(chunk)

        return ThenWork(work, unpack)

    def reduce_scatter_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        op: ReduceOp = ReduceOp.AVG,
        stream: Stream | None = None,
    ) -> Work:
        """Reduce-scatter a list of tensors in one collective.

        ``inputs[i]`` holds ``world_size`` chunks; chunk ``rank`` of the reduction lands
        in ``outputs[i]``. The default packs the inputs rank-major (chunk ``r`` of every
        input in region ``r``) so one flat reduce-scatter serves the whole list.
        """
        self._check_lists(outputs, inputs, "reduce_scatter_coalesced")
        sizes = [t.numel() for t in outputs]
        for inp, n in zip(inputs, sizes, strict=True):
            if inp.numel() != n * self.world_size:
                raise ValueError(
                    f"{self.name}.reduce_scatter_coalesced: an input has {inp.numel()} "
                    f"elements but its output needs {self.world_size} * {n}"
                )
        send = torch.cat([t.reshape(self.world_size, -1) for t in inputs], dim=1)
        recv = send.new_empty(sum(sizes))
        self._after_packing(stream)
        work = self.reduce_scatter(recv, send.view(-1), op=op, stream=stream)

        def unpack() -> None:
            for out, chunk in zip(outputs, recv.split(sizes), strict=True):
                out.view(-1).copy_(chunk)

        return ThenWork(work, unpack)

    def _after_packing(self, stream: Stream | None) -> None:
        """Order ``stream`` after the packing just queued on the current stream.

        The coalesced defaults pack with ``torch.cat`` on the caller's current stream;
        a collective issued on another stream must not start before that copy has run
        (on a GPU it would send a buffer whose packing kernel is still queued).
        """
        if stream is not None:
            stream.wait_stream(self.current_stream())

    # -- primitives subclasses implement ----------------------------------------

    @abc.abstractmethod
    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream | None) -> Work:
        """All-gather flat, contiguous, validated tensors."""

    @abc.abstractmethod
    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, stream: Stream | None
    ) -> Work:
        """Reduce-scatter flat, contiguous, validated tensors."""

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: Stream | None) -> Work:
        """All-reduce a flat, contiguous, validated tensor in place."""

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        """Broadcast a flat, contiguous, validated tensor from ``src``."""

    @abc.abstractmethod
    def _barrier(self) -> Work:
        """Synchronize all ranks."""

    # -- validation -----------------------------------------------------------------

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.device.type != self.device_type:
            raise ValueError(
                f"{self.name}.{what}: tensor is on {tensor.device} but the {self.name!r} "
                f"backend moves {self.device_type} tensors; move the tensor or pick a "
                f"backend for {tensor.device.type} (zero3.comm.available_backends())"
            )

    def _prepare_input(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        # A non-contiguous input would be sent in memory order by byte-level
        # transports: make it contiguous instead (one copy, never wrong data).
        self._check_device(tensor, what)
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def _check_output(self, tensor: torch.Tensor, what: str, dtype: torch.dtype) -> None:
        self._check_device(tensor, what)
        if not tensor.is_contiguous():
            raise ValueError(
                f"{self.name}.{what}: the output/in-place tensor must be contiguous "
                f"(got strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}); "
                "pass a contiguous buffer and copy from it"
            )
        if tensor.dtype != dtype:
            raise TypeError(
                f"{self.name}.{what}: output dtype {tensor.dtype} differs from input dtype {dtype}"
            )

    def _check_reduce(self, dtype: torch.dtype, op: ReduceOp, what: str) -> None:
        if not isinstance(op, ReduceOp):
            raise TypeError(f"{self.name}.{what}: op must be a zero3.comm.ReduceOp, got {op!r}")
        if dtype not in self.capabilities.reduce_dtypes:
            allowed = ", ".join(sorted(str(d) for d in self.capabilities.reduce_dtypes))
            raise UnsupportedDTypeError(
                f"{self.name}.{what}: the {self.name!r} backend cannot reduce {dtype}; "
                f"it reduces: {allowed}. Cast the tensor (or set Zero3Config.reduce_dtype)."
            )

    def _check_lists(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], what: str
    ) -> None:
        if len(outputs) != len(inputs):
            raise ValueError(f"{self.name}.{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        if not inputs:
            raise ValueError(f"{self.name}.{what}: empty tensor list")
        dtypes = {t.dtype for t in (*inputs, *outputs)}
        if len(dtypes) != 1:
            raise TypeError(
                f"{self.name}.{what}: all tensors must share one dtype, got "
                f"{sorted(map(str, dtypes))}; issue one coalesced call per dtype"
            )
        for out in outputs:
            self._check_output(out, what, out.dtype)

    def describe(self, what: str, *tensors: torch.Tensor) -> str:
        """A one-line description of a collective for error messages."""
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        return f"{self.name}.{what}({shapes}) on rank {self.rank} of {self.world_size}"
