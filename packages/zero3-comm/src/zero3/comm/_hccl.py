"""HCCL through torch.distributed and torch_npu on Ascend NPUs."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from zero3.comm._torch_dist import TorchDistBackend
from zero3.comm._types import FLOAT_DTYPES, INT_DTYPES, Capabilities

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
        actually importing it, and never at module import time (NOTES: an installed
        torch_npu without CANN breaks ``import torch`` unless autoloading is off).
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
    """

    name = "hccl"
    device_type = "npu"
    dist_backend = "hccl"
    capabilities = Capabilities(
        native_reduce_scatter=True,
        reduce_dtypes=FLOAT_DTYPES | INT_DTYPES,
        needs_progress_helper=False,
        async_host=True,
    )

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

    def _before_init(self) -> None:
        import_torch_npu()
        npu = torch.get_device_module("npu")  # registered by torch_npu
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        npu.set_device(local_rank % npu.device_count())

    def device(self) -> torch.device:
        return torch.device("npu", torch.get_device_module("npu").current_device())
