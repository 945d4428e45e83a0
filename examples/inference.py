"""Sharded inference with zero3-comm, zero3-core and zero3-hooks (no zero3-optim).

Run it on two local ranks::

    ./dev run torchrun --standalone --nproc-per-node 2 examples/inference.py
"""

import copy

import torch
from torch import nn

from zero3.core import Zero3Config, gathered_parameters
from zero3.hooks import shard_module, stats

torch.manual_seed(0)  # the same weights on every rank (rank 0's are broadcast anyway)
model = nn.Sequential(
    nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8)
)
reference = copy.deepcopy(model)  # an unsharded copy, to compare with
shard_module(model, Zero3Config(backend="gloo", param_persistence_threshold=0))
model.eval()

x = torch.randn(4, 32)
with torch.no_grad():
    # The first call records the module order, the next ones prefetch.
    for _ in range(3):
        out = model(x)
    s = stats(model)  # counters of the last step
    print(f"max |sharded - unsharded| = {(out - reference(x)).abs().max().item():.1e}")
    print(
        f"last forward: {s.gathers} gather(s), {s.prefetch_gathers} of them prefetched"
    )

    # Many forwards in a row (generation): gather once, not once per call.
    with gathered_parameters(list(model.parameters())):
        y = out
        for _ in range(5):
            y = model(y.repeat(1, 4))  # 8 outputs -> 32 inputs
    print(
        f"inside gathered_parameters: {stats(model).gathers} gathers "
        "in the last forward"
    )
