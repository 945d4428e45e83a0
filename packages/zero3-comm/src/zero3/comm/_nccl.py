"""NCCL through torch.distributed on CUDA devices."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero3.comm._launch import local_device_index
from zero3.comm._torch_dist import TorchDistBackend
from zero3.comm._types import BackendUnavailableError, Capabilities

__all__ = ["NCCLBackend"]


class NCCLBackend(TorchDistBackend):
    """torch.distributed's NCCL on CUDA tensors.

    Collectives are issued on the given stream (torch's NCCL process group makes its
    internal stream wait for it) and ``Work.wait(stream)`` makes the consumer stream
    wait through a CUDA event: no host synchronization anywhere.

    Args:
        group: As for :class:`~zero3.comm.TorchDistBackend`.
        device: The CUDA device of this rank. Default: ``cuda:LOCAL_RANK`` (the rank on
            this node, from torchrun or the MPI launcher, never the global rank), or the
            current device when no launcher set one; it becomes the current device
            before any process group exists, so each local rank owns one device (NCCL
            refuses two ranks on one GPU) whether or not this backend creates the group.
        **kwargs: ``timeout_s``, ``init_method``, ``rank``, ``world_size``.
    """

    name = "nccl"
    device_type = "cuda"
    dist_backend = "nccl"
    capabilities = Capabilities()  # native reduce-scatter, every float and int dtype

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: int | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"the nccl backend cannot run here: {reason}")
        if isinstance(device, torch.device):
            device = device.index
        if device is None:
            device = local_device_index(torch.cuda.device_count(), self.name)
        self._index = torch.cuda.current_device() if device is None else int(device)
        torch.cuda.set_device(self._index)
        super().__init__(group, **kwargs)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        if not dist.is_available() or not dist.is_nccl_available():
            return "this torch build has no NCCL support (install a CUDA build of torch)"
        return None

    def _options(self) -> dict[str, Any]:
        return {"device": self._index}

    def device(self) -> torch.device:
        return torch.device("cuda", self._index)
