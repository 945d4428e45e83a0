"""Host synchronisations per training step on zdev: a fixed few, whatever the model.

Two counts of the same thing, at world 2 with ``overlap_comm`` on, for a 1-block and a
3-block TinyGPT: ``zero3.testing.HostSyncCounter`` (a torch-function mode that sees
Python-level calls; here it tells device from host memory by each tensor's device), and
the device's own count (every blocking copy, ``.item()`` and ``synchronize`` that reached
the device, including those torch makes in C++ where the mode cannot see). Both must stay
within the budget of tests/test_device_discipline.py and not grow with the model.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from zero3.core import Zero3Config
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing import HostSyncCounter, RealDevice
from zero3.testing.models import TinyGPT, loss_of, token_batch

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(300)]

STEPS = 3
#: As tests/test_device_discipline.py: the got-gradient flags and the reduction
#: fingerprints at the end of backward, the overflow verdict and the clipping norm.
STEP_BUDGET = 4
VALUE_SYNCS = ("read", "to-host", "shape", "wait")
#: The device's kinds that block the host on a device value.
DEVICE_WAITS = ("stream", "event", "device", "to-host")


def _syncs(layers: int, **config: Any) -> dict[str, Any]:
    from zero3.testing.device import detector

    dev = torch.device("zdev", int(os.environ["LOCAL_RANK"]))
    n, r = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyGPT(layers=layers).to(dev)
    make = token_batch(61, 16)
    settings = {"param_persistence_threshold": 0, "overlap_chunk_size": 2000, **config}
    shard_module(model, Zero3Config(backend="zdev", overlap_comm=True, **settings))
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    counter = HostSyncCounter(RealDevice())
    device_counts: dict[str, int] = {}
    with counter:
        for step in range(STEPS):
            x = make(2 * n, step)[r * 2 : (r + 1) * 2].to(dev)  # the batch: not the engine's
            before = detector.host_syncs()
            with counter.step():
                opt.scale_loss(loss_of(model(x))).backward()
                opt.step()
            after = detector.host_syncs()
            device_counts = {kind: after[kind] - before[kind] for kind in after}
            opt.zero_grad()
    last = counter.steps[-1]
    values = [s for s in last if s.kind in VALUE_SYNCS]
    to_device = [s for s in last if s.kind == "to-device"]
    return {
        "values": len(values),
        "values_text": HostSyncCounter.describe(values),
        "to_device": len(to_device),
        "device": device_counts,
        "reductions": stats(model).reduce_collectives,
        "skipped": opt.scaler.skipped_steps,
    }


CONFIGS = {
    "fp32": {},
    "clipping": {"gradient_clipping": 1.0},
    "fp16": {"param_dtype": torch.float16, "initial_scale_power": 8},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_host_syncs_per_step_on_zdev_are_a_fixed_few(zdev_pool, config):
    small = zdev_pool(2).run(_syncs, 1, timeout=240, **CONFIGS[config])
    large = zdev_pool(2).run(_syncs, 3, timeout=240, **CONFIGS[config])
    for one, three in zip(small, large, strict=True):
        assert one["skipped"] == 0 and three["reductions"] > one["reductions"], (one, three)
        text = f"1 block:\n{one['values_text']}\n3 blocks:\n{three['values_text']}"
        assert one["values"] == three["values"] <= STEP_BUDGET, text
        assert one["to_device"] == three["to_device"], (one, three)
        waits = [sum(c["device"][k] for k in DEVICE_WAITS) for c in (one, three)]
        assert waits[0] == waits[1] <= STEP_BUDGET, (one["device"], three["device"])
        assert one["device"]["to-device"] == three["device"]["to-device"], (one, three)
