"""``model.to(dtype)`` on a sharded model whose shards ``offload_param: cpu`` keeps in
host memory while the model is on an accelerator (the zdev simulated device).

The host shards are page-locked (``pin_memory``) because a copy onto the device is
asynchronous for the host only from page-locked memory. A cast makes new shard tensors:
they must be page-locked again, or every later read-ahead would be a copy the host waits
for. The cast model must still train like an in-device twin cast the same way.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

from zero3.core import Zero3Config
from zero3.core.engine import sharded_state
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import build, loss_of

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(300)]

LOCAL = 2
STEPS = 2


def _cast_pair() -> dict[str, Any]:
    import torch.distributed as dist

    from zero3.testing.device import detector

    dev = torch.device("zdev", int(os.environ["LOCAL_RANK"]))
    n, r = dist.get_world_size(), dist.get_rank()
    model, make = build("gpt_tied")
    model.to(dev)
    twin = copy.deepcopy(model)
    base = dict(backend="zdev", param_persistence_threshold=0, overlap_comm=True)
    shard_module(model, Zero3Config(**base))
    offload = {"device": "cpu", "pin_memory": True}
    shard_module(twin, Zero3Config(**base, offload_param=offload))
    host = sharded_state(twin).host_shards
    assert host is not None
    pinned_before = all(sp.held_shard.is_pinned() for sp in sharded_state(twin).params)
    for m in (model, twin):
        m.to(torch.bfloat16)
    held = [sp.held_shard for sp in sharded_state(twin).params]
    opts = [
        PartitionedOptimizer(m, torch.optim.AdamW, lr=1e-2, foreach=False) for m in (model, twin)
    ]
    diffs = []
    for step in range(STEPS):
        for m, opt in zip((model, twin), opts, strict=True):
            x = make(LOCAL * n, step).to(dev)
            loss_of(m(x[r * LOCAL : (r + 1) * LOCAL])).backward()
            opt.step()
            opt.zero_grad()
        pairs = zip(sharded_state(model).params, sharded_state(twin).params, strict=True)
        diffs.append(sum(int((a.shard.cpu() != b.shard.cpu()).sum()) for a, b in pairs))
    detector.check()
    return {
        "pinned_before": pinned_before,
        "devices": sorted({str(t.device) for t in held}),
        "dtypes": sorted({str(t.dtype) for t in held}),
        "pinned_after": [t.is_pinned() for t in held],
        "diffs": diffs,
        "ahead": host.stats.ahead,
        "gathers": stats(twin).gathers,
    }


def test_a_cast_keeps_host_shards_page_locked(zdev_pool):
    for result in zdev_pool(2).run(_cast_pair, timeout=240):
        assert result["pinned_before"], result
        assert result["devices"] == ["cpu"] and result["dtypes"] == ["torch.bfloat16"], result
        assert all(result["pinned_after"]), result
        assert result["diffs"] == [0] * STEPS, result
        assert result["gathers"] > 0 and result["ahead"] > 0, result
