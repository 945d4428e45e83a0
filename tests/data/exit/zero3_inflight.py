"""The same as ``plain_inflight.py`` through zero3.comm: collectives never waited for.

zero3's exit handler waits for them (boundedly) and destroys the groups zero3 created
before the interpreter finalizes.
"""

import torch

from zero3.comm import create_backend

comm = create_backend("gloo", timeout_s=60)
t = torch.full((1 << 16,), float(comm.rank + 1))
for _ in range(4):
    comm.all_reduce(t)  # never waited for
print(f"rank {comm.rank}: done")
