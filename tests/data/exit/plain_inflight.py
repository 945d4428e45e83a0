"""A plain torch.distributed gloo script that ends with collectives still in flight.

The harsher case: asynchronous all-reduces issued and never waited for, and no
``destroy_process_group()``; counted beside ``zero3_inflight.py`` on docs/troubleshooting.rst.
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.full((1 << 16,), float(rank + 1))
for _ in range(4):
    dist.all_reduce(t, async_op=True)  # never waited for
print(f"rank {rank}: done")
