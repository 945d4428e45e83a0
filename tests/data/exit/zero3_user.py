"""A zero3 user script that ends without any cleanup call.

It shards a small model (every parameter sharded), trains a few steps with gradient
reductions overlapping backward and prefetched gathers, and simply ends: no
``close()``, no ``destroy_process_group()``. tests/test_teardown.py runs it under
torchrun (it must exit 0, no gloo thread left after zero3's exit handler); the exit
counts on docs/troubleshooting.rst ran it 50 times.
"""

import torch
from torch import nn

from zero3.core import Zero3Config
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
# Every parameter sharded, released after each module (so backward gathers again), small
# gradient chunks (several reductions in flight) and clipping (one more collective).
config = Zero3Config(
    param_persistence_threshold=0,
    max_reuse_distance=0,
    overlap_chunk_size=1024,
    gradient_clipping=1.0,
)
model = shard_module(model, config)
opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
data = torch.Generator().manual_seed(1)
for _ in range(5):
    x = torch.randn(8, 16, generator=data)
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    loss.backward()
    opt.step()
    opt.zero_grad()
last = stats(model)
gathers = last.forward_gathers + last.backward_gathers
print(f"done: loss {loss.item():.4f}, {gathers} gathers, {last.reduce_collectives} reductions")
