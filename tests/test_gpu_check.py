"""tools/gpu_check.sh and its Python half, checked as far as a machine without a GPU can.

The script itself needs a CUDA device; here it must parse, print its plan (--dry-run) and
stop at once, saying why. Its Python half runs on ``--device cpu`` (gloo instead of nccl),
so parity, timing, the FSDP2 and zero3 set-ups and the failure report are exercised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"
HELPER = ROOT / "tools" / "gpu_check.py"
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "16",
        "--batch", "2"]  # fmt: skip
RESULT = "GPU_CHECK_RESULT "


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_", "MASTER_"))}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_script_parses():
    assert _run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_prints_every_part_and_checks_the_helper():
    result = _run([str(SCRIPT), "--dry-run"])
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    parts = ("comm nccl", "comm cupy-nccl", "parity fp32", "parity bf16", "parity offload", "bench")
    for part in parts:
        assert f"[dry-run] {part}" in out, out
    assert "-k nccl\\ and\\ not\\ cupy" in out
    assert "the script parses and tools/gpu_check.py imports: OK" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_at_once_saying_why():
    result = _run([str(SCRIPT)], timeout=120)
    assert result.returncode == 2
    assert "no CUDA device: torch.cuda.is_available() is False" in result.stderr
    assert "== comm nccl" not in result.stdout  # nothing else was started
    helper = _run([sys.executable, str(HELPER), "parity"], timeout=120)
    assert helper.returncode == 2 and "pass --device cpu" in helper.stderr


@pytest.mark.parametrize("dtype,offload", [("fp32", "none"), ("bf16", "none"), ("bf16", "cpu")])
def test_parity_logic_on_cpu(dtype, offload):
    result = _run([sys.executable, str(HELPER), "parity", "--device", "cpu", "--dtype", dtype,
                   "--steps", "2", "--offload-optimizer", offload, *TINY])  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[0])
    assert report["dtype"] == dtype and report["device"] == "cpu"
    assert report["offload_optimizer"] == offload and report["masters_on"] == ["cpu"]
    assert report["max_loss_diff"] == 0.0 and report["off"] == 0.0  # world 1: same arithmetic


@pytest.mark.timeout(660)
def test_bench_logic_on_cpu_reports_a_failing_system_and_times_the_others():
    result = _run([sys.executable, str(HELPER), "bench", "--device", "cpu", "--rounds", "1",
                   "--steps", "1", "--warmup", "1", "--systems", "plain,fsdp2,zero3,nope",
                   *TINY], timeout=600)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr  # "nope" failed
    line = next(x for x in result.stdout.splitlines() if x.startswith(RESULT))
    systems = json.loads(line.removeprefix(RESULT))["systems"]
    assert set(systems) == {"plain", "fsdp2", "zero3", "nope"}
    assert "unknown system 'nope'" in systems["nope"]["error"]
    for name in ("fsdp2", "zero3"):
        assert systems[name]["vs_plain"] > 0, systems
        assert systems[name]["loss_diff"] < 1e-5, systems  # same model, same batches
    assert "| nope | FAILED: ValueError: unknown system 'nope'" in result.stdout
