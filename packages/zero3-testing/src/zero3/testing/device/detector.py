"""The zdev race detector: what it checks and how tests drive it.

The detector lives in the device (C++) and is on from the moment the device loads. It is
the algorithm of PyTorch's CUDA sanitizer: every stream and the host keep a vector clock;
every kernel, copy and collective tells it what it reads and writes on which stream;
events, stream waits and host synchronisations merge clocks. It raises ``RuntimeError``
(message starting ``zdev race detector:``) on

* **an unsynchronised cross-stream access**: a kernel on one stream reads or writes a
  tensor whose last write (or, for a write, a read since) came from another stream that
  it has not waited for;
* **a use after free**: a tensor's memory freed (back in the pool of the stream that
  allocated it) while another stream may still use it, with neither a wait nor
  ``record_stream``. The deallocation cannot raise, so the next zdev operation (or
  :func:`check`) does;
* **an unsynchronised host read**: ``.item()``, ``.cpu()``, ``.tolist()`` of a result
  the reading thread's current stream has not waited for (a blocking copy waits only for
  its own stream, as on CUDA).

A dispatch mode would see neither stream/event calls nor gloo's writes: the device
guard reports the first, and the ``zdev`` comm backend records each collective's reads
and writes on its comm stream (``torch.ops.zdev.comm_access``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "SYNC_KINDS",
    "check",
    "disabled",
    "enabled",
    "host_syncs",
    "label_stream",
    "set_enabled",
    "take_pending",
]

#: Host synchronisations the device counts, in the order of :func:`host_syncs`.
SYNC_KINDS = ("stream", "event", "device", "to-host", "to-device")


def enabled() -> bool:
    """True while the detector checks accesses (the default)."""
    return bool(torch.ops.zdev.detector_enabled())


def set_enabled(on: bool) -> None:
    """Turn the checks on or off (off forgets every recorded access)."""
    torch.ops.zdev.detector_set_enabled(on)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run a block without checks (accesses made inside are forgotten)."""
    before = enabled()
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def check() -> None:
    """Raise the first violation found at a deallocation, if any (and forget the rest)."""
    torch.ops.zdev.detector_raise_pending()


def take_pending() -> list[str]:
    """The violations found at deallocations and not raised yet (forgotten after)."""
    return list(torch.ops.zdev.detector_take_pending())


def host_syncs() -> dict[str, int]:
    """Host synchronisations so far in this process, by kind (:data:`SYNC_KINDS`).

    ``stream``/``event``/``device``: an explicit ``synchronize()``; ``to-host``: a
    blocking copy to the host or ``.item()``; ``to-device``: a blocking copy to the
    device. Non-blocking copies do not synchronise and are not counted.
    """
    counts = torch.ops.zdev.host_sync_counts()
    return dict(zip(SYNC_KINDS, (int(c) for c in counts), strict=True))


def label_stream(stream: torch.Stream, label: str) -> None:
    """Name ``stream`` in the detector's messages (``stream 3 of zdev:0 (label)``)."""
    torch.ops.zdev.stream_label(stream.device_index, stream.stream_id, label)
