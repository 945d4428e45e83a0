"""A finished run exits 0 without any cleanup call: zero3's exit handler (zero3.comm._teardown).

The torchrun test runs a user script without cleanup (tests/data/exit/zero3_user.py); the
pooled tests call the handler's function directly and check what it destroyed, what
it left, and that it returns when a collective cannot finish.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from zero3.comm import CommError, GlooBackend
from zero3.testing import run_in_session

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parent.parent
USER_SCRIPT = ROOT / "tests" / "data" / "exit" / "zero3_user.py"
CHECKPOINT_SCRIPT = ROOT / "tests" / "data" / "exit" / "zero3_checkpoint.py"

# Runs the user script unchanged, after registering an exit hook that runs after
# zero3's (atexit runs handlers newest first) and fails the rank (exit 3) if a gloo
# worker thread is still alive then: the threads whose GIL request aborts finalization.
_CHECKED_RUN = """\
import atexit, os, runpy, sys

def _gloo_workers():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{{tid}}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if n.startswith("pt_gloo")]

def _check():
    left = _gloo_workers()
    if left:
        print(f"gloo worker threads alive after zero3's exit handler: {{left}}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)

atexit.register(_check)
runpy.run_path({script!r}, run_name="__main__")
"""


def thread_names() -> list[str]:
    """Names of this process's threads (Linux: /proc/self/task)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def gloo_workers() -> list[str]:
    """Names of this process's gloo worker threads (one pair per live gloo group)."""
    return [n for n in thread_names() if n.startswith("pt_gloo")]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.parametrize("user_script", [USER_SCRIPT, CHECKPOINT_SCRIPT], ids=lambda p: p.stem)
def test_user_script_without_cleanup_exits_zero(tmp_path, user_script):
    # One run each (the exit counts of docs/troubleshooting.rst ran zero3_user.py 50 times).
    script = tmp_path / "checked_run.py"
    script.write_text(_CHECKED_RUN.format(script=str(user_script)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARIABLES)}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)]
    # A session of its own, so that a hang is stopped with every rank torchrun started.
    returncode, out, err = run_in_session(cmd, timeout_s=150, env=env)
    assert "terminate called" not in err, err[-4000:]  # gloo's abort at finalization
    assert returncode == 0, out + err[-4000:]
    assert out.count("done:") == 2, out  # both ranks ran the script to its end
    if user_script == CHECKPOINT_SCRIPT:  # the save nobody waited for was published
        assert (tmp_path / "async" / ".metadata").is_file(), sorted(tmp_path.rglob("*"))


_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "TORCHELASTIC_")


# -- the handler, called directly in pooled workers ----------------------------------------
# The pool's default group was created by the harness (the user's): the handler must
# leave it. Its duplicates are zero3's.


def _release_destroys_zero3_groups() -> dict[str, object]:
    import torch.distributed as dist

    from zero3.comm import _teardown

    # Close what earlier cases in this worker left, and free their garbage first, so that
    # no group of theirs goes away while this case counts threads.
    gc.collect()
    _teardown.release_at_exit(wait_s=0.0)
    gc.collect()
    before = gloo_workers()
    comm = GlooBackend(timeout_s=30)  # on the harness's group
    twin = comm.duplicate()  # a group zero3 creates
    created = twin.process_group
    assert created is not None and any(g is created for g in _teardown.zero3_groups())
    # Each gloo group starts two worker threads, which name themselves once they run.
    deadline = time.monotonic() + 30
    while len(gloo_workers()) < len(before) + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(gloo_workers()) == len(before) + 2
    rank = comm.rank

    # A waited-for collective keeps no reference to its tensors.
    buf = torch.ones(1000)
    ref = weakref.ref(buf)
    work = comm.all_reduce(buf)
    work.wait()
    del buf
    deadline = time.monotonic() + 30  # gloo's worker thread lets go of its reference too
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.001)
    kept = ref() is not None

    # Collectives nobody waits for, on both groups: the handler waits for them.
    x = torch.full((1000,), float(rank + 1))
    y = torch.full((1000,), float(rank + 1))
    twin.all_reduce(x)
    comm.all_reduce(y)
    _teardown.release_at_exit(wait_s=30.0)
    try:
        comm.all_reduce(torch.ones(1)).wait()
        refused = ""
    except CommError as exc:
        refused = str(exc)
    destroyed_already = False
    try:
        dist.destroy_process_group(created)
    except ValueError:  # "Invalid process group specified": the handler destroyed it
        destroyed_already = True
    forgotten = not any(g is created for g in _teardown.zero3_groups())
    del created  # the last reference: the group's destructor ends its threads now
    gc.collect()
    after = gloo_workers()
    users = torch.ones(1)
    dist.all_reduce(users)  # the harness's group still works
    return {
        "kept": kept,
        "x": x.tolist() == [3.0] * 1000,
        "y": y.tolist() == [3.0] * 1000,
        "closed": (comm.process_group, twin.process_group) == (None, None),
        "forgotten": forgotten,
        "threads_back": sorted(after) == sorted(before),
        "refused": refused,
        "destroyed": destroyed_already,
        "users_group": float(users),
    }


@pytest.mark.timeout(180)
def test_release_destroys_zero3_groups_and_leaves_the_users(worker_pool):
    results = worker_pool(2).run(_release_destroys_zero3_groups, timeout=150)
    for rank, r in enumerate(results):
        assert not r["kept"], (rank, "a waited-for collective still holds its tensor")
        assert r["x"] and r["y"], (rank, "collectives nobody waited for were not completed")
        assert r["closed"] and r["forgotten"] and r["destroyed"], (rank, r)
        assert r["threads_back"], (rank, "the duplicate's gloo threads are still alive")
        assert "closed" in r["refused"] and "all_reduce" in r["refused"], r["refused"]
        assert r["users_group"] == 2.0


def _stuck_group_is_left() -> dict[str, object]:
    import torch.distributed as dist

    from zero3.comm import _teardown

    _teardown.release_at_exit(wait_s=0.0)
    comm = GlooBackend(timeout_s=60)
    twin = comm.duplicate()
    created = twin.process_group
    x = torch.full((8,), float(comm.rank + 1))
    result: dict[str, object] = {}
    if comm.rank == 0:
        work = twin.all_reduce(x)  # rank 1 issues its side only after the barrier below
        sys.last_value = RuntimeError("an uncaught error")  # what the interpreter sets
        try:
            _teardown.release_at_exit()  # after an uncaught exception: no wait at all
        finally:
            del sys.last_value
        result["left_open"] = twin.process_group is created
        result["still_listed"] = any(g is created for g in _teardown.zero3_groups())
        result["pending_done"] = work.is_completed()
    dist.barrier()
    if comm.rank == 1:
        twin.all_reduce(x).wait()
    _teardown.release_at_exit(wait_s=60.0)  # now it can finish: destroyed and closed
    result["closed"] = twin.process_group is None
    result["forgotten"] = not any(g is created for g in _teardown.zero3_groups())
    result["x"] = x.tolist() == [3.0] * 8
    return result


@pytest.mark.timeout(180)
def test_a_collective_that_cannot_finish_leaves_its_group_and_does_not_wait(worker_pool):
    r0, r1 = worker_pool(2).run(_stuck_group_is_left, timeout=150)
    assert r0["left_open"] and r0["still_listed"] and not r0["pending_done"], r0
    for r in (r0, r1):
        assert r["closed"] and r["forgotten"] and r["x"], r


# -- release_groups: zero3's groups released mid-run, as the pool does after each case -------


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads: per live gloo group, two workers and the
    transport's loop (the thread that wakes up while the group is idle).
    """
    return sorted(n for n in thread_names() if n.startswith(("pt_gloo", "gloo_tcp")))


def _wait_for_threads(count: int) -> list[str]:
    """The gloo threads once there are ``count`` (threads name themselves once they run)."""
    deadline = time.monotonic() + 30
    while len(gloo_threads()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return gloo_threads()


def _release_groups_mid_run() -> dict[str, object]:
    import torch.distributed as dist
    from torch import nn

    from zero3.comm import release_groups
    from zero3.core import Zero3Config
    from zero3.hooks import shard_module

    comm = GlooBackend(timeout_s=30)  # on the harness's default group (the user's)
    user = dist.new_group([0, 1])  # the user's own group (collective over the world)
    on_user = GlooBackend(group=user, timeout_s=30)
    gc.collect()  # garbage of earlier cases must not end threads while this one counts
    before = _wait_for_threads(len(gloo_threads()))
    twin = comm.duplicate()  # groups zero3 creates ...
    channel = twin.host_channel()
    assert channel is not None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    shard_module(model, Zero3Config(param_persistence_threshold=0, timeout_s=30), comm=comm)
    model(torch.randn(2, 4)).sum().backward()  # ... and two more for the model
    made = [twin.group, channel.group]
    grown = len(_wait_for_threads(len(before) + 4 * 3)) - len(before)
    x = torch.full((1000,), float(comm.rank + 1))
    twin.all_reduce(x)  # nobody waits for it: the release does

    left = release_groups(wait_s=30.0)

    unknown = 0
    for group in made:
        try:
            dist.get_process_group_ranks(group)
        except KeyError:  # torch's group map no longer has it
            unknown += 1
    del made, group  # the last references: the groups' destructors end their threads
    after = gloo_threads()
    refusals = []
    for use in (
        lambda: twin.all_reduce(torch.ones(1)).wait(),
        lambda: channel.broadcast(torch.ones(1), 0).wait(),
        twin.duplicate,
        lambda: model(torch.randn(2, 4)),  # its gradient and control channels are gone
    ):
        try:
            use()
            refusals.append("")
        except CommError as exc:
            refusals.append(str(exc))
    y = torch.ones(1)
    comm.all_reduce(y).wait()  # a backend on the default group still works
    z = torch.ones(1)
    on_user.all_reduce(z).wait()  # and one on the user's group
    user_ranks = dist.get_process_group_ranks(user)
    on_user.close()
    dist.destroy_process_group(user)  # the harness never destroys a case's own groups
    return {
        "grown": grown,
        "left": left,
        "x": x.tolist() == [3.0] * 1000,
        "unknown": unknown,
        "threads_back": after == before,
        "before": before,
        "after": after,
        "refusals": refusals,
        "default": float(y),
        "user": (float(z), user_ranks),
    }


@pytest.mark.timeout(180)
def test_release_groups_destroys_zero3_groups_and_ends_their_threads(worker_pool):
    results = worker_pool(2).run(_release_groups_mid_run, timeout=150)
    for rank, r in enumerate(results):
        # Four groups (duplicate, its host channel, the model's two): 3 threads each.
        assert r["grown"] == 12, (rank, r)
        assert r["left"] == 0 and r["unknown"] == 2, (rank, r)
        assert r["x"], (rank, "the collective nobody waited for was not completed first")
        assert r["threads_back"], (rank, "gloo threads of released groups", r)
        for text in r["refusals"]:
            assert "closed" in text and "release_groups" in text, (rank, r["refusals"])
        assert r["default"] == 2.0 and r["user"] == (2.0, [0, 1]), (rank, r)


def _release_out_of_step() -> dict[str, object]:
    import torch.distributed as dist

    from zero3.comm import release_groups

    comm = GlooBackend(timeout_s=30)
    twin = comm.duplicate()
    twin_short = GlooBackend(group=twin.group, timeout_s=3)  # its collectives fail sooner
    result: dict[str, object] = {}
    if comm.rank == 0:
        work = twin_short.all_reduce(torch.ones(8))  # rank 1 never issues it
        # Rank 0 has a collective its peer will never join: the call must come back after
        # the wait, leaving that group (and its backends) as they are.
        result["left"] = release_groups(wait_s=0.5)
        result["open"] = twin_short.process_group is not None
        result["done"] = work.is_completed()
        dist.barrier()  # rank 1 releases only now, so its side stayed up during the wait
        # The collective fails (its peer's side is gone, or at its timeout): a later call
        # sees it finished and releases the group.
        result["left_later"] = release_groups(wait_s=60.0)
        result["open_later"] = twin_short.process_group is not None
    else:
        dist.barrier()
        result["left"] = release_groups(wait_s=0.5)
        result["open"] = twin_short.process_group is not None
    return result


@pytest.mark.timeout(180)
def test_release_groups_returns_when_ranks_are_out_of_step(worker_pool):
    r0, r1 = worker_pool(2).run(_release_out_of_step, timeout=150)
    assert (r0["left"], r0["open"], r0["done"]) == (1, True, False), r0
    assert (r0["left_later"], r0["open_later"]) == (0, False), r0
    assert (r1["left"], r1["open"]) == (0, False), r1


def _rank_named_groups_stay() -> dict[str, object]:
    import torch.distributed as dist

    from zero3.comm import _teardown, release_groups

    comm = GlooBackend(timeout_s=30)
    older = comm.duplicate()
    solo = dist.new_group([0])  # the user's subgroup of rank 0 alone
    result: dict[str, object] = {}
    sub = GlooBackend(group=solo, timeout_s=30) if comm.rank == 0 else None
    # torch names a duplicate of a subgroup after its ranks and the number of live groups.
    named = sub.duplicate() if sub is not None else None
    newer = comm.duplicate()
    kept = [older.group] + ([named.group] if named is not None else [])
    gone = newer.group
    result["left"] = release_groups(wait_s=10.0)
    listed = _teardown.zero3_groups()
    result["kept"] = [any(g is k for g in listed) for k in kept]
    result["gone"] = not any(g is gone for g in listed)
    # Closed all the same, on every rank: what is left is only held for its name.
    result["closed"] = [b.process_group is None for b in (older, newer)] + (
        [named.process_group is None] if named is not None else []
    )
    del kept, gone, listed
    if sub is not None:
        # Had the older duplicate gone, the live-group count would be back at the value it
        # had when `named` was created, and torch would refuse the name it gives this one.
        again = sub.duplicate()
        t = torch.ones(2)
        again.all_reduce(t).wait()
        result["again"] = t.tolist()
        again.close()
        sub.close()
    # Leave this worker as the case found it: what zero3 made, then the user's subgroup.
    _teardown.release_at_exit(wait_s=10.0)  # (the harness created the default group)
    dist.destroy_process_group(solo)
    return result


@pytest.mark.timeout(180)
def test_release_groups_keeps_rank_named_groups_and_older_ones(worker_pool):
    r0, r1 = worker_pool(2).run(_rank_named_groups_stay, timeout=150)
    # Rank 0 keeps the rank-named duplicate and the older one, and releases the newer.
    assert r0["left"] == 2 and r0["kept"] == [True, True] and r0["gone"], r0
    assert r0["closed"] == [True, True, True] and r0["again"] == [1.0, 1.0], r0
    # Rank 1 is no member of the subgroup: it releases both duplicates.
    assert r1["left"] == 0 and r1["kept"] == [False] and r1["gone"], r1
    assert r1["closed"] == [True, True], r1


def _make_a_duplicate() -> int:
    from zero3.comm import _teardown

    twin = GlooBackend(timeout_s=30).duplicate()
    twin.all_reduce(torch.ones(1)).wait()
    return len(_teardown.zero3_groups())


def _count_zero3_groups() -> int:
    from zero3.comm import _teardown

    return len(_teardown.zero3_groups())


def test_the_pool_releases_zero3_groups_after_each_case(worker_pool):
    group = worker_pool(2)
    made = group.run(_make_a_duplicate)
    assert all(n >= 1 for n in made), made
    assert group.run(_count_zero3_groups) == [0, 0]
