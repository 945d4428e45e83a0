"""A plain torch.distributed gloo script that ends without any cleanup call.

The usual pattern: a few asynchronous collectives, each waited for, and no
``destroy_process_group()`` at the end: the baseline of the exit counts on
docs/troubleshooting.rst (each script run under torchrun, run after run).
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((1 << 16,), float(rank + 1))
for _ in range(4):
    dist.all_reduce(t, async_op=True).wait()
out = torch.empty(world * t.numel())
dist.all_gather_into_tensor(out, t, async_op=True).wait()
print(f"rank {rank}: done ({out[0].item():g})")
