"""Measure why zero3 plays three tricks on user objects, against their alternatives.

    .venv/bin/python tools/measure_tricks.py     # CPU only, ~30 s of CPU time, prints a table

zero3 changes objects the user owns in three places; each is kept for the reasons this
script measures (the ``Note:`` blocks next to the code quote its figures):

1. A released parameter's class becomes a ``ReleasedParameter`` subclass of its own
   (``ShardedParam.set_status``). Measured: what reading a parameter with no bytes does
   without any guard (in a subprocess: it may kill the process), what the alternative
   guard costs (a global ``TorchFunctionMode`` checking every op's arguments), and what
   the class change costs per gather/release.
2. Every module's ``_parameters`` dict is replaced by a ``ParamAccessDict`` so each
   ``self.weight`` read runs Python. Measured: the added cost per read, the reads per
   step of the benchmark GPT, and when the alternative (noticing outside reads only
   when they touch a *released* parameter) misses a read.
3. The root module's class gets the ``ShardedModule`` mixin so ``model.zero_grad()``
   ends zero3's gradient accumulation window. Measured: the gradient of a discarded
   backward that leaks into the next window without it.

Times are this thread's CPU time (torch on one thread), the minimum over interleaved
repetitions: the least disturbed by other load on the machine. Compare the ratios, not
the absolute times, across machines. Simulated worlds of two use
``zero3.testing.recording.RecordingBackend``: one process, the real schedule of gathers
and releases (values are not those of a real group, which does not matter here).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench.workload import Workload, batch, build

from zero3.core import Zero3Config, local_grad
from zero3.core.engine import ParamStatus, sharded_param, sharded_state
from zero3.hooks import shard_module
from zero3.testing.models import TinyGPT
from zero3.testing.recording import RecordingBackend

Row = tuple[str, str, str]


def best_times(
    variants: dict[str, Callable[[], object]], rounds: int, inner: int
) -> dict[str, float]:
    """CPU seconds per call of each variant: the minimum over ``rounds`` interleaved rounds.

    CPU time of this thread (torch runs on it alone: one intra-op thread), so time the
    thread spends waiting for a core while other processes run does not count.
    """
    best = dict.fromkeys(variants, math.inf)
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.thread_time()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.thread_time() - start) / inner)
    return best


def sharded(model: nn.Module, world: int, **config: Any) -> nn.Module:
    """``model`` sharded in this process over a simulated world (every parameter sharded)."""
    cfg = Zero3Config(param_persistence_threshold=0, **config)
    return shard_module(model, cfg, comm=RecordingBackend(world))


# -- 1. the released-parameter class ------------------------------------------------------

_UNGUARDED = """
import sys, torch
from torch import nn
p = nn.Parameter(torch.randn(256, 256))
p.untyped_storage().resize_(0)  # what releasing does to the parameter's storage
x = torch.randn(4, 256)
op = sys.argv[1]
out = p.sum() if op == "sum" else torch.nn.functional.linear(x, p)
print("returned", float(out.sum()))
"""


def unguarded_read(op: str) -> str:
    """Run ``op`` on a parameter whose storage holds 0 bytes, in a child process."""
    proc = subprocess.run(
        [sys.executable, "-c", _UNGUARDED, op], capture_output=True, text=True, timeout=120
    )
    if proc.returncode < 0:
        return f"process killed by {signal.Signals(-proc.returncode).name}"
    if proc.returncode:
        last = proc.stderr.strip().splitlines()[-1]
        return last if len(last) < 60 else f"{last[:28]}...{last[-34:]}"
    return proc.stdout.strip()


_RELEASED_IDS: set[int] = set()  # empty: the guard's cost when nothing is released


def _any_released(values: Any) -> bool:
    for value in values:
        if isinstance(value, nn.Parameter) and id(value) in _RELEASED_IDS:
            return True
        if isinstance(value, list | tuple) and _any_released(value):
            return True
    return False


class ReleasedGuardMode(TorchFunctionMode):
    """The alternative guard: one global mode that checks every op's tensor arguments."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _any_released(args) or _any_released(kwargs.values()):
            raise RuntimeError("a released parameter was read")
        return func(*args, **kwargs)


class OpCounter(TorchFunctionMode):
    """Counts the ops a mode sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _tiny_gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(), torch.randint(0, 61, (8, 16))


def released_class(rounds: int) -> list[Row]:
    rows: list[Row] = [
        ("released param", "no guard: p.sum() on 0 bytes", unguarded_read("sum")),
        ("released param", "no guard: F.linear(x, p) on 0 bytes", unguarded_read("linear")),
    ]

    def fwd_bwd(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
        return lambda: model(x).sum().backward()

    def under_mode(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with ReleasedGuardMode():
                step()

        return run

    model, x = _tiny_gpt()
    counter = OpCounter()
    with counter:
        model(x).sum().backward()
    plain = fwd_bwd(model, x)
    times = best_times({"plain": plain, "mode": under_mode(plain)}, rounds, 20)
    per_op = (times["mode"] - times["plain"]) / counter.ops
    rows.append(
        (
            "released param",
            f"TorchFunctionMode guard: TinyGPT fwd+bwd ({counter.ops} ops seen)",
            f"{times['mode'] / times['plain']:.3f}x the time without it "
            f"({per_op * 1e6:.1f} us per op)",
        )
    )
    # The class change itself, on a real ShardedParam of a sharded model.
    model, x = _tiny_gpt()
    model = sharded(model, world=2, max_reuse_distance=0)
    state = sharded_state(model)
    step = fwd_bwd(model, x)
    step()
    step()  # the trace is complete from the second step on
    uses = len(state.coordinator.trace.param_order)  # gather/release pairs per step
    sp = state.params[0]

    def swap_pair() -> None:
        sp.set_status(ParamStatus.AVAILABLE)
        sp.set_status(ParamStatus.NOT_AVAILABLE)

    pair = best_times({"pair": swap_pair}, rounds, 2000)["pair"]
    times = best_times({"plain": step, "mode": under_mode(step)}, rounds, 5)
    counter = OpCounter()
    with counter:
        step()
    rows.append(
        (
            "released param",
            f"TorchFunctionMode guard: same, sharded (world 2; {counter.ops} ops seen)",
            f"{times['mode'] / times['plain']:.3f}x the time without it",
        )
    )
    rows.append(
        (
            "released param",
            "class change: one release + gather (dress, undress)",
            f"{pair * 1e6:.2f} us",
        )
    )
    rows.append(
        (
            "released param",
            f"class changes: sharded TinyGPT fwd+bwd ({uses} pairs, world 2, reuse 0)",
            f"{uses * pair * 1e3:.3f} ms = {100 * uses * pair / times['plain']:.2f}% of the step",
        )
    )
    return rows


# -- 2. the parameter-access dict ---------------------------------------------------------


#: ``self.weight`` reads per timed forward of ``Reader``.
READS = 20_000


class Reader(nn.Module):
    """Times ``self.weight`` reads from inside its own forward (a module's usual read)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(READS):
            self.weight  # noqa: B018 - the read is what is timed
        return x


class CountingDict(dict):  # type: ignore[type-arg]
    """A ``_parameters`` dict that counts reads (nothing else)."""

    reads = 0

    def __getitem__(self, key: str) -> Any:
        CountingDict.reads += 1
        return dict.__getitem__(self, key)


def _swap_parameter_dicts(model: nn.Module, cls: type[dict]) -> None:  # type: ignore[type-arg]
    for module in model.modules():
        object.__setattr__(module, "_parameters", cls(module._parameters))


def access_dict(rounds: int) -> list[Row]:
    plain, hooked = Reader(), sharded(Reader(), world=1)
    x = torch.zeros(1)
    times = best_times({"plain": lambda: plain(x), "hooked": lambda: hooked(x)}, rounds, 1)
    per_plain, per_hooked = times["plain"] / READS, times["hooked"] / READS
    extra = per_hooked - per_plain
    w = Workload()  # the benchmark's GPT (tools/bench.py), at its size
    gpt = build(w)
    idx, targets = batch(w, 0, 0, 1)
    _swap_parameter_dicts(gpt, CountingDict)
    gpt(idx, targets).backward()  # also the warm-up
    reads = CountingDict.reads
    _swap_parameter_dicts(gpt, dict)
    step_s = best_times({"step": lambda: gpt(idx, targets).backward()}, 2, 1)["step"]
    return [
        ("ParamAccessDict", "self.weight in forward, plain dict", f"{per_plain * 1e9:.0f} ns"),
        (
            "ParamAccessDict",
            "self.weight in forward, ParamAccessDict",
            f"{per_hooked * 1e9:.0f} ns",
        ),
        (
            "ParamAccessDict",
            f"benchmark GPT ({w.layers} layers): reads per fwd+bwd",
            f"{reads} reads, fwd+bwd {step_s:.2f} s",
        ),
        (
            "ParamAccessDict",
            "added cost per benchmark step",
            f"{reads * extra * 1e6:.0f} us = {100 * reads * extra / step_s:.4f}% of fwd+bwd",
        ),
        *guard_only_detection(),
    ]


def _unseen(module: nn.Module, name: str) -> nn.Parameter:
    """A parameter read that bypasses ParamAccessDict: what a guard-only engine sees."""
    param = dict.__getitem__(module._parameters, name)
    assert isinstance(param, nn.Parameter)
    return param


class Outsider(nn.Module):
    """A parent that, on one step, reads a parameter it does not own.

    ``case`` picks whose: ``"after"`` (``child.weight`` after ``child`` ran, as
    ``zero3.testing.models.ParentUsesChildWeight`` does), ``"ahead"`` (``out.weight``
    before ``out`` runs; ``"ahead-bias"``: ``out.bias``, used elementwise), ``"held"``
    (the child reads its running *parent's* weight). The read bypasses ParamAccessDict;
    ``seen`` records the parameter's status at the read and when the read's backward
    runs.
    """

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.child = nn.Linear(dim, dim)
        self.inner = Inner(dim)
        self.out = nn.Linear(dim, dim)
        self.case: str | None = None
        self.seen: list[str] = []

    def read(self, module: nn.Module, name: str, h: torch.Tensor) -> torch.Tensor:
        param = _unseen(module, name)
        sp = sharded_param(param)
        assert sp is not None
        self.seen.append(sp.status.name)
        if sp.status is not ParamStatus.AVAILABLE:
            return h  # a guard sees this read (today's raises; the alternative would gather)
        y = F.linear(h, param) if param.dim() == 2 else h * param
        y.register_hook(lambda g: self.seen.append(sp.status.name))
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.child(x) * self.scale
        if self.case in ("ahead", "ahead-bias"):
            h = h + self.read(self.out, "weight" if self.case == "ahead" else "bias", h)
        if self.case == "after":
            h = h + self.read(self.child, "weight", h)
        h = self.inner(h, self if self.case == "held" else None)
        return self.out(torch.tanh(h))


class Inner(nn.Module):
    """A child that may read its parent's ``scale`` (``Outsider`` case ``"held"``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, parent: Outsider | None) -> torch.Tensor:
        if parent is not None:
            h = h + parent.read(parent, "scale", h)
        return self.lin(h)


def _detect(case: str, read_step: int) -> str:
    """Run ``Outsider`` sharded over a simulated world of two; it reads on ``read_step``."""
    torch.manual_seed(0)
    model = Outsider()
    sharded(model, world=2)
    x = torch.randn(3, 16)
    outcome = ""
    try:
        for step in range(read_step + 1):
            model.case = case if step == read_step else None
            model(x).sum().backward()
    except RuntimeError as exc:
        outcome = f" -> backward raised RuntimeError: {str(exc)[:22]}..."
    seen = model.seen
    if seen[0] != ParamStatus.AVAILABLE.name:
        return f"read: {seen[0]} -> a guard sees it"
    return f"read: AVAILABLE (missed); its backward: {seen[1] if len(seen) > 1 else '-'}{outcome}"


def _detect_in_child(case: str, read_step: int) -> str:
    proc = subprocess.run(
        [sys.executable, __file__, "--detect", case, str(read_step)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode < 0:
        killed = signal.Signals(-proc.returncode).name
        return f"read: AVAILABLE (missed); its backward: process killed by {killed}"
    if proc.returncode:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return proc.stdout.strip()


def guard_only_detection() -> list[Row]:
    """When a guard on *released* parameters alone would notice an outside read.

    Every read here bypasses ParamAccessDict. A read that finds its parameter
    anything but AVAILABLE is one a guard notices; a read that finds it AVAILABLE is
    missed, and is harmful if the read's backward then finds it released.
    """
    cases = [
        ("read after its owner ran, step 1 (ParentUsesChildWeight)", "after", 0),
        ("read after its owner ran, first on step 3 (reuse window)", "after", 2),
        ("read before its owner runs, first on step 3 (prefetched)", "ahead", 2),
        ("same, used elementwise (h * out.bias), in a subprocess", "ahead-bias", 2),
        ("a child reads its running parent's weight (held)", "held", 0),
    ]
    rows = []
    for what, case, read_step in cases:
        crashes = case == "ahead-bias"
        result = _detect_in_child(case, read_step) if crashes else _detect(case, read_step)
        rows.append(("guard-only detection", what, result))
    return rows


# -- 3. the ShardedModule class -----------------------------------------------------------


def zero_grad_window() -> list[Row]:
    """A backward whose gradients are thrown away (a probe, a skipped step), then
    ``model.zero_grad()`` as the HF Trainer calls it, then the real backward.
    """
    rows: list[Row] = []
    torch.manual_seed(0)
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    results: dict[str, torch.Tensor] = {}
    for variant in ("alone", "mixin", "plain"):
        torch.manual_seed(1)
        model = sharded(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), world=2)
        if variant != "alone":
            model(a).sum().backward()  # the discarded backward
            if variant == "mixin":
                model.zero_grad()  # ShardedModule.zero_grad: ends the window
            else:
                nn.Module.zero_grad(model)  # what the user's class alone would run
        model(b).sum().backward()
        grads = [local_grad(p) for p in model.parameters()]
        results[variant] = torch.cat([g for g in grads if g is not None])
    alone = results["alone"]
    for variant, label in (("mixin", "ShardedModule.zero_grad"), ("plain", "nn.Module.zero_grad")):
        leaked = (results[variant] - alone).norm() / alone.norm()
        rows.append(
            (
                "ShardedModule",
                f"backward A, {label}, backward B",
                f"|grad - grad(B)| / |grad(B)| = {float(leaked):.3f}",
            )
        )
    return rows


def _table(rows: list[Row]) -> Iterator[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    header = ("trick", "measurement", "result")
    yield f"{header[0]:<{widths[0]}}  {header[1]:<{widths[1]}}  {header[2]}"
    yield f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * 10}"
    for trick, what, result in rows:
        yield f"{trick:<{widths[0]}}  {what:<{widths[1]}}  {result}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--detect", nargs=2, metavar=("CASE", "STEP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.detect:  # one guard-only case that may kill its process
        print(_detect(args.detect[0], int(args.detect[1])))
        return
    rows = released_class(args.rounds) + access_dict(args.rounds) + zero_grad_window()
    load = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, one thread; load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    for line in _table(rows):
        print(line)


if __name__ == "__main__":
    main()
