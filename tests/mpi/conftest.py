"""Fixtures for tests that run on every rank of ``mpiexec -n N python -m pytest tests/mpi``.

Every rank runs the same tests in the same order. The gloo reference backend lives in
the same processes: rank 0 picks a file-store path and broadcasts it over MPI.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from zero3.comm import GlooBackend, MPIBackend

_FAILED = pytest.StashKey[bool]()

#: Collective timeout in these tests: a rank that fails early makes its peers raise
#: CommTimeoutError well before pytest-timeout's 60 s per test.
TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def mpi() -> Any:
    from mpi4py import MPI

    return MPI


@pytest.fixture(scope="session")
def gloo(mpi: Any) -> Iterator[GlooBackend]:
    comm = mpi.COMM_WORLD
    tmpdir = tempfile.mkdtemp(prefix="zero3-mpi-tests-") if comm.Get_rank() == 0 else None
    tmpdir = comm.bcast(tmpdir, root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmpdir, 'store')}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    backend = GlooBackend(timeout_s=TIMEOUT_S)
    yield backend
    backend.close()
    dist.destroy_process_group()
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture(scope="session")
def mpib(mpi: Any) -> Iterator[MPIBackend]:
    backend = MPIBackend(timeout_s=TIMEOUT_S)
    yield backend
    backend.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def _stop_all_ranks_on_failure(request: pytest.FixtureRequest, mpi: Any) -> Iterator[None]:
    """After each test, the ranks agree whether any of them failed; if so all stop.

    A rank that failed before issuing a collective leaves its peers with requests that
    would match the wrong collectives of later tests. Stopping the whole session on
    every rank at once bounds that damage to one test (and one backend timeout).
    """
    yield
    failed = request.node.stash.get(_FAILED, False)
    flags = bytearray([failed])
    result = bytearray(1)
    request_ = mpi.COMM_WORLD.Iallreduce(flags, result, op=mpi.MAX)
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while not request_.Test():
        if time.monotonic() > deadline:
            pytest.exit("a rank stopped answering between tests", returncode=1)
        time.sleep(1e-3)
    if result[0]:
        rank = mpi.COMM_WORLD.Get_rank()
        pytest.exit(
            f"rank {rank}: a rank failed {request.node.nodeid}; stopping every rank so "
            "that none waits on a collective another skipped",
            returncode=1,
        )
