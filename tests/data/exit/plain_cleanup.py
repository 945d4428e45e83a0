"""``plain_inflight.py`` with the cleanup plain torch.distributed code should do.

``destroy_process_group()`` at the end frees the group, whose destructor waits for the
collectives in flight and ends gloo's worker threads while the interpreter is whole.
``torch.distributed.nn`` is imported before ``init_process_group``: imported later (any
torch optimizer imports it), its default arguments would keep the group alive.
"""

import torch
import torch.distributed as dist
import torch.distributed.nn  # before init_process_group, see above

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.full((1 << 16,), float(rank + 1))
for _ in range(4):
    dist.all_reduce(t, async_op=True)  # never waited for
torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])  # imports torch._dynamo
print(f"rank {rank}: done")
dist.destroy_process_group()
