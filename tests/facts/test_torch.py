"""The torch behaviours zero3's design relies on (docs/facts.rst), each asserted.

One test per fact, named by its label on docs/facts.rst: when torch moves and one of
these fails, the fact (and the design reason it carries) needs a second look. They run
in this process on CPU, in milliseconds; only the one that kills its process runs in a
child.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.autograd.variable import Variable
from torch.utils.checkpoint import checkpoint


def test_fact_data_swap() -> None:
    """fact-data-swap: ``param.data = shard`` mid-graph leaves the saved weight whole."""
    lin = nn.Linear(256, 256)
    full_ptr = lin.weight.data_ptr()
    out = lin(torch.randn(2, 256, requires_grad=True))
    lin.weight.data = torch.zeros(256 * 256 // 2)  # "keep only a shard"
    saved = out.grad_fn._saved_mat2  # the weight, as F.linear saved it for backward
    assert saved.data_ptr() == full_ptr
    assert saved.untyped_storage().nbytes() == 256 * 256 * 4


def _refill_then_backward(preserve: bool) -> None:
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
    out.sum().backward()


def test_fact_refill_version() -> None:
    """fact-refill-version: a ``copy_`` refill fails backward's version check unless
    the counter is preserved; swapping the bytes in does not move the counter at all.
    """
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _refill_then_backward(preserve=False)
    _refill_then_backward(preserve=True)
    lin = nn.Linear(8, 8)
    out = lin(torch.randn(2, 8, requires_grad=True))
    version = lin.weight._version
    spare = torch.UntypedStorage(0)
    lin.weight.untyped_storage()._swap_data_ptr_(spare)
    lin.weight.untyped_storage()._swap_data_ptr_(spare)
    assert lin.weight._version == version
    out.sum().backward()


_EMPTY_READ = """
import torch
p = torch.nn.Parameter(torch.randn(256, 256))
p.untyped_storage().resize_(0)  # what releasing does to the parameter's storage
try:
    torch.nn.functional.linear(torch.randn(4, 256), p)
except RuntimeError as exc:
    print("linear raised:", str(exc).splitlines()[0], flush=True)
print("sum returned", float(p.sum()), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals as on Linux")
def test_fact_empty_parameter_read() -> None:
    """fact-empty-parameter-read: torch checks no read of a parameter with no bytes:
    ``F.linear`` raises a message naming neither the parameter nor the cause, and
    ``p.sum()`` kills the process (in a child, for that reason)."""
    proc = subprocess.run(
        [sys.executable, "-c", _EMPTY_READ], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
    assert "linear raised: setStorage" in proc.stdout and "out of bounds" in proc.stdout
    assert "sum returned" not in proc.stdout


def test_fact_inference_tensors() -> None:
    """fact-inference-tensors: a tensor born under ``inference_mode`` can neither be
    written in place outside it nor saved for backward."""
    with torch.inference_mode():
        born = torch.zeros(4)
    with (
        pytest.raises(RuntimeError, match="Inplace update to inference tensor outside"),
        torch.no_grad(),
    ):
        born.add_(1)
    lin = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        (born * lin(torch.randn(2, 4))).sum().backward()


class _Mark(torch.autograd.Function):
    """Identity; its backward logs ``tag``, and for ``"inner"`` queues a logging callback."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, events: list[str], tag: str) -> torch.Tensor:
        ctx.events, ctx.tag = events, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.events.append(ctx.tag)
        if ctx.tag == "inner":
            Variable._execution_engine.queue_callback(lambda: ctx.events.append("callback"))
        return grad, None, None


def test_fact_reentrant_callbacks_and_double_hook() -> None:
    """fact-reentrant-callbacks: a callback queued inside a reentrant region runs when
    the *inner* backward ends; fact-reentrant-double-hook: a parameter used inside and
    outside the region gets two gradient hook calls in one backward."""
    events: list[str] = []
    shared = nn.Linear(4, 4)
    calls: list[int] = []
    shared.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))

    def region(x: torch.Tensor) -> torch.Tensor:
        return _Mark.apply(shared(x), events, "inner")

    x = torch.randn(2, 4, requires_grad=True)
    before = _Mark.apply(x, events, "outer before")
    inside = checkpoint(region, before, use_reentrant=True)
    _Mark.apply(shared(inside), events, "outer after").sum().backward()
    assert events == ["outer after", "inner", "callback", "outer before"]
    assert len(calls) == 2


def test_fact_non_reentrant_prehooks() -> None:
    """fact-non-reentrant-prehooks: non-reentrant checkpointing runs a module's forward
    pre-hook again during backward, with grad enabled both times."""
    lin = nn.Linear(4, 4)
    seen: list[bool] = []
    lin.register_forward_pre_hook(lambda m, args: seen.append(torch.is_grad_enabled()))
    checkpoint(lin, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()
    assert seen == [True, True]


class _GradMode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seen: list[bool]) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


def test_fact_function_no_grad() -> None:
    """fact-function-no-grad: ``autograd.Function.apply`` runs ``forward`` under no_grad."""
    seen: list[bool] = []
    _GradMode.apply(torch.zeros(1, requires_grad=True), seen)
    assert seen == [False]


def test_fact_tied_weights() -> None:
    """fact-tied-weights: one ``nn.Parameter`` in two modules: one hook call per backward."""
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    calls: list[int] = []
    emb.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    head(emb(torch.tensor([1, 2]))).sum().backward()
    assert len(calls) == 1


class _KeywordsOnly(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def test_fact_keyword_calls() -> None:
    """fact-keyword-calls: a module called with keywords only shows a plain pre-hook
    ``args == ()``; only ``with_kwargs=True`` sees the input."""
    module = _KeywordsOnly()
    seen: dict[str, Any] = {}
    module.register_forward_pre_hook(lambda m, args: seen.update(args=args))
    module.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(kwargs=sorted(kwargs)), with_kwargs=True
    )
    module(hidden_states=torch.zeros(1))
    assert seen == {"args": (), "kwargs": ["hidden_states"]}


def test_fact_clip_none_grads() -> None:
    """fact-clip-none-grads: ``clip_grad_norm_`` over parameters whose ``.grad`` is None
    (a sharded model's) returns 0 and clips nothing."""
    params = [nn.Parameter(torch.ones(3)) for _ in range(2)]
    assert float(torch.nn.utils.clip_grad_norm_(params, 1.0)) == 0.0
