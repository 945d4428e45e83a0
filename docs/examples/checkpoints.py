"""Checkpoints of a sharded model: full weights, per-rank optimizer state, resuming.

    torchrun --standalone --nproc-per-node 2 docs/examples/checkpoints.py [DIR]

Writes into DIR (default ``zero3-checkpoint`` in the working directory), which every
rank must be able to read.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from zero3.comm import create_backend
from zero3.core import Zero3Config, gathered_parameters
from zero3.hooks import full_state_dict, load_full_state_dict, shard_module
from zero3.optim import PartitionedOptimizer

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


def save(model, opt):
    try:
        model.state_dict()  # refused: it would hold no data for partitioned parameters
    except RuntimeError as exc:
        if RANK == 0:
            print(f"model.state_dict(): {str(exc).split(',')[0]}")
    weights = full_state_dict(model, rank0_only=True)  # collective: every rank calls it
    DIR.mkdir(parents=True, exist_ok=True)
    if RANK == 0:
        torch.save(weights, DIR / "model.pt")  # an ordinary, unsharded state dict
    torch.save(opt.state_dict(), DIR / f"optim-rank{RANK}-of-{WORLD}.pt")  # one per rank
    COMM.barrier().wait()  # the files are complete before anyone reads them


def resume():
    model = build()
    weights = torch.load(DIR / "model.pt", mmap=True)  # every rank reads the full weights
    load_full_state_dict(model, weights)  # each rank keeps its own shard
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)  # after loading: masters
    opt.load_state_dict(torch.load(DIR / f"optim-rank{RANK}-of-{WORLD}.pt"))  # same rank, world
    return model, opt


def edit_on_one_rank(model):
    with gathered_parameters(model[2].bias, modifier_rank=0), torch.no_grad():
        if RANK == 0:  # the parameter is whole on every rank inside the block
            model[2].bias.zero_()  # rank 0's edit is broadcast when the block exits
    with gathered_parameters(model[2].bias):
        print(f"rank {RANK}: bias after the edit {model[2].bias.tolist()}")


model = build()
opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
train(model, opt, steps=3, first=0)
save(model, opt)
straight = train(model, opt, steps=2, first=3)  # the run without interruption

model, opt = resume()
resumed = train(model, opt, steps=2, first=3)
if RANK == 0:
    print(f"resumed losses equal the uninterrupted run: {resumed == straight}")
edit_on_one_rank(model)
