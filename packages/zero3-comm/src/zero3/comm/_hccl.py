"""HCCL through torch.distributed and torch_npu on Ascend NPUs."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from zero3.comm._launch import local_device_index
from zero3.comm._torch_dist import TorchDistBackend
from zero3.comm._types import BackendUnavailableError, Capabilities

__all__ = ["HCCLBackend", "import_torch_npu"]

_INSTALL_HINT = (
    "install torch_npu matching your torch (pip install 'zero3-comm[npu]') on a machine with "
    "the Ascend CANN toolkit (source set_env.sh so libhccl.so is found)"
)


def import_torch_npu() -> ModuleType:
    """Import torch_npu, turning every way it can fail into one clear ImportError.

    Note:
        ``importlib.util.find_spec("torch_npu")`` is truthy even when the import fails
        (without CANN, loading ``libhccl.so`` raises), so availability is decided by
        actually importing it, and never at module import time (an installed torch_npu
        without CANN breaks ``import torch`` unless autoloading is off:
        :ref:`fact-accelerator-libraries`).
    """
    try:
        return importlib.import_module("torch_npu")
    except ModuleNotFoundError as exc:
        raise ImportError(
            f"the hccl backend needs torch_npu, which is not installed: {_INSTALL_HINT}"
        ) from exc
    except (ImportError, OSError, RuntimeError) as exc:
        raise ImportError(
            f"torch_npu is installed but failed to import ({exc}); {_INSTALL_HINT}"
        ) from exc


class HCCLBackend(TorchDistBackend):
    """torch.distributed's HCCL on Ascend NPU tensors (through torch_npu).

    Streams and events are NPU streams (``torch.npu.Stream``); ``Work.wait(stream)``
    makes the consumer stream wait without a host sync, as with NCCL. torch_npu is
    imported only when the backend is asked for.

    Args:
        group: As for :class:`~zero3.comm.TorchDistBackend`.
        device: The NPU of this rank. Default: ``npu:LOCAL_RANK`` (the rank on this
            node, never the global rank), or the current NPU when no launcher set one;
            it becomes the current device before any process group exists.
        **kwargs: ``timeout_s``, ``init_method``, ``rank``, ``world_size``.
    """

    name = "hccl"
    device_type = "npu"
    dist_backend = "hccl"
    capabilities = Capabilities()  # native reduce-scatter, every float and int dtype

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import_torch_npu()
        except ImportError as exc:
            return str(exc)
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return "torch_npu imported but no Ascend NPU is visible (torch.npu.is_available())"
        return None

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: int | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"the hccl backend cannot run here: {reason}")
        npu = torch.get_device_module("npu")  # registered by torch_npu
        if isinstance(device, torch.device):
            device = device.index
        if device is None:
            device = local_device_index(npu.device_count(), self.name)
        self._index = int(npu.current_device()) if device is None else int(device)
        npu.set_device(self._index)
        super().__init__(group, **kwargs)

    def _options(self) -> dict[str, Any]:
        return {"device": self._index}

    def device(self) -> torch.device:
        return torch.device("npu", self._index)
