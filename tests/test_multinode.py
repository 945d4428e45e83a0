"""Two "nodes" on one host: torchrun with --nnodes 2 and mpiexec placed on two hosts.

Each run starts 2 processes per node; every rank trains through zero3 beside a
one-process reference (``zero3.testing.multinode``) and reports its placement. The
checks: the ranks really form two nodes with local ranks 0 and 1 on each; the device an
accelerator backend would pick is the local rank (global ranks 2 and 3 name no device on
a two-device node); and training matches one process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NODES, PER_NODE = 2, 2
TIMEOUT_S = 500  # four fresh processes on a loaded 2-core machine: under a minute usually

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _env() -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "GROUP_", "TORCHELASTIC", "PMI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(procs: list[subprocess.Popen[str]]) -> None:
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failed = [(p.args, p.returncode, out[-4000:]) for p, out in zip(procs, outputs, strict=True)]
    assert all(p.returncode == 0 for p in procs), failed


def _results(out: Path) -> list[dict[str, Any]]:
    files = sorted(out.glob("rank*.json"))
    assert len(files) == NODES * PER_NODE, [f.name for f in files]
    return [json.loads(f.read_text()) for f in files]


def _check(results: list[dict[str, Any]], local_rank_from: str) -> None:
    assert sorted(r["rank"] for r in results) == list(range(NODES * PER_NODE))
    nodes: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        assert r["world"] == NODES * PER_NODE, r
        nodes.setdefault(r["node"], []).append(r)
    assert len(nodes) == NODES, results  # really placed as two nodes
    for members in nodes.values():
        assert sorted(m["local_rank"] for m in members) == list(range(PER_NODE)), members
    for r in results:
        assert r["local_rank_from"] == local_rank_from, r
        # The device a backend picks is the rank on the node, whatever the global rank.
        assert r["device_index"] == r["local_rank"], r
        assert r["max_loss_diff"] < 1e-5, r
        assert r["off"] <= 0.005, r
        assert r["gathers"] > 0, r
    assert any(r["rank"] >= PER_NODE for r in results)  # global ranks past the node's devices


def test_torchrun_two_nodes_on_one_host(tmp_path):
    # A static rendezvous (--node-rank, --master-addr, as a cluster script writes it).
    # The c10d rendezvous of the Slurm recipe differs only inside torchrun: the ranks
    # get the same variables.
    port = _free_port()
    procs = []
    for node in range(NODES):
        where = ["--node-rank", str(node), "--master-addr", "127.0.0.1"]
        where += ["--master-port", str(port)]
        cmd = [
            str(BIN / "torchrun"),
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(PER_NODE),
            *where,
            "-m",
            "zero3.testing.multinode",
            "--out",
            str(tmp_path / "out"),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    _wait(procs)
    _check(_results(tmp_path / "out"), "LOCAL_RANK")


def _mpich() -> bool:
    return shutil.which("mpiexec", path=str(BIN)) is not None and (BIN / "mpichversion").exists()


# MPICH's hydra places processes by host list; with the fork launcher every "host" is
# started on this machine, and hydra still tells each process which node it is on (the
# shared-memory split and MPI_LOCALRANKID follow the host list).
_TWO_HOSTS = ["-launcher", "fork", "-hosts", "localhost,127.0.0.1", "-ppn", str(PER_NODE)]


@pytest.mark.skipif(not _mpich(), reason="needs MPICH's mpiexec (hydra) in the environment")
def test_mpiexec_placed_as_two_nodes(tmp_path):
    # The mpi backend, which takes the rank on the node from hydra. (tools/train.py's
    # bootstrap of a gloo rendezvous from MPI is run under mpiexec by test_train_command.)
    backend = "mpi"
    program = ["-m", "zero3.testing.multinode"]
    cmd = [
        str(BIN / "mpiexec"),
        *_TWO_HOSTS,
        "-n",
        str(NODES * PER_NODE),
        sys.executable,
        *program,
        "--backend",
        backend,
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    _wait([proc])
    _check(_results(tmp_path / "out"), "MPI_LOCALRANKID")
