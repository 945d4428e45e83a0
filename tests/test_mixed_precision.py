"""Mixed precision at world 2 and 4 against one process doing the same arithmetic.

The one-process reference does what the engine does, op for op: a bf16/fp16 copy of the
model runs forward and backward on each rank's slice of the batch; the slices' gradients
are averaged in the reduction dtype (the parameters' own, or ``reduce_dtype``), fp16
gradients are checked for overflow and unscaled in that dtype, the average becomes the
fp32 gradient of an fp32 master copy, the same optimizer steps the masters, and the
masters are rounded back into the model. Every op is elementwise or the same kernel on
the same data, so only the order in which a reduction adds the ranks' gradients can
differ — which fixes the tolerances below.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from zero3.comm import GlooBackend, ReduceOp
from zero3.core import Zero3Config
from zero3.hooks import full_state_dict, shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import build, loss_of

pytestmark = pytest.mark.multirank

LOCAL = 2
STEPS = 4
LR = 1e-2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The fp16 loss scale: small enough that these gradients never overflow by themselves.
SCALE_POWER = 8


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of ``want``'s dtype."""
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(
        torch.finfo(want.dtype).tiny
    )
    return (got.float() - want.float()).abs() / spacing


class _Reference:
    """One process: a low-precision model, fp32 masters, the same optimizer."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, reduce: torch.dtype | None):
        self.model = copy.deepcopy(model).to(dtype)
        # The masters start from the rounded values, as the engine's do (from the shards).
        self.masters = [p.detach().float().clone() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=LR)
        self.reduce = reduce or dtype
        self.fp16 = dtype == torch.float16
        self.scale = 2.0**SCALE_POWER if self.fp16 else 1.0

    def losses_and_grads(
        self, x: torch.Tensor, n: int, autocast: bool = False
    ) -> tuple[list[float], list[torch.Tensor]]:
        """Per-slice losses and the slice-averaged gradient (rank order, reduce dtype)."""
        losses, total = [], None
        for q in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_of(self.model(x[q * LOCAL : (q + 1) * LOCAL]))
            (loss * self.scale if self.fp16 else loss).backward()
            grads = [p.grad.to(self.reduce) for p in self.model.parameters()]
            total = (
                grads if total is None else [t.add_(g) for t, g in zip(total, grads, strict=True)]
            )
            self.model.zero_grad()
            losses.append(float(loss.detach()))
        assert total is not None
        return losses, [t.div_(n) for t in total]

    def step(self, grads: list[torch.Tensor]) -> bool:
        """Unscale, step the masters and round them into the model; False if skipped."""
        if self.fp16 and not all(bool(torch.isfinite(g).all()) for g in grads):
            self.scale /= 2  # hysteresis 1: an overflow halves the scale at once
            return False
        for master, grad in zip(self.masters, grads, strict=True):
            if self.fp16:
                grad = grad.mul_(1.0 / self.scale)  # in the reduction dtype, as the engine
            master.grad = grad.float()
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(self.model.parameters(), self.masters, strict=True):
                p.copy_(master)
        return True


def _compare(model: torch.nn.Module, reference: _Reference) -> dict[str, float]:
    """How far the sharded model is from the reference: the largest difference in ulps
    of the parameter dtype, the largest absolute difference, and the share of elements
    more than one ulp away."""
    full = full_state_dict(model)
    worst, largest, beyond, total = 0.0, 0.0, 0, 0
    for key, want in reference.model.state_dict().items():
        ulps = _ulps(full[key], want)
        worst = max(worst, float(ulps.max()))
        largest = max(largest, float((full[key].float() - want.float()).abs().max()))
        beyond += int((ulps > 1).sum())
        total += want.numel()
    return {"worst_ulps": worst, "max_abs": largest, "beyond_one_ulp": beyond / total}


def _mixed(dtype_name: str, reduce_name: str | None, steps: int = STEPS) -> dict[str, Any]:
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    dtype = DTYPES[dtype_name]
    reduce = DTYPES[reduce_name] if reduce_name else None
    model, make = build("gpt_tied")
    reference = _Reference(model, dtype, reduce)
    config = Zero3Config(
        param_persistence_threshold=0,
        param_dtype=dtype,
        reduce_dtype=reduce,
        initial_scale_power=SCALE_POWER,
        hysteresis=1,
    )
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=LR)
    loss_diffs = []
    for step in range(steps):
        x = make(LOCAL * n, step)
        loss = loss_of(model(x[r * LOCAL : (r + 1) * LOCAL]))
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        ref_losses, grads = reference.losses_and_grads(x, n)
        assert reference.step(grads), "the reference overflowed: lower SCALE_POWER"
        loss_diffs.append(abs(float(loss.detach()) - ref_losses[r]) / abs(ref_losses[r]))
    # Bytes reduced per gradient element tell the reduction dtype (stats count payload).
    numel = sum(p.numel() for p in model.parameters())
    return {
        "loss_rel": max(loss_diffs),
        "reduced_bytes_per_element": stats(model).reduce_payload_bytes / numel,
        "skipped": opt.scaler.skipped_steps,
        **_compare(model, reference),
    }


#: Adam moves a parameter by about ``lr`` per step whatever the gradient's size, so a
#: gradient whose sign depends on rounding can move a parameter by up to ``2 * lr`` per step.
FLIP = 2 * LR * STEPS


def _assert_parity(result: dict[str, Any], world_size: int, low_precision_sums: bool) -> None:
    """The sharded run against the reference; the tolerances follow the reduction order.

    * Two ranks: the reduction adds two gradients, and addition commutes, so the engine's
      reduction equals the reference's to the bit, and so does everything downstream
      (same kernels on the same data): zero tolerance.
    * Four ranks, sums in fp32: gloo's exchange adds rank r's chunk in the order
      r, r-1, r-2, r-3, the reference in rank order. A sum of four bf16 (8 significant
      bits) or fp16 (11 bits) values is exact in fp32 (24 bits) unless they differ in
      size by 2**13 or more, so results agree to the bit except in such rare elements,
      which round at most one ulp of the parameter differently. (fp32 parameters under
      autocast: fp32 sums in another order round once each, far below what the bf16
      forward resolves; the same bounds hold.)
    * Four ranks, sums in bf16/fp16: every addition rounds, in another order, so reduced
      gradients differ by an ulp or two of the reduction dtype. Most updates move by that
      relative amount, below the parameter's own ulp; but where the ranks' gradients
      nearly cancel, the sign of the sum is decided by rounding, and Adam (an update of
      about ``lr * sign`` for such elements) then moves the two copies apart by up to
      ``2 * lr`` per step: at most :data:`FLIP` anywhere, in a few percent of the
      elements at two samples per rank (under 10%), and losses within 5%.
    """
    if world_size == 2:
        assert result["loss_rel"] == 0.0 and result["worst_ulps"] == 0.0, result
    elif not low_precision_sums:
        assert result["beyond_one_ulp"] < 1e-3, result
        assert result["max_abs"] <= FLIP, result
        assert result["loss_rel"] < 1e-3, result
    else:
        assert result["max_abs"] <= FLIP, result
        assert result["beyond_one_ulp"] < 0.10, result
        assert result["loss_rel"] < 5e-2, result


@pytest.mark.parametrize(
    "reduce_name", [None, "fp32"], ids=["reduce-in-param-dtype", "reduce-fp32"]
)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_low_precision_params_with_fp32_masters_match_one_process(
    worker_pool, world_size, dtype_name, reduce_name
):
    results = worker_pool(world_size).run(_mixed, dtype_name, reduce_name, timeout=300)
    element = torch.empty((), dtype=DTYPES[reduce_name or dtype_name]).element_size()
    for result in results:
        assert result["reduced_bytes_per_element"] == element, result
        assert result["skipped"] == 0, result
        _assert_parity(result, world_size, low_precision_sums=reduce_name is None)


# -- fp16 overflow ---------------------------------------------------------------------------------


def _poison_last_element(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Make this rank's gradient of one element infinite: the embedding's last element.

    Reduce-scatter hands each element to exactly one rank, and the last element of a
    parameter belongs to the last rank's shard: after the reduction only that rank holds
    an infinite value, whichever rank produced it.
    """
    weight = model.wte.weight

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[-1] = float("inf")
        return grad

    return weight.register_hook(poison)


def _fp16_overflow(how: str) -> dict[str, Any]:
    """Step 2 overflows on one rank only.

    ``loss``: the last rank's loss is infinite (every element of its gradient, so every
    rank's reduced shard, is poisoned). ``element``: rank 0's gradient is infinite in one
    element that the last rank owns, so only the last rank's shard overflows and only the
    vote over ranks can tell the others to skip.
    """
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    reference = _Reference(model, torch.float16, None)
    config = Zero3Config(
        param_persistence_threshold=0,
        param_dtype=torch.float16,
        initial_scale_power=SCALE_POWER,
        hysteresis=1,
    )
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=LR)
    skipped, unchanged = [], None
    for step in range(STEPS):
        x = make(LOCAL * n, step)
        loss = loss_of(model(x[r * LOCAL : (r + 1) * LOCAL]))
        hook = None
        if step == 2 and how == "loss" and r == n - 1:
            loss = loss * float("inf")
        if step == 2 and how == "element" and r == 0:
            hook = _poison_last_element(model)
        opt.scale_loss(loss).backward()
        if hook is not None:
            hook.remove()
        before = full_state_dict(model) if step == 2 else None
        count = opt.scaler.skipped_steps
        opt.step()
        opt.zero_grad()
        skipped.append(opt.scaler.skipped_steps > count)
        if before is not None:
            after = full_state_dict(model)
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
        _, grads = reference.losses_and_grads(x, n)
        if step == 2:
            reference.scale /= 2  # the engine skipped: so does the reference
        else:
            assert reference.step(grads)
    scales = torch.tensor([opt.loss_scale], dtype=torch.float64)
    low, high = scales.clone(), scales.clone()
    comm.all_reduce(low, op=ReduceOp.MIN).wait()
    comm.all_reduce(high, op=ReduceOp.MAX).wait()
    return {
        "skipped": skipped,
        "unchanged": unchanged,
        "scale": opt.loss_scale,
        "scales_agree": float(low) == float(high),
        **_compare(model, reference),
    }


@pytest.mark.parametrize("how", ["loss", "element"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(worker_pool, world_size, how):
    for result in worker_pool(world_size).run(_fp16_overflow, how, timeout=300):
        assert result["skipped"] == [False, False, True, False], result
        assert result["unchanged"] is True, result  # the skipped step touched nothing
        assert result["scale"] == 2.0 ** (SCALE_POWER - 1), result  # halved once
        assert result["scales_agree"], result
        result["loss_rel"] = 0.0  # the parity test compares losses
        _assert_parity(result, world_size, low_precision_sums=True)


# -- autocast ---------------------------------------------------------------------------------


def _autocast() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    reference = _Reference(model, torch.float32, None)
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=LR)
    loss_diffs, dtypes = [], set()
    for step in range(STEPS):
        x = make(LOCAL * n, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[r * LOCAL : (r + 1) * LOCAL])
            loss = loss_of(out)
        dtypes.add(str(out.dtype))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses, grads = reference.losses_and_grads(x, n, autocast=True)
        assert reference.step(grads)
        loss_diffs.append(abs(float(loss.detach()) - ref_losses[r]) / abs(ref_losses[r]))
    params = {str(p.dtype) for p in model.parameters()}
    return {
        "loss_rel": max(loss_diffs),
        "out": dtypes,
        "params": params,
        **_compare(model, reference),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_autocast_bf16_forward_with_fp32_parameters(worker_pool, world_size):
    for result in worker_pool(world_size).run(_autocast, timeout=300):
        assert result["out"] == {"torch.bfloat16"}, result  # autocast really ran the matmuls
        assert result["params"] == {"torch.float32"}, result
        _assert_parity(result, world_size, low_precision_sums=False)
