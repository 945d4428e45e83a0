"""Checkpoints of a sharded model: save at one world size, load at any, export weights.

    ./dev run torchrun --standalone --nproc-per-node 2 examples/checkpoints.py [DIR]

Writes into DIR (default ``zero3-checkpoint`` in the working directory), which every
rank must be able to read.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from zero3.comm import create_backend
from zero3.core import Zero3Config, gathered_parameters
from zero3.hooks import shard_module
from zero3.optim import (
    PartitionedOptimizer,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

COMM = create_backend("auto", timeout_s=60)
RANK, WORLD = COMM.rank, COMM.world_size
DIR = Path(sys.argv[1] if len(sys.argv) > 1 else "zero3-checkpoint")


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    return shard_module(model, Zero3Config(param_persistence_threshold=0), comm=COMM)


def train(model, opt, steps, first):
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(4 * WORLD, 16, generator=torch.Generator().manual_seed(step))
        mine = slice(4 * RANK, 4 * (RANK + 1))
        loss = (model(x[mine]) - x[mine].mean(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def save(model, opt, step):
    # model.state_dict() (every rank): trainable parameters come whole (gathered),
    # frozen partitioned ones as ShardedTensors viewing this rank's shard.
    kinds = sorted({type(v).__name__ for v in model.state_dict().values()})
    if RANK == 0:
        print(f"model.state_dict(): {kinds}")
    # save_checkpoint never gathers: every rank writes its own shards; the directory
    # appears once all have finished.
    save_checkpoint(DIR / "ckpt", model, opt, extra={"step": step})


def resume():
    model = build()
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    extra = load_checkpoint(DIR / "ckpt", model, opt)  # at any world size
    return model, opt, extra["step"]


def save_in_background(model, opt, step):
    future = save_checkpoint(
        DIR / "ckpt", model, opt, extra={"step": step}, async_save=True
    )
    # Training goes on while the files are written.
    train(model, opt, steps=1, first=step)
    return future.result()  # the published path; raises if the save failed


def export():
    if RANK == 0:  # one process, one tensor in memory at a time
        files = consolidate_checkpoint(DIR / "ckpt", DIR / "weights", dtype="bfloat16")
        print(f"consolidated: {[p.name for p in files]}")


def open_with_torch():
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if RANK == 0:  # torch's own tool reads a zero3 checkpoint into unsharded tensors
        dcp_to_torch_save(DIR / "ckpt", DIR / "full.pt")
        full = torch.load(DIR / "full.pt", weights_only=True)
        print(f"dcp_to_torch_save: {sorted(full)}, model keys {sorted(full['model'])}")


def edit_on_one_rank(model):
    with gathered_parameters(model[2].bias, modifier_rank=0), torch.no_grad():
        if RANK == 0:  # the parameter is whole on every rank inside the block
            model[2].bias.zero_()  # rank 0's edit is broadcast when the block exits
    with gathered_parameters(model[2].bias):
        print(f"rank {RANK}: bias after the edit {model[2].bias.tolist()}")


model = build()
opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
train(model, opt, steps=3, first=0)
save(model, opt, step=3)
straight = train(model, opt, steps=2, first=3)  # the run without interruption

model, opt, step = resume()
resumed = train(model, opt, steps=2, first=step)
if RANK == 0:
    print(f"resumed losses equal the uninterrupted run: {resumed == straight}")
published = save_in_background(model, opt, step=5)
if RANK == 0:
    print(f"async save published {published.name}")
export()
open_with_torch()
edit_on_one_rank(model)
