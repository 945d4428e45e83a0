"""The swap directory's bandwidth, measured the way optimizer offload uses it."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path


def swap_dir() -> str:
    """Where the NVMe rows put their swap files: ``ZERO3_BENCH_SWAP`` or the temp dir."""
    return os.environ.get("ZERO3_BENCH_SWAP") or tempfile.gettempdir()


def bandwidth(directory: str, nbytes: int = 256 * 2**20) -> dict[str, float | bool]:
    """Write then read one ``nbytes`` file under ``directory`` through zero3's swap files
    (``O_DIRECT`` where the filesystem allows it, 1 MiB requests, one thread).

    Returns:
        ``write_mib_s``, ``read_mib_s`` and ``direct`` (whether ``O_DIRECT`` was used;
        without it the page cache may serve the read and the figure means little).
    """
    from zero3.core.engine import AlignedBuffer, SwapFile

    buf = AlignedBuffer(nbytes)
    buf.tensor.fill_(1)  # touched before timing: page faults are not disk time
    file = SwapFile(Path(directory) / f"zero3-bench-disk-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        file.reserve(nbytes)
        start = time.perf_counter()
        file.write(buf, nbytes)
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        file.read(buf, nbytes)
        read = time.perf_counter() - start
    finally:
        file.close()
    mib = nbytes / 2**20
    return {"write_mib_s": mib / wrote, "read_mib_s": mib / read, "direct": file.direct}
