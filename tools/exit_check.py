"""Count finished torchrun jobs that do not exit 0: zero3's script beside plain torch's.

    .venv/bin/python tools/exit_check.py                     # 50 runs of each, interleaved
    .venv/bin/python tools/exit_check.py --runs 10 --scripts zero3
    .venv/bin/python tools/exit_check.py --scripts zero3,path/to/script.py --json out.json

Each run is ``torchrun --standalone --nproc-per-node N script`` (the torchrun next to
this Python). A run fails when torchrun's exit code is not 0; the table also counts the
runs whose stderr holds ``terminate called`` (the C++ abort of a gloo worker thread
during interpreter finalization) and the runs that had to be killed after ``--timeout``
(a hang). The scripts run in turn, run after run, so the machine's load hits them alike.

Built-in scripts (``tools/_exit/``): ``plain`` is a plain torch.distributed gloo script
(a few waited-for async collectives, no ``destroy_process_group()``); ``zero3`` shards a
small model, trains five steps and ends with no cleanup call. ``plain-inflight`` and
``zero3-inflight`` end with asynchronous all-reduces never waited for (through
torch.distributed, and through zero3.comm); ``plain-cleanup`` is ``plain-inflight``
with the cleanup docs/troubleshooting.rst recommends. Any other name is a path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILTIN = {
    "plain": HERE / "_exit" / "plain_gloo.py",
    "zero3": HERE / "_exit" / "zero3_user.py",
    "plain-inflight": HERE / "_exit" / "plain_inflight.py",
    "zero3-inflight": HERE / "_exit" / "zero3_inflight.py",
    "plain-cleanup": HERE / "_exit" / "plain_cleanup.py",
}
ABORT = "terminate called"


@dataclass
class Tally:
    """What the runs of one script did."""

    script: str
    runs: int = 0
    failed: int = 0
    aborted: int = 0
    hung: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, code: int | None, stderr: str, seconds: float) -> None:
        self.runs += 1
        self.seconds += seconds
        key = "timeout" if code is None else str(code)
        self.codes[key] = self.codes.get(key, 0) + 1
        self.failed += code != 0
        self.aborted += ABORT in stderr
        self.hung += code is None

    def rate(self) -> str:
        return f"{self.failed}/{self.runs}" if self.runs else "-"


def torchrun_cmd() -> list[str]:
    """The torchrun of this Python's environment."""
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def run_once(script: Path, nproc: int, timeout: float) -> tuple[int | None, str, float]:
    """One torchrun job: (exit code or None if killed after ``timeout``, stderr, seconds)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "TORCHELASTIC_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    cmd = [*torchrun_cmd(), "--standalone", "--nproc-per-node", str(nproc), str(script)]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its ranks: their own session
        _, err = proc.communicate()
        code = None
    return code, err, time.monotonic() - start


def format_table(tallies: list[Tally]) -> str:
    lines = [
        "| script | runs | exit != 0 | 'terminate called' | hung | exit codes | s/run |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in tallies:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(t.codes.items()))
        per_run = t.seconds / t.runs if t.runs else 0.0
        lines.append(
            f"| {t.script} | {t.runs} | {t.rate()} | {t.aborted} | {t.hung} | {codes} | "
            f"{per_run:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each script")
    parser.add_argument("--scripts", default="plain,zero3", help="comma-separated names/paths")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a hang")
    parser.add_argument("--json", type=Path, help="also write the tallies here")
    parser.add_argument("--logs", type=Path, help="keep the stderr of every failed run here")
    parser.add_argument("--quiet", action="store_true", help="no line per run")
    args = parser.parse_args(argv)
    names = [s for s in args.scripts.split(",") if s]
    scripts = {name: BUILTIN.get(name, Path(name)) for name in names}
    for name, path in scripts.items():
        if not path.is_file():
            parser.error(f"--scripts: {name!r} is neither {sorted(BUILTIN)} nor a file")
    tallies = {name: Tally(name) for name in names}
    for i in range(args.runs):
        for name, path in scripts.items():
            code, err, seconds = run_once(path, args.nproc, args.timeout)
            tallies[name].add(code, err, seconds)
            if code != 0 and args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"{Path(name).stem}-{i + 1}.stderr").write_text(err)
            if not args.quiet:
                tag = "hung" if code is None else f"exit {code}"
                abort = f", {ABORT!r}" if ABORT in err else ""
                print(f"run {i + 1}/{args.runs} {name}: {tag}{abort} ({seconds:.1f} s)", flush=True)
    print(f"torchrun --standalone --nproc-per-node {args.nproc}, {args.runs} runs per script")
    print(format_table(list(tallies.values())))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(t) for t in tallies.values()], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
