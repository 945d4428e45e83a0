"""The generation path on the zdev simulated device at world 2.

Rank ``r`` holds its shards on ``zdev:r`` (``Zero3Config(backend="zdev")``) with the race
detector on. ``unsharded`` gathers the whole model on the device and takes the hooks out;
``iter_full_parameters`` streams full tensors bucket by bucket; transformers' ``generate``
syncs ranks through zero3's comm (here the zdev backend, whose collectives refuse host
tensors as NCCL's do). Each case is compared with a one-process reference on the same
device and asserts that gathers really ran (a model that stayed whole would match it
trivially).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(300)]


def _device() -> torch.device:
    return torch.device("zdev", int(os.environ["LOCAL_RANK"]))


def _sharded_zoo() -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    from zero3.core import Zero3Config
    from zero3.hooks import shard_module
    from zero3.testing.models import build

    model, make = build("gpt_tied")
    model.to(_device())
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(backend="zdev", param_persistence_threshold=0))
    return model, reference, make


def _unsharded_case(max_fraction: float | None) -> dict[str, Any]:
    from zero3.core.engine import sharded_state
    from zero3.hooks import stats, unsharded

    model, reference, make = _sharded_zoo()
    total = sum(sp.numel * 4 for sp in sharded_state(model).params)
    budget = None if max_fraction is None else int(total * max_fraction)
    before = stats(model).gathers
    diffs = []
    with torch.no_grad(), unsharded(model, max_bytes=budget):
        for i in range(3):
            x = make(2, 10 + i).to(_device())
            diffs.append(float((model(x) - reference(x)).abs().max()))
    memory = stats(model).memory
    return {
        "max_diff": max(diffs),
        "gathers": stats(model).gathers - before,
        "gathered_after": memory.gathered_bytes,
        "peak": memory.peak_gathered_bytes,
        "total": total,
        "device": str(next(iter(sharded_state(model).params)).shard.device),
    }


@pytest.mark.parametrize("max_fraction", [None, 0.4], ids=["whole", "budget-0.4"])
def test_unsharded_forward_on_zdev_equals_one_process(zdev_pool, max_fraction):
    results = zdev_pool(2).run(_unsharded_case, max_fraction, timeout=240)
    for rank, r in enumerate(results):
        assert r["device"] == f"zdev:{rank}", r
        assert r["gathers"] > 0 and r["gathered_after"] == 0, r
        assert r["max_diff"] < 1e-5, r
        if max_fraction is not None:
            assert r["peak"] < r["total"], r  # never whole: the rest gathered per use


def _stream_case() -> dict[str, Any]:
    from zero3.hooks import iter_full_parameters

    model, reference, _ = _sharded_zoo()
    want = dict(reference.named_parameters())
    names, devices, diffs = [], set(), []
    for name, full in iter_full_parameters(model, bucket_bytes=4096):
        names.append(name)
        devices.add(str(full.device))
        diffs.append(float((full - want[name]).abs().max()))
    return {"names": names, "want": list(want), "devices": sorted(devices), "max": max(diffs)}


def test_iter_full_parameters_on_zdev_streams_device_tensors(zdev_pool):
    results = zdev_pool(2).run(_stream_case, timeout=240)
    for rank, r in enumerate(results):
        assert r["names"] == r["want"], r
        assert r["devices"] == [f"zdev:{rank}"], r
        assert r["max"] == 0.0, r


def _generate_case() -> dict[str, Any]:
    from zero3.core import Zero3Config
    from zero3.hooks import shard_module, stats, unsharded
    from zero3.testing.hf_models import VOCAB, build_hf

    model = build_hf("gpt2", 0)
    model.config.use_cache = True
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.to(_device())
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(backend="zdev", param_persistence_threshold=0))
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    prompt = torch.randint(1, VOCAB, (1, 4), generator=g).to(_device())
    # Rank 1 asks for more tokens: rank 0 finishes first and must keep serving rank 1's
    # gathers until both are done (generate's sync through zero3's comm).
    kwargs = dict(max_new_tokens=4 + 3 * rank, do_sample=False)
    before = stats(model).gathers
    hooked = model.generate(prompt, **kwargs)
    hook_gathers = stats(model).gathers - before
    with torch.no_grad(), unsharded(model):
        whole = model.generate(prompt, **kwargs)
    want = reference.generate(prompt, **kwargs)
    return {
        "hooked_equal": torch.equal(hooked.cpu(), want.cpu()),
        "whole_equal": torch.equal(whole.cpu(), want.cpu()),
        "device": str(hooked.device),
        "length": hooked.shape[1],
        "hook_gathers": hook_gathers,
        "gathered_after": stats(model).memory.gathered_bytes,
    }


@pytest.mark.transformers
def test_transformers_generate_on_zdev_syncs_and_equals_one_process(zdev_pool):
    results = zdev_pool(2).run(_generate_case, timeout=240)
    for rank, r in enumerate(results):
        assert r["device"] == f"zdev:{rank}", r
        assert r["hooked_equal"] and r["whole_equal"], r
        assert r["hook_gathers"] > 0 and r["gathered_after"] == 0, r
    assert results[0]["length"] < results[1]["length"], results
