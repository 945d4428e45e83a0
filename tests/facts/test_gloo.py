"""What a gloo process group leaves running, and what ends it (docs/facts.rst,
"fact-gloo-teardown"): the threads whose late GIL request can abort a finished rank
during interpreter finalization. One fresh process, a world of one over a file store."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import gc, json, os, sys, tempfile, time
import torch
import torch.distributed as dist

def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(n for n in names if n.startswith("pt_gloo"))

def settled(want_any):
    deadline = time.monotonic() + 30  # threads name themselves once they run
    while bool(gloo_threads()) != want_any and time.monotonic() < deadline:
        time.sleep(0.01)
    return gloo_threads()

def world():
    fd, path = tempfile.mkstemp(dir=sys.argv[1])  # the test's directory: a kept group's file stays
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    dist.all_reduce(torch.ones(4), async_op=True).wait()

seen = {}
world()
seen["alive"] = settled(True)
dist.destroy_process_group()
gc.collect()
seen["destroyed"] = settled(False)
world()
import torch.distributed.nn  # first imported now, after init_process_group
dist.destroy_process_group()
gc.collect()
time.sleep(0.5)
seen["destroyed, torch.distributed.nn imported after"] = gloo_threads()
print(json.dumps(seen))
os._exit(0)  # the group kept alive above must not meet finalization
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_fact_gloo_teardown(tmp_path):
    """fact-gloo-teardown: a live gloo group keeps worker threads; destroying it and
    dropping the last reference ends them, but ``torch.distributed.nn`` imported after
    ``init_process_group`` keeps a reference to the default group for good."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["alive"], seen
    assert seen["destroyed"] == [], seen
    assert seen["destroyed, torch.distributed.nn imported after"], seen
