"""Real models no one here wrote (transformers, built from configs), sharded at world 2."""

from __future__ import annotations

import copy

import pytest
import torch

from zero3.comm import GlooBackend
from zero3.core import Zero3Config
from zero3.hooks import shard_module, stats

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]

MODELS = ["llama", "gpt2", "albert", "mixtral"]


def _logits_parity(name: str, reuse: int) -> dict[str, object]:
    from zero3.testing.hf_models import build_hf, leaf_classes, tokens

    comm = GlooBackend(timeout_s=60)
    model = build_hf(name)
    reference = copy.deepcopy(model)
    config = Zero3Config(
        param_persistence_threshold=0, max_reuse_distance=reuse, leaf_modules=leaf_classes(name)
    )
    shard_module(model, config, comm=comm)
    worst = 0.0
    for step in range(2):
        ids = tokens(2, 10 * comm.rank + step)
        with torch.no_grad():
            out = model(input_ids=ids).logits
            ref = reference(input_ids=ids).logits
        worst = max(worst, (out - ref).abs().max().item())
    return {"diff": worst, "gathers": stats(model).gathers}


@pytest.mark.parametrize("reuse", [0, 1_000_000_000], ids=["release", "default-window"])
@pytest.mark.parametrize("name", MODELS)
def test_sharded_logits_equal_unsharded(worker_pool, name, reuse):
    for result in worker_pool(2).run(_logits_parity, name, reuse, timeout=240):
        assert result["diff"] < 1e-5, result
        assert result["gathers"] > 0
