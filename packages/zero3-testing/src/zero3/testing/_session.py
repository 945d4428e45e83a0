"""Run a launcher (torchrun, mpiexec, python) in a session of its own, with a timeout.

A hang then fails the test in seconds: the whole session (the launcher and every rank
it started) is killed, and the test fails naming the command and showing its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

__all__ = ["run_in_session"]


def run_in_session(
    cmd: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
) -> tuple[int, str, str]:
    """Run ``cmd`` to its end; returns (exit status, stdout, stderr).

    Past ``timeout_s`` the command and every process it started are killed and the
    test fails (``pytest.fail``) with the command and its output.
    """
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=dict(env) if env is not None else None,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout_s} s\n{out}\n{err[-4000:]}")
    return proc.returncode, out, err
