"""zero3.comm's exit handlers, run for real: a script ends without closing its backend.

Each script runs in a fresh interpreter and registers a check before it imports
zero3.comm; atexit runs handlers newest first, so the check runs after zero3's and
sees what they left behind.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

_PRELUDE = """\
import atexit, os, sys, threading

def thread_names():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names

CHECKS = []

def _run_checks():
    failed = [name for name, check in CHECKS if not check()]
    print("checks failed: " + ", ".join(failed) if failed else "checks passed", flush=True)
    if failed:
        os._exit(3)

atexit.register(_run_checks)
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "OMPI_", "PMI"))
    }
    script = _PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_groups_zero3_created_are_destroyed_at_exit() -> None:
    result = _run(
        """
        import torch
        import torch.distributed as dist
        from zero3.comm import create_backend, _teardown

        comm = create_backend("gloo", timeout_s=30)  # no launcher: zero3 makes a world of 1
        twin = comm.duplicate()
        store = comm._tmp_store
        assert dist.is_initialized() and len(_teardown.zero3_groups()) == 2
        import time

        deadline = time.monotonic() + 30  # gloo's threads name themselves once they run
        while not any(n.startswith("pt_gloo") for n in thread_names()):
            assert time.monotonic() < deadline, thread_names()
            time.sleep(0.01)
        x = torch.ones(4)
        twin.all_reduce(x)  # never waited for
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])  # imports torch._dynamo
        CHECKS.append(("default group destroyed", lambda: not dist.is_initialized()))
        CHECKS.append(("registry empty", lambda: _teardown.zero3_groups() == []))
        CHECKS.append(
            ("gloo threads ended", lambda: not any(n.startswith("pt_gloo") for n in thread_names()))
        )
        closed = lambda: comm.process_group is None and twin.process_group is None  # noqa: E731
        CHECKS.append(("backends closed", closed))
        CHECKS.append(("file store removed", lambda: not os.path.exists(store)))
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks passed" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_group_the_user_created_is_left_to_the_user() -> None:
    result = _run(
        """
        import tempfile
        import torch
        import torch.distributed as dist

        fd, path = tempfile.mkstemp()
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        from zero3.comm import GlooBackend, _teardown

        comm = GlooBackend(timeout_s=30)
        twin = comm.duplicate()  # zero3's own group on the user's world
        twin.all_reduce(torch.ones(4)).wait()
        CHECKS.append(("the user's group is left", dist.is_initialized))
        CHECKS.append(("zero3's duplicate is destroyed", lambda: _teardown.zero3_groups() == []))
        CHECKS.append(("backends closed", lambda: comm.process_group is None))
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks passed" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_release_groups_keeps_the_default_group_zero3_made() -> None:
    result = _run(
        """
        import torch
        import torch.distributed as dist
        from zero3.comm import CommError, create_backend, release_groups, _teardown

        import time

        def gloo_threads():
            return [n for n in thread_names() if n.startswith(("pt_gloo", "gloo_tcp"))]

        comm = create_backend("gloo", timeout_s=30)  # zero3 makes the default group here
        twin = comm.duplicate()
        twin_group = twin.group
        deadline = time.monotonic() + 30  # threads name themselves once they run
        while len(gloo_threads()) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(gloo_threads()) == 6, gloo_threads()  # 3 per gloo group
        twin.all_reduce(torch.ones(4))  # never waited for
        assert release_groups() == 0
        try:
            dist.get_process_group_ranks(twin_group)
            raise AssertionError("the duplicate's group is still in torch's map")
        except KeyError:
            pass
        del twin_group
        assert len(gloo_threads()) == 3, gloo_threads()  # the default group's alone
        try:
            twin.all_reduce(torch.ones(1))
            raise AssertionError("a released backend issued a collective")
        except CommError as exc:
            assert "release_groups" in str(exc), exc
        x = torch.ones(2)
        comm.all_reduce(x).wait()  # the default group (zero3's) and its backend still work
        assert x.tolist() == [1.0, 1.0] and dist.is_initialized()
        assert _teardown.zero3_groups() == [dist.group.WORLD]
        # At exit the default group goes too, as before.
        CHECKS.append(("default group destroyed", lambda: not dist.is_initialized()))
        CHECKS.append(("gloo threads ended", lambda: not gloo_threads()))
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks passed" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_close_frees_the_group_while_the_program_keeps_its_works() -> None:
    # examples/comm_only.py's shape: works kept in module variables, then close(). A work
    # that held its group kept the destroyed group (and its gloo threads) alive into
    # finalization, where gloo can abort the process.
    result = _run(
        """
        import gc, time, weakref
        import torch
        import torch.distributed as dist
        from zero3.comm import create_backend

        def gloo_threads():
            return [n for n in thread_names() if n.startswith(("pt_gloo", "gloo_tcp"))]

        comm = create_backend("gloo", timeout_s=30)  # no launcher: zero3 makes a world of 1
        group = weakref.ref(comm.process_group)
        deadline = time.monotonic() + 30  # threads name themselves once they run
        while not gloo_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gloo_threads(), thread_names()
        out = torch.empty(4)
        work = comm.all_gather(out, torch.ones(4))
        work.wait()
        barrier = comm.barrier()
        barrier.wait()
        comm.close()
        gc.collect()
        assert group() is None, gc.get_referrers(group())
        assert not gloo_threads(), gloo_threads()
        print("freed at close", flush=True)
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "freed at close" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed")
def test_mpi_progress_thread_is_stopped_at_exit() -> None:
    result = _run(
        """
        import torch
        from mpi4py import MPI
        from zero3.comm import MPIBackend

        comm = MPIBackend(comm=MPI.COMM_SELF, timeout_s=30)
        comm.all_reduce(torch.ones(4))  # starts the progress thread; never waited for
        thread = comm.progress_thread
        CHECKS.append(("thread was running", lambda: thread is not None))
        CHECKS.append(("thread stopped", lambda: thread is None or not thread.is_alive()))
        CHECKS.append(("backend closed", lambda: comm.progress_thread is None))
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks passed" in result.stdout, result.stdout + result.stderr
