"""Device discipline of the engine, checked on CPU with zero3.testing's instruments.

Every gradient path (contiguous reduce-scatter, all-reduce, discrete, late gradients
from reentrant checkpointing, a world of one), with ``overlap_comm`` on, runs through a
:class:`~zero3.testing.CheckingBackend` that mirrors nccl, inside a
:class:`~zero3.testing.DeviceTracker` and a :class:`~zero3.testing.HostSyncCounter`:

* collectives get device memory only, and no op mixes host and device tensors;
* every collective's inputs were written on a stream its stream has waited for, and
  nothing reads a collective's output before waiting for it;
* host synchronizations per step stay within a fixed budget, the same for a deeper model.

Each check raises its own exception class (``NotDeviceMemory``, ``UnorderedStreams``,
``SyncsGrowWithModel``) whose message lists every violation with the line that caused it.
They caught, before a GPU ever ran the engine: got-gradient flags all-reduced from host
memory, the discrete path's packing after the reduce stream's wait, a host sync per gather
(fingerprint check) and per parameter (clipping norm, fp16 overflow), and blocking
host-to-device copies of fingerprints per gather and per bucket.
"""

from __future__ import annotations

import collections
import contextlib
import re
from typing import Any

import pytest
import torch

from zero3.comm import CommBackend, GlooBackend
from zero3.core import Zero3Config
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing import (
    HOST_MEMORY,
    MIXED_DEVICES,
    STREAM_ORDER,
    CheckingBackend,
    DeviceTracker,
    HostSyncCounter,
)
from zero3.testing.models import TinyGPT, build, loss_of, token_batch
from zero3.testing.recording import RecordingBackend

pytestmark = pytest.mark.multirank

LOCAL = 2
STEPS = 3
#: Small overlap chunks: several buckets and gathers per step, several in flight at once.
CHUNK = 2000


class NotDeviceMemory(AssertionError):
    """A collective got host memory, or an op mixed host and device tensors."""


class UnorderedStreams(AssertionError):
    """A tensor was read on a stream that had not waited for its last write."""


class SyncsGrowWithModel(AssertionError):
    """Host synchronizations per step grow with the model (or exceed the budget)."""


PATHS: dict[str, tuple[str, dict[str, Any]]] = {
    "reduce-scatter": ("gpt_tied", {}),
    "all-reduce": ("gpt_tied", {"grad_reduce_op": "all_reduce"}),
    "discrete": ("gpt_tied", {"contiguous_gradients": False}),
    "late": ("checkpoint_reentrant", {}),
}


def _summary(messages: list[str]) -> str:
    """Violations grouped by their text with numbers blanked, with counts."""
    tally = collections.Counter(re.sub(r"#\d+|\d+", "N", m) for m in messages)
    return "\n".join(f"{n} x {text}" for text, n in tally.most_common())


def _inner(world_of_one: bool) -> CommBackend:
    # A world of one runs in the test process: RecordingBackend is exact at world 1.
    return RecordingBackend(1) if world_of_one else GlooBackend(timeout_s=30)


def _checked_training(name: str, world_of_one: bool = False, **config: Any) -> dict[str, Any]:
    """Train a zoo model through the instruments; return what they found, per rank."""
    model, make = build(name)
    tracker = DeviceTracker("cuda")
    comm = CheckingBackend(_inner(world_of_one), tracker, mirror="nccl", strict=False)
    n, r = comm.world_size, comm.rank
    config = {"param_persistence_threshold": 0, "overlap_chunk_size": CHUNK, **config}
    with tracker:
        shard_module(model, Zero3Config(overlap_comm=True, **config), comm=comm)
        opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
        late = 0
        for step in range(STEPS):
            x = make(LOCAL * n, step)[r * LOCAL : (r + 1) * LOCAL].to(comm.device())
            loss_of(model(x)).backward()
            late += stats(model).late_reductions
            opt.step()
            opt.zero_grad()
    return {
        "host": [v.message for v in tracker.violations if v.kind in (HOST_MEMORY, MIXED_DEVICES)],
        "order": [v.message for v in tracker.violations if v.kind == STREAM_ORDER],
        "reductions": stats(model).reduce_collectives,
        "late": late,
        "gathers": stats(model).gathers,
        "world": n,
    }


_RUNS: dict[str, list[dict[str, Any]]] = {}


def _run_path(worker_pool: Any, path: str) -> list[dict[str, Any]]:
    """Every rank's findings on one path (one run serves both tests of the path)."""
    if path not in _RUNS:
        if path == "world-of-one":
            _RUNS[path] = [_checked_training("gpt_tied", world_of_one=True)]
        else:
            name, config = PATHS[path]
            _RUNS[path] = worker_pool(2).run(_checked_training, name, timeout=300, **config)
    return _RUNS[path]


def _assert_exercised(path: str, result: dict[str, Any]) -> None:
    if path == "world-of-one":
        assert result["world"] == 1 and result["gathers"] == 0, result
        return
    assert result["gathers"] > 0 and result["reductions"] > 1, result
    if path == "late":
        assert result["late"] > 0, result  # the late-gradient reduction really ran


ALL_PATHS = [*PATHS, "world-of-one"]


@pytest.mark.parametrize("path", ALL_PATHS)
def test_collectives_get_device_memory_only(worker_pool, path):
    for result in _run_path(worker_pool, path):
        _assert_exercised(path, result)
        if result["host"]:
            raise NotDeviceMemory(
                f"{path} path, {len(result['host'])} violations:\n" + _summary(result["host"])
            )


@pytest.mark.parametrize("path", ALL_PATHS)
def test_every_collective_is_ordered_after_its_inputs(worker_pool, path):
    for result in _run_path(worker_pool, path):
        _assert_exercised(path, result)
        if result["order"]:
            raise UnorderedStreams(
                f"{path} path, {len(result['order'])} violations:\n" + _summary(result["order"])
            )


# -- host synchronizations per step -----------------------------------------------------------

#: Synchronizations a training step may need at most, whatever the model: the got-gradient
#: flags (they decide the late reduction) and the reduction fingerprints at the end of
#: backward, the fp16 overflow verdict and the clipping norm in the optimizer.
STEP_BUDGET = 4
#: Inside ``optimizer.step()`` alone: the overflow verdict or the norm, and one gather check.
OPTIMIZER_BUDGET = 2
#: Kinds that block the host on a device value (blocking host-to-device copies apart).
VALUE_SYNCS = ("read", "to-host", "shape", "wait")


def _sync_counts(layers: int, scope: str, kinds: tuple[str, ...], **config: Any) -> list[Any]:
    """Host synchronizations in the last step of a TinyGPT of ``layers`` blocks (world 2).

    ``scope`` is ``"step"`` (forward, backward and the optimizer step) or ``"optimizer"``
    (``optimizer.step()`` alone). Returns ``[count, the synchronizations described]``.
    """
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    torch.manual_seed(0)
    model = TinyGPT(layers=layers)
    make = token_batch(61, 16)
    tracker = DeviceTracker("cuda")
    counter = HostSyncCounter(tracker)
    checked = CheckingBackend(comm, tracker, strict=False)
    config = {"param_persistence_threshold": 0, "overlap_chunk_size": CHUNK, **config}
    with tracker, counter:
        shard_module(model, Zero3Config(overlap_comm=True, **config), comm=checked)
        opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        for step in range(STEPS):
            x = make(LOCAL * n, step)[r * LOCAL : (r + 1) * LOCAL].to(checked.device())
            whole = counter.step() if scope == "step" else contextlib.nullcontext()
            with whole:
                opt.scale_loss(loss_of(model(x))).backward()
                with counter.step() if scope == "optimizer" else contextlib.nullcontext():
                    opt.step()
            opt.zero_grad()
        skipped = opt.scaler.skipped_steps
    last = [s for s in counter.steps[-1] if s.kind in kinds]
    return [len(last), HostSyncCounter.describe(last), skipped]


#: Each budget test runs two worker cases (a 1-block and a 3-block model).
_TWO_CASES = pytest.mark.timeout(660)


def _assert_fixed_budget(
    worker_pool: Any, budget: int, scope: str, kinds: tuple[str, ...], **config: Any
) -> None:
    """The last step's synchronizations: within ``budget`` and equal for 1 and 3 blocks."""
    small = worker_pool(2).run(_sync_counts, 1, scope, kinds, timeout=300, **config)
    large = worker_pool(2).run(_sync_counts, 3, scope, kinds, timeout=300, **config)
    for (n_small, small_text, skipped), (n_large, large_text, _) in zip(small, large, strict=True):
        assert skipped == 0  # an fp16 overflow would cut the per-parameter loops short
        if n_small != n_large or n_large > budget:
            raise SyncsGrowWithModel(
                f"host synchronizations per {scope}: {n_small} with 1 block, {n_large} with "
                f"3 blocks (budget {budget}, the same for any model).\n"
                f"1 block:\n{small_text}\n3 blocks:\n{large_text}"
            )


@_TWO_CASES
def test_host_syncs_per_training_step_are_a_fixed_few(worker_pool):
    _assert_fixed_budget(worker_pool, STEP_BUDGET, "step", VALUE_SYNCS)


@_TWO_CASES
def test_gradient_clipping_syncs_once_not_per_parameter(worker_pool):
    _assert_fixed_budget(
        worker_pool, OPTIMIZER_BUDGET, "optimizer", VALUE_SYNCS, gradient_clipping=1.0
    )


@_TWO_CASES
def test_fp16_overflow_check_syncs_once_not_per_parameter(worker_pool):
    _assert_fixed_budget(
        worker_pool,
        OPTIMIZER_BUDGET,
        "optimizer",
        VALUE_SYNCS,
        param_dtype=torch.float16,
        initial_scale_power=8,
    )


@_TWO_CASES
def test_no_blocking_host_to_device_copy_per_gather_or_bucket(worker_pool):
    _assert_fixed_budget(worker_pool, STEP_BUDGET, "step", ("to-device",))
