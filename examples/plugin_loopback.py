"""Using a comm backend that a plugin package registers: ``loopback``.

The ``zero3-comm-loopback`` package (tests/plugin/zero3-comm-loopback) registers it
through the ``zero3.comm`` entry-point group; once installed, it is a name like any
other. A world of one rank, so run it as one process::

    ./dev run python examples/plugin_loopback.py
"""

import torch
from torch import nn

from zero3.comm import available_backends, create_backend, registered_backends
from zero3.core import Zero3Config
from zero3.hooks import shard_module
from zero3.optim import PartitionedOptimizer

print(f"registered: {registered_backends()}")
print(f"available here: {available_backends()}")

comm = create_backend(
    "loopback"
)  # found through the entry point, built with its options
print(f"{type(comm).__name__}: rank {comm.rank} of {comm.world_size}")

out = torch.empty(3)
comm.all_gather(
    out, torch.tensor([1.0, 2.0, 3.0])
).wait()  # a local copy in a world of one

torch.manual_seed(0)
model = shard_module(
    nn.Linear(4, 1), Zero3Config(param_persistence_threshold=0), comm=comm
)
opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
for _ in range(3):
    model(torch.ones(2, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print(f"trained over the loopback backend: all_gather -> {out.tolist()}")
