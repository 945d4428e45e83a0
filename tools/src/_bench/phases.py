"""Where a zero3 step's time goes: cProfile over the timed steps, folded into phases.

Note:
    cProfile charges each Python function's own interpretation time to it and a torch
    op's time to the builtin method, so two views answer two questions: the
    *cumulative* time of a few leaf-ish engine functions (pack, copy-out, bucket
    write, reduction wait and combine, optimizer step) says what each phase costs with
    its torch ops, and the summed *self* time of every function in the zero3
    packages says what the engine's Python costs (hook dispatch, bookkeeping, and the
    tensor indexing and operators written in it, which cProfile cannot see apart). The
    profiler slows Python calls down, so step times under ``--profile`` read higher
    than without it; compare phases with the step time of the same run.
"""

from __future__ import annotations

import cProfile
import pstats
from typing import Any

#: (file name, function) -> what the phase is. Cumulative times; "wait" phases include
#: time blocked on peers. Every entry must show up in a profiled zero3 step (summarize
#: raises otherwise), so renaming an engine function cannot drop a phase silently.
PHASES: dict[tuple[str, str], str] = {
    ("_gather.py", "__init__"): "gather: pack own shards + issue",
    ("_gather.py", "_copy_out"): "gather: copy out into parameters",
    ("_guard.py", "check"): "gather: header exchange",
    ("_gather.py", "finish"): "gather: wait + copy out",
    ("_buckets.py", "write"): "reduce: gradient into bucket",
    ("_reducer.py", "_finish_oldest"): "reduce: wait + combine",
    ("_reducer.py", "end_backward"): "reduce: epilogue (incl. last waits)",
    ("_optimizer.py", "step"): "optimizer step (incl. AdamW)",
}


def start() -> cProfile.Profile:
    """A running profiler."""
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def summarize(profiler: cProfile.Profile, steps: int) -> dict[str, Any]:
    """Phase times and the engine's own Python time, per step, in milliseconds."""
    profiler.disable()
    stats: Any = pstats.Stats(profiler).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    phases: dict[str, float] = {}
    engine_self = 0.0
    own: list[tuple[float, str]] = []
    for (path, _, func), (_, _, tottime, cumtime, _) in stats.items():
        if "/zero3/" not in path.replace("\\", "/"):
            continue
        engine_self += tottime
        own.append((tottime, f"{path.rsplit('/', 1)[-1]}:{func}"))
        label = PHASES.get((path.rsplit("/", 1)[-1], func))
        if label is not None:
            phases[label] = phases.get(label, 0.0) + cumtime
    missing = sorted(label for label in PHASES.values() if label not in phases)
    if missing:
        # A phase names an engine function; one that never ran was renamed or removed.
        # Fail loudly rather than report a table with a row silently gone.
        raise RuntimeError(
            f"bench --profile: no profile entry for the phases {missing}; update PHASES in "
            "tools/src/_bench/phases.py to the engine's current function names"
        )
    per_step = {label: 1000 * t / steps for label, t in phases.items()}
    top = {name: 1000 * t / steps for t, name in sorted(own, reverse=True)[:5]}
    return {
        "phases_ms": per_step,
        "engine_python_ms": 1000 * engine_self / steps,
        "engine_python_top_ms": top,
    }
