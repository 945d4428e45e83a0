"""How the ranks come to be: self-launched, torchrun, or mpiexec."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

CHILD_FLAG = "ZERO3_TRAIN_CHILD"


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bootstrap_torch_env_from_mpi() -> None:
    """Under mpiexec with a torch.distributed backend: agree on a rendezvous over MPI.

    Rank 0 picks a free port and announces its address; every rank learns its rank on
    its own node from a shared-memory split of the world, so multi-node runs work too.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        host = socket.gethostname()
        try:
            address = socket.gethostbyname(host)
        except OSError:
            address = "127.0.0.1"
        announced: tuple[str, int] | None = (address, free_port())
    else:
        announced = None
    address, port = comm.bcast(announced, root=0)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    os.environ.update(
        RANK=str(comm.Get_rank()),
        WORLD_SIZE=str(comm.Get_size()),
        LOCAL_RANK=str(node.Get_rank()),
        LOCAL_WORLD_SIZE=str(node.Get_size()),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )
    node.Free()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    """This process's environment plus torchrun's variables for one local rank."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    return env


def self_launch(world_size: int, argv: list[str]) -> int:
    """Start ``world_size`` local ranks running this script; return the exit code.

    Each rank gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_*``) and
    ``OMP_NUM_THREADS = cores // world_size``. If one rank fails, the others are
    stopped, so a failure never leaves processes hanging.
    """
    threads = max(1, usable_cores() // world_size)
    port = free_port()
    procs: list[subprocess.Popen[Any]] = []
    for rank in range(world_size):
        env = rank_env(rank, world_size, port, threads)
        env[CHILD_FLAG] = "1"
        procs.append(subprocess.Popen([sys.executable, *argv], env=env))
    try:
        return _wait_all(procs)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _wait_all(procs: list[subprocess.Popen[Any]]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            _stop(procs)
            return failed[0] if failed[0] > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen[Any]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
