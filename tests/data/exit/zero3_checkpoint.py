"""A zero3 user script that saves checkpoints and ends without any cleanup call.

Checkpoints run on a gloo group of their own, which zero3 makes on the first save; like
zero3's other groups it must be gone after zero3's exit handler, or its gloo threads
live into interpreter finalization. tests/test_teardown.py runs it under torchrun with
a directory every rank can write as the only argument; the async save must be
published in it.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from zero3.core import Zero3Config
from zero3.hooks import shard_module
from zero3.optim import PartitionedOptimizer, save_checkpoint

torch.manual_seed(0)
model = shard_module(
    nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)),
    Zero3Config(param_persistence_threshold=0),
)
opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
model(x).pow(2).mean().backward()
opt.step()
opt.zero_grad()
save_checkpoint(Path(sys.argv[1]) / "sync", model, opt)
# Not waited for: Python waits for the checkpoint thread before exit handlers run, so
# the save completes and only then does zero3's handler destroy the group it writes on.
save_checkpoint(Path(sys.argv[1]) / "async", model, opt, async_save=True)
print("done: async save submitted")
