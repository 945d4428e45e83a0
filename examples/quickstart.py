"""Quick start: an ordinary training loop with every model state sharded over the ranks.

Run it on two local ranks, or as one process (a world of one rank)::

    ./dev run torchrun --standalone --nproc-per-node 2 examples/quickstart.py
    ./dev run python examples/quickstart.py
"""

import torch
from torch import nn

from zero3.comm import create_backend
from zero3.core import Zero3Config, local_shard
from zero3.hooks import shard_module
from zero3.optim import PartitionedOptimizer

comm = create_backend("auto")  # gloo on CPU, nccl on CUDA, mpi under mpiexec alone
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
# Parameters of at most param_persistence_threshold elements stay whole on every rank;
# 0 shards even this tiny model.
model = shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)

data = torch.Generator().manual_seed(1)  # the same global batches on every rank
for step in range(30):
    x = torch.randn(8 * comm.world_size, 16, generator=data)
    y = x.sum(dim=1, keepdim=True)
    mine = slice(8 * comm.rank, 8 * (comm.rank + 1))  # this rank's share of the batch
    loss = nn.functional.mse_loss(model(x[mine]), y[mine])
    loss.backward()  # gathers and releases parameters, reduce-scatters gradients
    opt.step()  # steps this rank's fp32 master shards, writes them back
    opt.zero_grad()
    if comm.rank == 0 and (step + 1) % 10 == 0:
        print(f"step {step + 1}: loss {loss.item():.4f} (rank 0's share of the batch)")

weight = model[0].weight  # full shape; this rank holds only its shard between uses
print(
    f"rank {comm.rank}: holds {local_shard(weight).numel()} of {weight.numel()} "
    "elements"
)
