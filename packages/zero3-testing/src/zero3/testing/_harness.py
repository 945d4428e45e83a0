"""Pooled multi-process worker groups for multi-rank tests.

Note:
    Ranks are spawned once and run case after case (a fresh gloo world costs seconds:
    :ref:`fact-spawn-cost`); cases travel by cloudpickle, functions of test modules by
    value; after each passing case every rank releases the groups zero3 created, in a
    second round, so idle workers do not spend CPU on them. Why, and the ordering the
    second round gives: docs/testing.rst, :ref:`testing-pool`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

__all__ = ["CaseError", "GroupPool", "RankExited", "WorkerGroup"]

#: Grace period for the other ranks once one rank has failed (they are often blocked in
#: a collective the failed rank will never join).
_FAIL_GRACE_S = 5.0

#: The message that asks a worker to release zero3's groups (cases are sent as bytes).
_RELEASE = "release"
#: How long a rank waits for collectives a passing case issued and nobody waited for,
#: before it leaves their group for a later release (a peer that never issued one keeps
#: it running until the group's timeout; that must not cost every case this long).
_RELEASE_WAIT_S = 2.0
#: How long the ranks get to release. The wait above is bounded; destroying a group can
#: still block until its timeout when a collective zero3 cannot see (one issued through
#: torch.distributed directly) is running, and a release that outlasts this is reported.
_RELEASE_TIMEOUT_S = 90.0


class CaseError(AssertionError):
    """A case failed, hung or lost a rank; the message holds each failing rank's report."""


@dataclasses.dataclass(frozen=True)
class RankExited:
    """Result placeholder for a rank whose process ended during the case."""

    rank: int
    exitcode: int | None


def _register_by_value(fn: Callable[..., Any]) -> None:
    """Ship test-module code by value: workers cannot import ``tests.*`` modules."""
    for obj in (fn, *getattr(fn, "__wrapped_cases__", ())):
        module = sys.modules.get(getattr(obj, "__module__", "") or "")
        if module is None or module.__name__ == "__main__":
            continue
        path = Path(getattr(module, "__file__", "") or "")
        in_tests = "tests" in path.parts or path.name.startswith(("test_", "conftest"))
        if in_tests and "site-packages" not in path.parts:
            cloudpickle.register_pickle_by_value(module)


def _reset_process_state(environ: dict[str, str]) -> None:
    import torch

    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    if torch.are_deterministic_algorithms_enabled():
        # Only when a case turned it on: the call imports torch._dynamo (seconds).
        torch.use_deterministic_algorithms(False)
    os.environ.clear()
    os.environ.update(environ)
    warnings.resetwarnings()


def _release_zero3_groups() -> int:
    """Release what zero3 created during the case; the number of groups left.

    Not imported unless a case did: a case that never imported zero3.comm created none.
    """
    if "zero3.comm" not in sys.modules:
        return 0
    from zero3.comm import release_groups

    return release_groups(wait_s=_RELEASE_WAIT_S)


def _worker_main(
    rank: int,
    world_size: int,
    store_path: str,
    stack_path: str,
    conn: multiprocessing.connection.Connection,
    pg_timeout_s: float,
    setup: str | None = None,
) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    with open(stack_path, "w") as stack_file:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # The group's own module (e.g. one that loads a test device) and its check after
        # each passing case.
        after_case = getattr(importlib.import_module(setup), "after_case", None) if setup else None
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        environ = dict(os.environ)
        conn.send(("ready", None))
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message is None:
                break
            if message == _RELEASE:
                try:
                    conn.send(("ok", cloudpickle.dumps(_release_zero3_groups())))
                except BaseException:
                    conn.send(("err", traceback.format_exc()))
                continue
            try:
                fn, args, kwargs = cloudpickle.loads(message)
                result = fn(*args, **kwargs)
                del fn, args, kwargs
                if after_case is not None:
                    after_case()
                reply = ("ok", cloudpickle.dumps(result))
            except BaseException:  # report everything, KeyboardInterrupt included
                reply = ("err", traceback.format_exc())
            _reset_process_state(environ)
            if not dist.is_initialized():
                reply = ("err", "the case destroyed the default process group")
            conn.send(reply)
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerGroup:
    """``world_size`` live worker processes joined in one gloo process group.

    Args:
        world_size: Number of ranks.
        pg_timeout_s: Timeout of the workers' default process group: a collective that a
            peer never joins fails after this long instead of torch's 30 minutes.
        setup: A module every worker imports first (``"zero3.testing.device.worker"``
            loads the zdev test device); its ``after_case()``, if it has one, runs after
            each case that passed, and a raise there fails the case.
    """

    def __init__(
        self, world_size: int, *, pg_timeout_s: float = 30.0, setup: str | None = None
    ) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.setup = setup
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._tmpdir: str | None = None

    @property
    def alive(self) -> bool:
        """True while every worker process is running."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self, timeout: float = 120.0) -> None:
        """Spawn the ranks and wait until each has joined the process group."""
        ctx = multiprocessing.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix=f"zero3-w{self.world_size}-")
        store = os.path.join(self._tmpdir, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            stack = os.path.join(self._tmpdir, f"stack-{rank}.txt")
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store, stack, child, self.pg_timeout_s, self.setup),
                daemon=True,
                name=f"zero3-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise CaseError(f"rank {rank} of a world of {self.world_size} did not start")
            conn.recv()

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 120.0,
        allow_rank_exit: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the per-rank results.

        Args:
            fn: The case; it may be defined in a test module (shipped by value).
            *args: Positional arguments for ``fn`` (picklable).
            timeout: Hard limit for the whole case; past it the ranks' stacks are dumped
                into the error and the group is torn down (the next run rebuilds it).
            allow_rank_exit: The case ends some rank's process on purpose: that rank's
                result is a :class:`RankExited` instead of an error, and the group is
                rebuilt for the next case.
            **kwargs: Keyword arguments for ``fn`` (picklable).

        Raises:
            CaseError: A rank raised, a rank died unexpectedly, or the case timed out.
        """
        if not self.alive:
            self.close()
            self.start()
        _register_by_value(fn)
        payload = cloudpickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send(payload)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        exited: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) + len(exited) < self.world_size:
            now = time.monotonic()
            if (errors or (exited and not allow_rank_exit)) and deadline > now + _FAIL_GRACE_S:
                deadline = now + _FAIL_GRACE_S
            if now >= deadline:
                return self._fail_pending(results, errors, exited, timeout, allow_rank_exit)
            self._collect(results, errors, exited, min(0.2, deadline - now))
        if exited or errors:
            # A failed case may leave collectives pending: start the next one fresh.
            self.close()
        if errors or (exited and not allow_rank_exit):
            raise CaseError(self._report(errors, exited, {}))
        if not exited:  # otherwise the group was closed above: nothing is left to release
            self._release()
        return [
            results[r] if r in results else RankExited(r, exited[r]) for r in range(self.world_size)
        ]

    def _release(self) -> None:
        """Every rank releases the groups zero3 created (see the module note).

        Raises:
            CaseError: A rank failed to release, or took longer than the bound (its
                stack is in the message); the group is torn down either way.
        """
        for conn in self._conns:
            conn.send(_RELEASE)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        exited: dict[int, int | None] = {}
        deadline = time.monotonic() + _RELEASE_TIMEOUT_S
        while len(results) + len(errors) + len(exited) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                stuck = [
                    r
                    for r in range(self.world_size)
                    if r not in results and r not in errors and r not in exited
                ]
                stacks = self._dump_stacks(stuck)
                self.close()
                raise CaseError(
                    f"releasing zero3's process groups after the case took over "
                    f"{_RELEASE_TIMEOUT_S:.0f} s on ranks {stuck}\n"
                    + self._report(errors, exited, stacks)
                )
            self._collect(results, errors, exited, min(0.2, deadline - now))
        if errors or exited:
            self.close()
            raise CaseError(
                "releasing zero3's process groups after the case failed\n"
                + self._report(errors, exited, {})
            )

    def _collect(
        self,
        results: dict[int, Any],
        errors: dict[int, str],
        exited: dict[int, int | None],
        wait: float,
    ) -> None:
        pending = {
            conn: rank
            for rank, conn in enumerate(self._conns)
            if rank not in results and rank not in errors and rank not in exited
        }
        ready = multiprocessing.connection.wait(list(pending), timeout=wait)
        for conn in ready:
            rank = pending[conn]  # type: ignore[index]
            try:
                status, value = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                self._procs[rank].join(timeout=5)
                exited[rank] = self._procs[rank].exitcode
                continue
            if status == "ok":
                results[rank] = cloudpickle.loads(value)
            else:
                errors[rank] = value

    def _fail_pending(
        self,
        results: dict[int, Any],
        errors: dict[int, str],
        exited: dict[int, int | None],
        timeout: float,
        allow_rank_exit: bool,
    ) -> list[Any]:
        stuck = [
            r
            for r in range(self.world_size)
            if r not in results and r not in errors and r not in exited
        ]
        stacks = self._dump_stacks(stuck)
        self.close()
        if not errors and not exited:
            header = f"case timed out after {timeout:.0f} s; ranks still running: {stuck}"
        else:
            header = f"ranks {stuck} did not finish after the failure below"
        raise CaseError(header + "\n" + self._report(errors, exited, stacks))

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = {}
        for rank in ranks:
            assert self._tmpdir is not None
            path = os.path.join(self._tmpdir, f"stack-{rank}.txt")
            with contextlib.suppress(OSError):
                stacks[rank] = Path(path).read_text()[-6000:]
        return stacks

    def _report(
        self, errors: dict[int, str], exited: dict[int, int | None], stacks: dict[int, str]
    ) -> str:
        parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())]
        parts += [f"--- rank {r} exited (code {code}) ---" for r, code in sorted(exited.items())]
        parts += [f"--- rank {r} stack (hung) ---\n{s}" for r, s in sorted(stacks.items())]
        return "\n".join(parts)

    def close(self) -> None:
        """Stop the workers (politely, then by force) and remove the temp dir."""
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


class GroupPool:
    """One live :class:`WorkerGroup` per world size, created on first use.

    Args:
        pg_timeout_s: As for :class:`WorkerGroup`.
        setup: As for :class:`WorkerGroup` (every group of the pool imports it).
    """

    def __init__(self, *, pg_timeout_s: float = 30.0, setup: str | None = None) -> None:
        self.pg_timeout_s = pg_timeout_s
        self.setup = setup
        self._groups: dict[int, WorkerGroup] = {}

    def __call__(self, world_size: int) -> WorkerGroup:
        """Return the (started) group for ``world_size``."""
        group = self._groups.get(world_size)
        if group is None:
            group = WorkerGroup(world_size, pg_timeout_s=self.pg_timeout_s, setup=self.setup)
            self._groups[world_size] = group
        if not group.alive:
            group.close()
            group.start()
        return group

    def close(self) -> None:
        """Stop every group."""
        for group in self._groups.values():
            group.close()
        self._groups.clear()
