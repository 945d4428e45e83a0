"""Setup of the device tests' worker processes (``GroupPool(setup=...)``).

Importing it loads the zdev device into the worker. :func:`after_case` runs after each
case that passed: a use-after-free the detector found at a deallocation (which cannot
raise where it happens) fails the case that caused it, and the next case starts on the
default streams with the detector on, whatever this one changed.
"""

from __future__ import annotations

import gc
import os

import torch

from zero3.testing.device import detector, runtime

__all__ = ["after_case"]


def after_case() -> None:
    """Fail the case on a pending violation; reset device, streams and the detector.

    Raises:
        AssertionError: The detector found a use after free during the case.
    """
    gc.collect()  # deallocations of reference cycles happen here, inside the case
    pending = detector.take_pending()
    for index in range(runtime.device_count()):
        runtime.set_stream(runtime.default_stream(index))
    runtime.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    detector.set_enabled(True)
    torch.set_default_device(None)
    if pending:
        raise AssertionError(
            f"{len(pending)} violation(s) found at deallocations during the case:\n"
            + "\n".join(pending)
        )
