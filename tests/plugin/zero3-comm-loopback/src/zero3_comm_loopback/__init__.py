"""A third-party zero3 comm backend plugin: ``loopback``, a single-rank backend.

This package is the worked example of the docs' plugin guide. It shows the three
things a plugin needs:

1. a :class:`zero3.comm.CommBackend` subclass implementing the five primitives;
2. a ``zero3_comm_register_backends`` hook implementation marked with
   :data:`zero3.comm.hookimpl` that registers it under a name;
3. an entry point in the ``zero3.comm`` group naming this module (see pyproject.toml).

With a world of one rank every collective is a local copy, which makes the backend a
real (if small) one: sharded code runs unchanged in a single process without any
process group, e.g. for debugging or for inference on one machine.
"""

from __future__ import annotations

import torch

from zero3.comm import (
    BackendRegistry,
    Capabilities,
    CommBackend,
    CompletedWork,
    ReduceOp,
    Stream,
    Work,
    hookimpl,
)

__all__ = ["LoopbackBackend", "zero3_comm_register_backends"]


class LoopbackBackend(CommBackend):
    """Every collective over a world of one rank: a local copy, completed at once."""

    name = "loopback"
    device_type = "cpu"
    capabilities = Capabilities(native_reduce_scatter=True, async_host=False)

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        super().__init__(rank=0, world_size=1, timeout_s=timeout_s)

    def duplicate(self) -> LoopbackBackend:
        return LoopbackBackend(timeout_s=self.timeout_s)

    def _all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        stream: Stream | None,
    ) -> Work:
        output.copy_(input)
        return CompletedWork()

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        stream: Stream | None,
    ) -> Work:
        output.copy_(input)  # sum, average, max and min of one value are that value
        return CompletedWork()

    def _all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        stream: Stream | None,
    ) -> Work:
        return CompletedWork()

    def _broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None) -> Work:
        return CompletedWork()

    def _barrier(self) -> Work:
        return CompletedWork()


@hookimpl
def zero3_comm_register_backends(registry: BackendRegistry) -> None:
    """Register :class:`LoopbackBackend` as ``"loopback"``."""
    registry.register("loopback", LoopbackBackend)
