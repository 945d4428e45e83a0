"""Build and cache the zdev test device's C++ library (without loading it here).

The library is built by ``torch.utils.cpp_extension`` from the sources in
``zero3/testing/device/csrc``, in a child process (building through ``cpp_extension``
also loads the library, and loading it makes ``torch.accelerator.is_available()`` true
for the whole process: the process that builds must not be one that stays CPU-only).
The result is cached under a directory named after a hash of the sources, the torch and
Python versions and the flags, so a test session after the first starts in a second.
Several processes asking at once build it once (a file lock).

``python -m zero3.testing._zdev_build`` builds it and prints what it measured (CI runs
it beside the lint job, so the device tests find it built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BuildInfo", "ToolchainMissing", "cache_root", "ensure_built", "source_key"]

SOURCES = Path(__file__).resolve().parent / "device" / "csrc"
LIBRARY_NAME = "zero3_zdev"
#: -O1: the kernels are thin wrappers (the arithmetic runs in torch's CPU kernels), so
#: optimisation buys little at run time and costs compile time.
CFLAGS = ("-O1", "-g0")
#: Set to a directory to cache builds there instead of the user's cache directory.
CACHE_ENV = "ZERO3_ZDEV_CACHE"


class ToolchainMissing(RuntimeError):
    """No C++ compiler or no ninja: the device cannot be built on this machine."""


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """Where the library is and how it got there.

    Attributes:
        library: Path of the shared library.
        key: The cache key (hash of sources, versions and flags).
        built_now: True if this call compiled it; False if it came from the cache.
        build_seconds: Wall-clock seconds of the compile that produced it (as recorded
            when it was built).
        seconds: Wall-clock seconds this call took (build or cache lookup).
    """

    library: Path
    key: str
    built_now: bool
    build_seconds: float
    seconds: float


def source_key() -> str:
    """The hash that names a build: sources, torch and Python versions, flags."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{torch.__version__}|{sys.version}|{' '.join(CFLAGS)}".encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """The cache directory: ``$ZERO3_ZDEV_CACHE``, else ``$XDG_CACHE_HOME/zero3-zdev``,
    else ``~/.cache/zero3-zdev``.
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zero3-zdev"


def missing_toolchain() -> str | None:
    """What is missing to build the device (None if nothing is)."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; install g++ or set CXX)"
    if not is_ninja_available():
        return "no ninja (install the ninja package or the ninja-build system package)"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# The child process: rename first, then build (cpp_extension loads what it builds).
_CHILD = """
import sys, torch
from torch.utils.cpp_extension import load
torch.utils.rename_privateuse1_backend("zdev")
load(name=sys.argv[1], sources=sys.argv[4:], build_directory=sys.argv[2],
     extra_cflags=sys.argv[3].split(), is_python_module=False, verbose=False)
"""


def _compile(directory: Path) -> float:
    reason = missing_toolchain()
    if reason is not None:
        raise ToolchainMissing(f"the zdev test device cannot be built here: {reason}")
    directory.mkdir(parents=True, exist_ok=True)
    # cpp_extension serialises builds with a ``lock`` file it deletes when done; a build
    # that was killed (a test timeout) leaves it behind, and every later build then waits
    # on it forever. Callers hold this key's flock, so no live build owns such a file.
    (directory / "lock").unlink(missing_ok=True)
    sources = sorted(str(p) for p in SOURCES.glob("*.cpp"))
    env = dict(os.environ)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))  # ninja: one compile per core
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, LIBRARY_NAME, str(directory), " ".join(CFLAGS), *sources],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"building the zdev test device failed (exit {done.returncode}) in {directory}:\n"
            + (done.stderr or done.stdout)[-6000:]
        )
    return seconds


def ensure_built() -> BuildInfo:
    """The library, built now if no cached build matches the sources.

    Raises:
        ToolchainMissing: There is no compiler or no ninja to build it with.
        RuntimeError: The compile failed (the message holds the compiler's output).
    """
    start = time.monotonic()
    key = source_key()
    directory = cache_root() / key
    library = directory / f"{LIBRARY_NAME}.so"
    record = directory / "build.json"
    built_now = False
    if not record.exists():
        with _locked(cache_root() / f"{key}.lock"):
            if not record.exists():  # another process may have built it meanwhile
                seconds = _compile(directory)
                record.write_text(json.dumps({"build_seconds": round(seconds, 1)}))
                built_now = True
    build_seconds = float(json.loads(record.read_text())["build_seconds"])
    return BuildInfo(library, key, built_now, build_seconds, time.monotonic() - start)


def main() -> int:
    """Build (or find) the library and print what it cost; exit 3 without a toolchain."""
    try:
        info = ensure_built()
    except ToolchainMissing as exc:
        print(exc, file=sys.stderr)
        return 3
    how = "built" if info.built_now else "cached"
    print(
        f"zdev: {how} {info.library} in {info.seconds:.1f} s "
        f"(the compile took {info.build_seconds:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
