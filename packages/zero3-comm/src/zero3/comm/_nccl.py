"""NCCL through torch.distributed on CUDA devices."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zero3.comm._torch_dist import TorchDistBackend
from zero3.comm._types import FLOAT_DTYPES, INT_DTYPES, Capabilities

__all__ = ["NCCLBackend"]


class NCCLBackend(TorchDistBackend):
    """torch.distributed's NCCL on CUDA tensors.

    Collectives are issued on the given stream (torch's NCCL process group makes its
    internal stream wait for it) and ``Work.wait(stream)`` makes the consumer stream
    wait through a CUDA event: no host synchronization anywhere. Before creating the
    process group the backend selects ``cuda:LOCAL_RANK`` so each local rank owns one
    device (NCCL refuses two ranks on one GPU).
    """

    name = "nccl"
    device_type = "cuda"
    dist_backend = "nccl"
    capabilities = Capabilities(
        native_reduce_scatter=True,
        reduce_dtypes=FLOAT_DTYPES | INT_DTYPES,
        needs_progress_helper=False,
        async_host=True,
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        if not dist.is_available() or not dist.is_nccl_available():
            return "this torch build has no NCCL support (install a CUDA build of torch)"
        return None

    def _before_init(self) -> None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())
