"""Check the torch behaviours zero3's design relies on, and print what this torch does.

    .venv/bin/python tools/torch_facts.py            # CPU, ~15 s of CPU time
    .venv/bin/python tools/torch_facts.py --spawn    # also time starting gloo worlds

Each row is one fact of docs/facts.rst, observed afresh: rerun it when torch moves.
Nothing here asserts; a row whose observation changed is a design reason to revisit.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.autograd.variable import Variable
from torch.utils.checkpoint import checkpoint

Row = tuple[str, str]


def _short(text: str, limit: int = 64) -> str:
    """The first ``limit`` characters of a message, cut at a word."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def data_swap_frees_nothing() -> Row:
    """``param.data = shard`` during forward: the saved weight keeps the full storage."""
    lin = nn.Linear(256, 256)
    full_ptr = lin.weight.data_ptr()
    out = lin(torch.randn(2, 256, requires_grad=True))
    lin.weight.data = torch.zeros(256 * 256 // 2)  # "keep only a shard"
    saved = out.grad_fn._saved_mat2  # the weight, as F.linear saved it for backward
    alive = saved.data_ptr() == full_ptr and saved.untyped_storage().nbytes() == 256 * 256 * 4
    return (
        "param.data swapped to a shard mid-graph",
        f"saved weight still holds the full storage: {alive}",
    )


def _resize_refill(preserve: bool) -> str:
    lin = nn.Linear(8, 8)
    out = lin(torch.randn(2, 8, requires_grad=True))
    values = lin.weight.detach().clone()
    storage = lin.weight.untyped_storage()
    storage.resize_(0)
    storage.resize_(values.numel() * 4)
    with torch.no_grad():
        if preserve:
            with _unsafe_preserve_version_counter(lin.weight):
                lin.weight.copy_(values)
        else:
            lin.weight.copy_(values)
    try:
        out.sum().backward()
    except RuntimeError as exc:
        return "backward raised: " + _short(str(exc), 60)
    return "backward ran"


def storage_resize_and_version() -> list[Row]:
    """Freeing in place and refilling: what autograd's version check says."""
    rows = [
        ("storage resize_(0), refill with copy_", _resize_refill(preserve=False)),
        ("same, copy_ under _unsafe_preserve_version_counter", _resize_refill(preserve=True)),
    ]
    lin = nn.Linear(8, 8)
    out = lin(torch.randn(2, 8, requires_grad=True))
    version = lin.weight._version
    spare = torch.UntypedStorage(0)
    lin.weight.untyped_storage()._swap_data_ptr_(spare)  # type: ignore[attr-defined]
    lin.weight.untyped_storage()._swap_data_ptr_(spare)  # type: ignore[attr-defined]
    out.sum().backward()
    rows.append(
        (
            "storage bytes swapped out and back (_swap_data_ptr_)",
            f"version counter moved: {lin.weight._version != version}; backward ran",
        )
    )
    return rows


def reentrant_checkpoint() -> list[Row]:
    """A callback queued inside a reentrant checkpoint runs when the inner backward ends;
    a parameter used inside and outside the region gets two gradient hook calls.
    """
    events: list[str] = []
    shared = nn.Linear(4, 4)
    calls = []
    shared.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))

    def region(x: torch.Tensor) -> torch.Tensor:
        return MarkBackward.apply(shared(x), events, "inner")  # type: ignore[no-any-return]

    x = torch.randn(2, 4, requires_grad=True)
    before = MarkBackward.apply(x, events, "outer (before the region)")
    inside = checkpoint(region, before, use_reentrant=True)
    y = MarkBackward.apply(shared(inside), events, "outer (after the region)")
    y.sum().backward()
    return [
        ("reentrant checkpoint: backward order", " -> ".join(events)),
        ("reentrant checkpoint: hook calls, param used inside and outside", str(len(calls))),
    ]


class MarkBackward(torch.autograd.Function):
    """Identity; its backward logs ``tag`` and queues a callback that logs ``callback``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, events: list[str], tag: str) -> torch.Tensor:
        ctx.events, ctx.tag = events, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.events.append(ctx.tag)
        if ctx.tag == "inner":
            engine = Variable._execution_engine
            engine.queue_callback(lambda: ctx.events.append("callback queued by inner"))
        return grad, None, None


def non_reentrant_checkpoint() -> Row:
    """Non-reentrant checkpointing re-runs forward pre-hooks during backward, grad on."""
    lin = nn.Linear(4, 4)
    seen: list[bool] = []

    def pre_hook(m: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(torch.is_grad_enabled())

    lin.register_forward_pre_hook(pre_hook)
    x = torch.randn(2, 4, requires_grad=True)
    checkpoint(lin, x, use_reentrant=False).sum().backward()
    return ("non-reentrant checkpoint: pre-hook calls (grad enabled)", str(seen))


def keyword_only_calls() -> list[Row]:
    """A module called with keyword arguments only: what a pre-hook sees."""
    module = KwOnly()
    seen: dict[str, Any] = {}

    def plain(m: nn.Module, args: tuple[Any, ...]) -> None:
        seen["plain"] = args

    def with_kwargs(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["kw"] = sorted(kwargs)

    module.register_forward_pre_hook(plain)
    module.register_forward_pre_hook(with_kwargs, with_kwargs=True)
    module(hidden_states=torch.zeros(1))
    return [
        ("pre-hook without with_kwargs, call m(hidden_states=x)", f"args = {seen['plain']!r}"),
        ("pre-hook with with_kwargs=True, same call", f"kwargs = {seen['kw']!r}"),
    ]


class KwOnly(nn.Module):
    """Called the way transformers calls attention modules: keywords only."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


class GradModeProbe(torch.autograd.Function):
    """Records whether grad mode is on inside ``forward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seen: list[bool]) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


def function_apply_grad_mode() -> Row:
    seen: list[bool] = []
    GradModeProbe.apply(torch.zeros(1, requires_grad=True), seen)
    return ("autograd.Function.apply: grad enabled inside forward", str(seen[0]))


def inference_mode_tensors() -> list[Row]:
    """Tensors born under inference_mode, used by a later training step."""
    with torch.inference_mode():
        born = torch.zeros(4)
    rows = []
    try:
        with torch.no_grad():
            born.add_(1)
        rows.append(("in-place write to an inference-mode tensor, outside", "allowed"))
    except RuntimeError as exc:
        rows.append(("in-place write to an inference-mode tensor, outside", _short(str(exc))))
    lin = nn.Linear(4, 4)
    try:
        (born * lin(torch.randn(2, 4))).sum().backward()
        rows.append(("inference-mode tensor saved for backward", "allowed"))
    except RuntimeError as exc:
        rows.append(("inference-mode tensor saved for backward", _short(str(exc))))
    return rows


def tied_weights() -> Row:
    """Two modules holding one Parameter: post-accumulate-grad hook calls per backward."""
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    calls = []
    emb.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    head(emb(torch.tensor([1, 2]))).sum().backward()
    return ("tied weight used twice in one graph: hook calls", str(len(calls)))


def clip_without_grads() -> Row:
    """``clip_grad_norm_`` over parameters whose ``.grad`` is None (a sharded model's)."""
    params = [nn.Parameter(torch.ones(3)) for _ in range(2)]
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    return ("clip_grad_norm_ when every .grad is None", f"returns {float(norm)}")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rss_growth(block_kib: int) -> str:
    """In this (fresh) process: RSS growth for 256 MiB of ``block_kib`` tensors, after
    ``del``, and after ``malloc_trim(0)``.
    """
    base = _rss_mib()
    blocks = [torch.ones(block_kib * 256) for _ in range(256 * 1024 // block_kib)]
    grown = _rss_mib() - base
    del blocks
    kept = _rss_mib() - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = _rss_mib() - base
    return f"+{grown:.0f} MiB, +{kept:.0f} after del, +{trimmed:.0f} after malloc_trim(0)"


def glibc_keeps_small_blocks() -> list[Row]:
    """Freed 256 KiB tensors stay resident until ``malloc_trim``; freed 64 MiB ones go
    back to the kernel at once. Each in a fresh process: glibc's mmap threshold moves
    with what was freed before, so the order of experiments would change the result.
    """
    rows = []
    for kib in (256, 64 * 1024):
        proc = subprocess.run(
            [sys.executable, __file__, "--rss", str(kib)], capture_output=True, text=True
        )
        got = proc.stdout.strip() or proc.stderr.strip()[-80:]
        rows.append((f"RSS: 256 MiB as {kib} KiB tensors, then freed", got))
    return rows


def _interleaved_growth() -> str:
    """In this (fresh) process: RSS growth after 64 rounds of a 2 MiB temporary beside a
    64 KiB tensor that is kept (4 MiB kept in all)."""
    base = _rss_mib()
    kept = []
    for _ in range(64):
        temporary = torch.ones(512 * 1024)
        kept.append(torch.ones(16 * 1024))
        del temporary
    return f"+{_rss_mib() - base:.0f} MiB resident"


def glibc_threshold_rises() -> list[Row]:
    """glibc raises its mmap threshold to the size of each mmapped block freed (up to 32
    MiB), so later temporaries of that size come from the heap, where a small block kept
    after them pins their pages: a forward pass's activations creep up layer by layer.
    Pinning the threshold (``MALLOC_MMAP_THRESHOLD_``, which also stops its rise) keeps
    them mmapped and returned at ``del``. Each in a fresh process.
    """
    rows = []
    for label, extra in (("glibc default", {}), ("MALLOC_MMAP_THRESHOLD_=131072", {
            "MALLOC_MMAP_THRESHOLD_": "131072"})):  # fmt: skip
        proc = subprocess.run(
            [sys.executable, __file__, "--interleaved"],
            capture_output=True,
            text=True,
            env={**os.environ, **extra},
        )
        got = proc.stdout.strip() or proc.stderr.strip()[-80:]
        rows.append((f"RSS: 64 x (2 MiB temporary, 64 KiB kept), {label}", got))
    return rows


def _one_all_gather() -> bool:
    import torch.distributed as dist

    out = torch.empty(dist.get_world_size())
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # 2.13's name
    gather(out, torch.ones(1))
    return bool(out.sum() == dist.get_world_size())


def spawn_costs() -> Iterator[Row]:
    """Spawn a gloo world with zero3's test harness and run one collective."""
    from zero3.testing import WorkerGroup

    for world in (2, 4):
        start = time.monotonic()
        group = WorkerGroup(world)
        try:
            group.start()
            group.run(_one_all_gather)
        finally:
            group.close()
        yield (
            f"spawn + gloo init + one all-gather, world {world}",
            f"{time.monotonic() - start:.1f} s",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spawn", action="store_true", help="also time starting gloo worlds")
    parser.add_argument("--rss", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss:
        print(_rss_growth(args.rss))
        return
    if args.interleaved:
        print(_interleaved_growth())
        return
    checks: list[Callable[[], Row | list[Row] | Iterator[Row]]] = [
        data_swap_frees_nothing,
        storage_resize_and_version,
        reentrant_checkpoint,
        non_reentrant_checkpoint,
        keyword_only_calls,
        function_apply_grad_mode,
        inference_mode_tensors,
        tied_weights,
        clip_without_grads,
        glibc_keeps_small_blocks,
        glibc_threshold_rises,
    ]
    if args.spawn:
        checks.append(spawn_costs)
    rows: list[Row] = []
    for check in checks:
        got = check()
        rows.extend([got] if isinstance(got, tuple) else list(got))
    width = max(len(fact) for fact, _ in rows)
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}; load average {load:.1f} on {os.cpu_count()} CPUs")
    for fact, observed in rows:
        print(f"{fact:<{width}}  {observed}")


if __name__ == "__main__":
    main()
