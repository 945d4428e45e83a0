"""zero3-comm on its own: asynchronous collectives behind one interface.

Needs only the ``zero3-comm`` distribution (and torch)::

    ./dev run torchrun --standalone --nproc-per-node 2 examples/comm_only.py
"""

import torch

from zero3.comm import ReduceOp, UnsupportedDTypeError, create_backend

comm = create_backend("gloo", timeout_s=60)  # any registered name, or "auto"
rank, world = comm.rank, comm.world_size

# All-gather: every rank's 4 elements, concatenated in rank order.
out = torch.empty(4 * world)
work = comm.all_gather(out, torch.full((4,), float(rank)))  # returns at once
local = torch.randn(64, 64) @ torch.randn(64, 64)  # host work overlaps the collective
work.wait()  # ``out`` is valid from here on
print(f"rank {rank}: all_gather -> {out.tolist()}")

# Reduce-scatter: sum over ranks, rank r keeps chunk r.
chunk = torch.empty(2)
send = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
comm.reduce_scatter(chunk, send, op=ReduceOp.SUM).wait()
print(f"rank {rank}: reduce_scatter(SUM) -> {chunk.tolist()}")

# Coalesced: a list of tensors in one collective (one packed buffer underneath).
outs = [torch.empty(2 * world), torch.empty(3 * world)]
ins = [torch.full((2,), 1.0 + rank), torch.full((3,), 10.0 + rank)]
comm.all_gather_coalesced(outs, ins).wait()
if rank == 0:
    print(f"all_gather_coalesced -> {[t.tolist() for t in outs]}")

# Bad input is refused before any collective starts, with the same message everywhere.
try:
    comm.all_reduce(torch.ones(2, dtype=torch.bool))
except UnsupportedDTypeError as exc:
    if rank == 0:
        print(f"refused: {str(exc).split(';')[0]}")

if rank == 0:
    caps = comm.capabilities  # what core reads to pick its communication path
    print(f"{comm.name}: native reduce-scatter {caps.native_reduce_scatter}")
comm.barrier().wait()
comm.close()
