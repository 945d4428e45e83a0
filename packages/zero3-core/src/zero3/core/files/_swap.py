"""Swap files for offloaded state: page-aligned host buffers, direct I/O, I/O threads.

Note (why this shape):
    The page cache makes offload to disk look free: a buffered write lands in host
    memory that neither RSS nor ``RLIMIT_DATA`` counts, and a re-read comes from there.
    Swap files are therefore opened with ``O_DIRECT`` where the filesystem allows it,
    which needs page-aligned buffers, offsets and lengths: buffers are private
    anonymous ``mmap`` regions (page-aligned, returned to the system when dropped,
    unlike small ``malloc`` blocks that glibc keeps; private, so that ``RLIMIT_DATA``
    counts them as it counts the memory they replace: Python's default mapping is
    shared, which that limit does not count), and every length is rounded up to a
    page. Where ``O_DIRECT`` is refused the file is written buffered and its pages are
    dropped from the cache after each write (``posix_fadvise(DONTNEED)``). :func:`resident_pages`
    (``mincore``) says how much of a file the cache holds.

    The reads and writes run on a few threads of their own (:class:`IOPool`), created
    with a small stack: every thread's stack is a private writable mapping, counted by
    ``RLIMIT_DATA``, and Python's default is 8 MiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import queue
import shutil
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = [
    "PAGE",
    "AlignedBuffer",
    "IOPool",
    "SwapError",
    "SwapFile",
    "check_free_space",
    "make_swap_dir",
    "resident_pages",
    "round_up",
]

_log = logging.getLogger("zero3.core")
PAGE = mmap.PAGESIZE
_MADE: set[Path] = set()  # swap directories this process made (see make_swap_dir)
_IO_STACK = 256 * 1024  # bytes; the I/O threads only call os.preadv/pwritev
_T = TypeVar("_T")


class SwapError(RuntimeError):
    """A swap file could not be created, written or read back whole (names the file)."""


def round_up(nbytes: int, to: int = PAGE) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return -(-nbytes // to) * to


class AlignedBuffer:
    """A page-aligned host buffer of ``nbytes`` (rounded up to a page).

    Raises:
        MemoryError: The host memory or the process's data limit cannot hold it
            (naming its size and the knobs that shrink it).

    Attributes:
        nbytes: Its size in bytes (a multiple of the page size).
        tensor: A ``uint8`` tensor over the whole buffer (no copy).
    """

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self.nbytes = round_up(max(nbytes, 1))
        self._map: mmap.mmap | None = None
        if pin:
            # Page-locked memory comes from the accelerator's allocator; torch aligns its
            # pinned blocks to pages. Only built when an accelerator is present.
            raw = torch.empty(self.nbytes + PAGE, dtype=torch.uint8, pin_memory=True)
            skip = (-raw.data_ptr()) % PAGE
            self.tensor = raw[skip : skip + self.nbytes]
        else:
            try:
                self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError as exc:  # ENOMEM: host RAM, or the data limit (RLIMIT_DATA)
                raise MemoryError(
                    f"zero3: cannot allocate a {self.nbytes / 2**20:.1f} MiB host buffer for "
                    f"offload I/O ({exc.strerror}): host memory or the process's data "
                    "limit (RLIMIT_DATA) is used up; lower offload_optimizer.buffer_count "
                    "or sub_group_size (smaller records), or offload_param.buffer_count"
                ) from exc
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable byte view of ``[offset, offset + nbytes)`` for ``os.preadv``."""
        if self._map is not None:
            return memoryview(self._map)[offset : offset + nbytes]
        return memoryview(self.tensor.numpy())[offset : offset + nbytes]  # type: ignore[arg-type]


class SwapFile:
    """One swap file: written and read whole (or in page-aligned regions at an offset),
    in ``block_size`` requests.

    Args:
        path: The file (created; an existing one is an error: it is not ours).
        direct: Try ``O_DIRECT`` (falls back to buffered I/O plus cache dropping).
        block_size: Bytes per ``pwritev`` / ``preadv`` call (a multiple of the page).
    """

    def __init__(self, path: Path, *, direct: bool = True, block_size: int = 1 << 20) -> None:
        self.path = path
        self.block_size = block_size
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self._fd = os.open(path, flags | os.O_DIRECT, 0o600)
                    self.direct = True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: the filesystem refuses it
                        raise
            if not self.direct:
                self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise SwapError(f"cannot create swap file {path}: {exc.strerror or exc}") from exc
        self._inode = os.fstat(self._fd).st_ino
        self.written = 0  # end of the last complete write

    def reserve(self, nbytes: int) -> None:
        """Allocate ``nbytes`` on disk now, so a full disk fails here, not mid-step."""
        try:
            os.posix_fallocate(self._fd, 0, round_up(nbytes))
        except OSError as exc:
            raise SwapError(
                f"cannot reserve {round_up(nbytes):,} bytes for swap file {self.path}: "
                f"{exc.strerror or exc}"
            ) from exc

    def write(self, buf: AlignedBuffer, nbytes: int, *, offset: int = 0) -> None:
        """Write the first ``nbytes`` (rounded up to a page) of ``buf`` at ``offset`` (a
        multiple of the page).
        """
        total = round_up(nbytes)
        done = 0
        try:
            while done < total:
                chunk = buf.view(done, min(self.block_size, total - done))
                n = os.pwritev(self._fd, [chunk], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                done += n
            if not self.direct:
                os.posix_fadvise(self._fd, offset, total, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise SwapError(
                f"writing {total:,} bytes to swap file {self.path} at offset {offset:,} "
                f"failed after {done:,}: {exc.strerror or exc}"
            ) from exc
        self.written = offset + total

    def check(self, nbytes: int) -> None:
        """Raise unless the file is still there, the same file, and ``nbytes`` long."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise SwapError(f"swap file {self.path} is gone ({exc.strerror or exc})") from exc
        if st.st_ino != self._inode:
            raise SwapError(f"swap file {self.path} was replaced by another file")
        if st.st_size < round_up(nbytes):
            raise SwapError(
                f"swap file {self.path} is truncated: {st.st_size:,} bytes, "
                f"{round_up(nbytes):,} expected"
            )

    def read(self, buf: AlignedBuffer, nbytes: int, *, offset: int = 0) -> None:
        """Read ``nbytes`` (rounded up to a page) at ``offset`` (a multiple of the page)
        into ``buf``; a short read is an error, never zeros.
        """
        total = round_up(nbytes)
        done = 0
        try:
            while done < total:
                chunk = buf.view(done, min(self.block_size, total - done))
                n = os.preadv(self._fd, [chunk], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short read: end of file at {offset + done:,} bytes")
                done += n
            if not self.direct:
                os.posix_fadvise(self._fd, offset, total, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise SwapError(
                f"reading {total:,} bytes at offset {offset:,} from swap file {self.path} "
                f"failed: {exc.strerror or exc}"
            ) from exc

    def close(self, *, unlink: bool = True) -> None:
        """Close the file and (``unlink``) remove it."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if unlink:
            with contextlib.suppress(OSError):
                self.path.unlink()


class IOPool:
    """A few daemon threads with small stacks running I/O calls in submission order."""

    def __init__(self, threads: int, name: str = "zero3-io") -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        old = threading.stack_size()
        threading.stack_size(_IO_STACK)
        try:
            self._threads = [
                threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                for i in range(threads)
            ]
            for t in self._threads:
                t.start()
        finally:
            threading.stack_size(old)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._execute(*item)
            # A finished job must not outlive its call: its buffer (a write's source, a
            # read's result) would stay in memory until this thread's next job, through
            # the next forward and backward when the job was a step's last.
            del item

    @staticmethod
    def _execute(fn: Callable[[], Any], future: Future[Any]) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits
                future.set_exception(exc)

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn`` on an I/O thread; its result or error comes back in the future."""
        future: Future[_T] = Future()
        self._queue.put((fn, future))
        return future

    def close(self) -> None:
        """Stop the threads once the queued calls are done."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_swap_dir(root: Path, label: str, rank: int) -> tuple[Path, list[Path]]:
    """Create this rank's own directory for this run under ``root``.

    The name holds the host, process id and rank, so ranks and runs sharing ``root``
    never meet, and a later run can tell the directories of dead runs (same host,
    process gone) from live ones. Returns the directory and the stale ones found
    (reported at WARNING, left alone).

    Raises:
        SwapError: ``root`` cannot be created or written (naming it).
    """
    host = socket.gethostname().replace("-", "_") or "host"
    try:
        root.mkdir(parents=True, exist_ok=True)
        # A second model (or optimizer) of this process offloading under the same root
        # takes the next free name; anything else standing there is not ours: an error.
        for n in itertools.count(1):
            path = root / f"zero3-{label}{n if n > 1 else ''}-{host}-{os.getpid()}-rank{rank}"
            if path not in _MADE or not path.is_dir():
                break
        path.mkdir()
        _MADE.add(path)
    except OSError as exc:
        raise SwapError(
            f"cannot create the swap directory under {root} ({exc.strerror or exc}): give "
            "a writable local directory as nvme_path"
        ) from exc
    stale = []
    for other in root.glob(f"zero3-*-{host}-*-rank*"):
        parts = other.name.split("-")
        alive = len(parts) < 4 or not parts[-2].isdigit() or _pid_alive(int(parts[-2]))
        if other != path and not alive:
            stale.append(other)
    if stale:
        _log.warning(
            "zero3: rank %d found swap directories of runs that are no longer alive under %s "
            "(not ours, left alone; remove them to free the space): %s",
            rank, root, ", ".join(str(p) for p in stale),
        )  # fmt: skip
    return path, stale


def check_free_space(path: Path, needed: int, what: str) -> None:
    """Raise unless the filesystem of ``path`` has ``needed`` bytes free."""
    free = shutil.disk_usage(path).free
    if free < needed:
        raise SwapError(
            f"not enough free space for {what} under {path}: {needed:,} bytes needed, "
            f"{free:,} free; free space, lower offload_optimizer.ratio, or choose another "
            "nvme_path"
        )


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), by ``mincore``."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    pages = round_up(size) // PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages
