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

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def heap():
    # What glibc's main heap holds from the kernel, what of it is in use, and what it
    # mmapped outside the heap (MiB): unlike the resident size, none of these moves when
    # the kernel swaps pages out.
    info = libc.mallinfo2()
    return info.arena / 2**20, info.uordblks / 2**20, info.hblkhd / 2**20

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
    libc.malloc_trim(0)
    return {"grown": grown, "freed": freed, "trimmed": rss() - base}

def interleaved():
    # Free space the heap already has (what the imports left; it varies between hosts)
    # would serve the rising block and the kept blocks and hide the effect: 64 MiB of
    # 64 KiB blocks use it up first, so the rising block is mmapped and every block
    # below comes from the heap's top, in order.
    drained = [torch.empty(16 * 1024) for _ in range(1024)]
    rise(2 * 1024)
    base, (held, used, mapped) = rss(), heap()
    # A forward pass: activations (2 MiB each) stay until the backward frees them, with
    # small tensors made between them that stay longer (gathered parameters, buffers).
    temporaries, kept, mmapped = [], [], 0.0
    for _ in range(64):
        temporaries.append(torch.ones(512 * 1024))  # 2 MiB
        mmapped = max(mmapped, heap()[2] - mapped)
        kept.append(torch.ones(16 * 1024))  # 64 KiB, kept: 4 MiB in all
    del temporaries
    now_held, now_used, _ = heap()
    return {
        "kept": rss() - base,
        "heap": now_held - held,
        "in use": now_used - used,
        "mmapped": mmapped,
    }


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
    # glibc's default: no malloc setting from the environment (MALLOC_*, its tunables) and
    # no preloaded allocator in place of it.
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
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
    freed, so later 2 MiB temporaries come from the heap and the small tensors made
    between them and kept pin their pages once they are freed; a threshold fixed in the
    environment does not rise."""
    default = _results()["interleaved"]
    pinned = _results()["interleaved, pinned"]
    # The mechanism: with glibc's default the 2 MiB temporaries are not mmapped (the
    # threshold rose above them); with the threshold fixed they are (all 64 at once).
    assert default["mmapped"] < 1 and pinned["mmapped"] >= 64, (default, pinned)
    # Its cost, as the heap glibc holds rather than the resident size (a host that swaps
    # would shrink the resident size of the holes nobody touches again).
    assert default["heap"] > 64, (default, pinned)  # measured: +132 MiB held and resident
    assert default["in use"] < 16, (default, pinned)  # the 4 MiB kept
    assert pinned["heap"] < 16, (default, pinned)  # measured: +4 MiB held and resident
