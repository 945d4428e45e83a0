"""What glibc's allocator does with torch's freed CPU tensors (docs/facts.rst, "Memory
and processes on CPU"), each experiment in a fresh process: glibc's mmap threshold moves
with what the process freed before, so experiments sharing a process would change each
other's outcome (and each starts by freeing one block of its size, which sets the
threshold the same way every time). Resident sizes, not times, are asserted.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc and /proc/self/statm"
)

#: Prints the resident-set growth (MiB) of each step as JSON.
_EXPERIMENTS = """
import ctypes, json, os, sys
import torch

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def rise(kib):
    # One freed block of the size: glibc's threshold rises to it (if <= 32 MiB), as it
    # has after any earlier work that freed such a block; without this step the outcome
    # depends on what torch's import happened to free.
    block = torch.ones(kib * 256)
    del block

def blocks(kib):
    rise(kib)
    base = rss()
    kept = [torch.ones(kib * 256) for _ in range(256 * 1024 // kib)]  # 256 MiB in all
    grown = rss() - base
    del kept
    freed = rss() - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {"grown": grown, "freed": freed, "trimmed": rss() - base}

def interleaved():
    rise(2 * 1024)
    base = rss()
    kept = []
    for _ in range(64):
        temporary = torch.ones(512 * 1024)  # 2 MiB
        kept.append(torch.ones(16 * 1024))  # 64 KiB, kept: 4 MiB in all
        del temporary
    return {"kept": rss() - base}

if sys.argv[1] == "blocks":
    # 64 MiB blocks first: above glibc's largest dynamic threshold (32 MiB), they are
    # mmapped and their frees move nothing, so the 256 KiB round still starts fresh.
    print(json.dumps({"large": blocks(64 * 1024), "small": blocks(256)}))
else:
    print(json.dumps(interleaved()))
"""


#: The experiments, each run in a fresh process: (argv, threshold pinned).
RUNS = {
    "blocks": (["blocks"], False),
    "interleaved": (["interleaved"], False),
    "interleaved, pinned": (["interleaved"], True),
}


@functools.cache
def _results() -> dict[str, dict[str, Any]]:
    """Every experiment's result; the processes run at once (each is its own process)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    procs = {}
    for name, (argv, pinned) in RUNS.items():
        env = {**base, "MALLOC_MMAP_THRESHOLD_": "131072"} if pinned else base
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", _EXPERIMENTS, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err)
        results[name] = json.loads(out)
    return results


def test_fact_glibc_small_blocks():
    """fact-glibc-small-blocks: freed 256 KiB tensors stay resident until
    ``malloc_trim(0)``; freed 64 MiB ones go back to the kernel at ``del``."""
    got = _results()["blocks"]
    small, large = got["small"], got["large"]
    assert small["grown"] > 200, got
    assert small["freed"] > 0.75 * small["grown"], got  # kept after del
    assert small["trimmed"] < 0.25 * small["grown"], got  # handed back by malloc_trim
    assert large["grown"] > 200 and large["freed"] < 16, got


def test_fact_mmap_threshold():
    """fact-mmap-threshold: glibc raises its mmap threshold with every mmapped block
    freed, so later 2 MiB temporaries come from the heap and the small tensors kept
    beside them pin their pages; a threshold fixed in the environment does not rise."""
    default = _results()["interleaved"]["kept"]
    pinned = _results()["interleaved, pinned"]["kept"]
    assert default > 64, (default, pinned)  # measured: +125 MiB for 4 MiB kept
    assert pinned < 16, (default, pinned)  # measured: +5 MiB
