"""tools/bench.py end to end on a one-layer workload: it runs, and its table is sound.

No timing is asserted (the machines are shared); the test checks that every system ran,
trained the same model as one process, and that zero3 really sharded and communicated.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    """tools/bench.py on a one-layer workload, one round of one timed step."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))
    }
    cmd = [
        sys.executable, str(ROOT / "tools" / "bench.py"), "--layers", "1", "--rounds", "1",
        "--steps", "1", "--warmup", "1", *args,
    ]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_bench_runs_reports_every_system_and_profiles_zero3():
    # One run (each bench launch costs seconds of interpreter starts): the table, the
    # memory table and the profile of zero3's steps (the profiler changes no figure the
    # test reads: losses, bytes, counts, held state).
    result = _bench("--systems", "ddp,zero3:overlap_comm=false", "--profile")
    timing, memory = result.stdout.split("#### memory per rank")
    timing = timing.split("| phase |")[0]  # the profile's tables follow the systems' table
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in timing.splitlines()
        if line.startswith("| ") and not line.startswith("| system")
    }
    header = next(line for line in timing.splitlines() if line.startswith("| system"))
    column = {name.strip(): i for i, name in enumerate(header.split("|")[2:-1])}
    assert set(rows) == {"ddp", "zero3:overlap_comm=false"}, result.stdout
    for name, cells in rows.items():
        assert float(cells[-1]) < 1e-4, (name, cells)  # same losses as one process
        # CPU seconds per step, with the kernel's part of them in brackets.
        cpu_kernel = re.fullmatch(
            r"([\d.]+) \(([\d.]+)\)", cells[column["CPU s/step per rank (of it kernel)"]]
        )
        assert cpu_kernel is not None, cells
        cpu, kernel = (float(x) for x in cpu_kernel.groups())
        assert 0 <= kernel <= cpu and cpu > 0, cells
        assert re.fullmatch(r"[\d.]+k", cells[column["voluntary context switches/step per rank"]])
    for name in ("zero3:overlap_comm=false",):
        cells = rows[name]
        payload = cells[column["payload bytes/step per rank"]]
        assert "measured" in payload and float(payload.split()[0]) > 0, cells
        assert float(cells[column["elements sharded"]].rstrip("%")) > 99.0, cells
    # The memory table: every system's peak RSS growth; zero3 holds about half the
    # unsharded model state at world 2 (its model is never whole on a rank).
    mem = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in memory.splitlines()
        if line.startswith("| ") and not line.startswith("| system")
    }
    assert set(mem) == set(rows), memory
    assert all(float(cells[2]) > 0 for cells in mem.values()), memory
    held, unsharded = (float(x) for x in mem["zero3:overlap_comm=false"][4].split(" / "))
    assert 0.45 < held / unsharded < 0.55, memory
    assert "theory: ZeRO-3 saves 16·Ψ·(N-1)/N" in memory
    gathers = re.findall(r"^(\S+): (\d+) gathers \+ (\d+) reductions", result.stdout, re.M)
    counts = {name: (int(g), int(r)) for name, g, r in gathers}
    assert all(g > 0 and r > 0 for g, r in counts.values()), counts
    phases = dict(
        re.findall(r"^\| ((?:gather|reduce|optimizer)[^|]*?) \| ([\d.]+) \|", result.stdout, re.M)
    )
    for phase in (
        "gather: copy out into parameters",
        "reduce: gradient into bucket",
        "optimizer step (incl. AdamW)",
    ):
        assert float(phases[phase]) > 0, result.stdout
    assert "largest engine self times" in result.stdout


def test_bench_lora_trains_adapters_on_the_sharded_base_and_reduces_only_them():
    # zero3 only (the reference is the one process running peft): the cheapest launch.
    result = _bench("--lora", "2", "--systems", "zero3-keep-frozen")
    assert "LoRA rank 2 on a frozen base" in result.stdout, result.stdout
    row = next(x for x in result.stdout.splitlines() if x.startswith("| zero3-keep-frozen |"))
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert float(cells[-1]) < 1e-4, cells  # the same losses as one process
    # The measured model state is the LoRA one: 4·Ψ of frozen parameters plus 12·T of
    # adapter gradients and moments (16·Ψ would mean the base had them too), half per rank.
    expected = float(re.search(r"\(4·Ψ \+ 12·T\) = (\d+) MiB unsharded", result.stdout)[1])
    cells = result.stdout.split("| zero3-keep-frozen | ")[2].split("|")
    held, unsharded = (float(x) for x in cells[4].split(" / "))
    assert abs(unsharded - expected) <= 0.05 * expected, result.stdout
    assert 0.45 < held / unsharded < 0.55, result.stdout


def test_bench_offload_row_moves_the_state_and_the_shards_and_says_where_its_time_went(
    tmp_path, monkeypatch
):
    # One launch: both offloads, the swap files under a directory of the test's own.
    monkeypatch.setenv("ZERO3_BENCH_SWAP", str(tmp_path))
    result = _bench("--systems", "zero3-offload-both")
    disk = re.search(
        rf"^swap directory {re.escape(str(tmp_path))}: write (\d+) MiB/s, read (\d+) MiB/s "
        r"\(256 MiB, 1 MiB requests, O_DIRECT\)",
        result.stdout,
        re.M,
    )
    assert disk and int(disk[1]) > 0 and int(disk[2]) > 0, result.stdout
    row = next(x for x in result.stdout.splitlines() if x.startswith("| zero3-offload-both |"))
    assert float(row.split("|")[-2]) < 1e-4, row  # the same losses as one process
    walk = re.search(
        r"^zero3-offload-both: optimizer walk ([\d.]+) s per step, of it waiting on I/O "
        r"([\d.]+) s \(\d+%\); read (\d+) MiB, written (\d+) MiB per step per rank \(swap "
        r"files, O_DIRECT\); parameter shards: (\d+) MiB in the swap file, read (\d+) MiB "
        r"\((\d+) ahead of its gather\)",
        result.stdout,
        re.M,
    )
    assert walk, result.stdout
    assert float(walk[1]) >= float(walk[2]) >= 0, walk[0]
    assert int(walk[3]) > 0 and int(walk[4]) > 0, walk[0]  # the state really moved
    assert int(walk[5]) > 0 and int(walk[6]) >= int(walk[5]) and int(walk[7]) > 0, walk[0]
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # files removed
