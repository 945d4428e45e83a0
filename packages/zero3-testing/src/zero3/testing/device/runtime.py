"""``torch.zdev``: the device module of the zdev test device (as ``torch.cuda`` is CUDA's).

zero3's stream code asks ``torch.get_device_module(device_type)`` for ``Stream``,
``current_stream``, ``Event`` and ``stream``; torch itself asks it for ``device_count``,
``is_available`` and the seeding functions. Everything here is a thin layer over
``torch.accelerator`` and the generic ``torch.Stream``/``torch.Event``, which reach the
device guard in C++: the same calls a CUDA run makes, so the race detector sees them.

Random numbers on zdev come from the CPU generator (the CPU fallback runs the CPU
kernels), so ``torch.manual_seed`` seeds them; the seeding functions here do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "Event",
    "Stream",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "get_amp_supported_dtype",
    "init",
    "is_available",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "memory_allocated",
    "set_device",
    "set_stream",
    "stream",
    "synchronize",
]

DeviceLike = torch.device | str | int | None


def _index(device: DeviceLike) -> int:
    """The zdev device index ``device`` names (the current device for None)."""
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    parsed = torch.device(device)
    if parsed.type != "zdev":
        raise ValueError(f"expected a zdev device, got {parsed}")
    return torch.accelerator.current_device_index() if parsed.index is None else parsed.index


class Stream(torch.Stream):
    """A new stream on a zdev device (the current one by default)."""

    def __new__(cls, device: DeviceLike = None, priority: int = 0) -> Stream:
        where = torch.device("zdev", _index(device))
        return super().__new__(cls, device=where, priority=priority)


class Event(torch.Event):
    """An event on a zdev device (recorded on the current stream unless told otherwise)."""

    def __new__(
        cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> Event:
        where = torch.device("zdev", _index(None))
        return super().__new__(
            cls,
            device=where,
            enable_timing=enable_timing,
            blocking=blocking,
            interprocess=interprocess,
        )


def is_available() -> bool:
    """Always True once the device is loaded."""
    return True


def is_initialized() -> bool:
    """Always True: there is nothing to initialise lazily."""
    return True


def init() -> None:
    """Nothing to do (present because torch.cuda has it)."""


def device_count() -> int:
    """The number of zdev devices."""
    return int(torch.ops.zdev.device_count())


def current_device() -> int:
    """The current zdev device index of this thread."""
    return torch.accelerator.current_device_index()


def set_device(device: DeviceLike) -> None:
    """Make ``device`` this thread's current zdev device."""
    torch.accelerator.set_device_index(_index(device))


@contextlib.contextmanager
def device(device: DeviceLike) -> Iterator[None]:
    """Context manager making ``device`` the current zdev device."""
    with torch.accelerator.device_index(_index(device)):
        yield


def current_stream(device: DeviceLike = None) -> torch.Stream:
    """This thread's current stream on ``device``."""
    return torch.accelerator.current_stream(_index(device))


def default_stream(device: DeviceLike = None) -> torch.Stream:
    """The default stream of ``device`` (stream 0)."""
    return torch.Stream(stream_id=0, device_index=_index(device), device_type=_device_type_id())


def _device_type_id() -> int:
    return int(torch._C._autograd.DeviceType.PrivateUse1.value)


def set_stream(stream: torch.Stream) -> None:
    """Make ``stream`` the current stream of its device (and its device the current one)."""
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream | None) -> Iterator[None]:
    """Context manager making ``stream`` current; the device and stream are restored after."""
    if stream is None:
        yield
        return
    previous_device = torch.accelerator.current_device_index()
    previous = torch.accelerator.current_stream(stream.device_index)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)
        torch.accelerator.set_device_index(previous_device)


def synchronize(device: DeviceLike = None) -> None:
    """Block the host until every stream of ``device`` is done (a host synchronisation)."""
    torch.accelerator.synchronize(_index(device))


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes of zdev memory allocated on ``device`` now."""
    return int(torch.ops.zdev.memory_allocated(_index(device)))


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes ``torch.autocast("zdev")`` accepts (asked by autocast and checkpointing)."""
    return [torch.float16, torch.bfloat16]


def manual_seed(seed: int) -> None:
    """Nothing to seed: zdev draws from the CPU generator (``torch.manual_seed``)."""


def manual_seed_all(seed: int) -> None:
    """Nothing to seed: zdev draws from the CPU generator (``torch.manual_seed``)."""


def _is_in_bad_fork() -> bool:
    return False
