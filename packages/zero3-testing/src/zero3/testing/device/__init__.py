"""zdev: a simulated accelerator for the test suite (development only).

``import zero3.testing.device`` registers the device type ``zdev`` (PyTorch's
PrivateUse1, renamed) in this process: four devices, ``zdev:0`` .. ``zdev:3``, whose
memory the host cannot touch except through the device's copies; streams and events
(``torch.zdev``, ``torch.accelerator``); pinned host memory and non-blocking copies; every
operator through CPU kernels; and a race detector that raises where a real device could
race (see :mod:`zero3.testing.device.detector`). The ``zdev`` comm backend
(``Zero3Config(backend="zdev")``) moves zdev tensors through gloo.

Loading it makes ``torch.accelerator.is_available()`` true for the whole process, so
only processes that want a device import it (the device tests' own worker group).
The C++ library is built on first use and cached (:mod:`zero3.testing._zdev_build`).

Note (the order of registration, each step needing the one before):
    1. rename PrivateUse1 to ``zdev`` (device strings parse from here on);
    2. load the library (kernels, allocator and device guard register as it loads);
    3. register the PrivateUse1 hooks (torch asks them whether an accelerator exists,
       for pinned memory and for the device of a pointer);
    4. register ``torch.zdev`` (:mod:`zero3.testing.device.runtime`), which torch's
       device-generic code looks up by name.
"""

from __future__ import annotations

import torch
from torch.utils.backend_registration import rename_privateuse1_backend

from zero3.testing._zdev_build import BuildInfo, ToolchainMissing, ensure_built
from zero3.testing.device import detector, runtime

__all__ = ["DEVICE_TYPE", "BuildInfo", "ToolchainMissing", "build_info", "detector", "runtime"]

DEVICE_TYPE = "zdev"


def _register() -> BuildInfo:
    if hasattr(torch, DEVICE_TYPE):  # a second import: already registered
        return ensure_built()
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", DEVICE_TYPE):
        raise RuntimeError(
            f"zero3.testing.device: PrivateUse1 is already renamed to {name!r} in this "
            "process (another out-of-tree device is loaded); zdev needs it"
        )
    info = ensure_built()
    if name != DEVICE_TYPE:
        rename_privateuse1_backend(DEVICE_TYPE)
    torch.ops.load_library(str(info.library))
    torch.ops.zdev.register_hooks()
    torch._register_device_module(DEVICE_TYPE, runtime)
    # torch 2.13 treats a PrivateUse1 tensor as incompatible with a CPU one for
    # `param.data = ...`, so Module.to("zdev") would make new Parameter objects and
    # untie tied weights; swapping keeps the objects, as moving to CUDA does.
    torch.__future__.set_swap_module_params_on_conversion(True)
    return info


_BUILD = _register()


def build_info() -> BuildInfo:
    """How this process got the library (built now or cached, and the compile time)."""
    return _BUILD
