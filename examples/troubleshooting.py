"""The troubleshooting guide's cases, run for real.

Run it on two local ranks::

    ./dev run torchrun --standalone --nproc-per-node 2 examples/troubleshooting.py
"""

import warnings

import torch
from torch import nn

from zero3.comm import create_backend
from zero3.core import FingerprintMismatchError, Zero3Config, full_grad, local_grad
from zero3.hooks import set_leaf_modules, shard_module, stats
from zero3.optim import PartitionedOptimizer

COMM = create_backend("auto", timeout_s=60)
RANK = COMM.rank
CONFIG = Zero3Config(param_persistence_threshold=0)


class Skippable(nn.Module):
    """Three layers; the middle one can be switched off (control flow that changes)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.use_b = True

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.use_b:
            h = torch.relu(self.b(h))
        return self.c(h)


def trace_invalidation():
    torch.manual_seed(0)
    model = shard_module(Skippable(), CONFIG, comm=COMM)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            model.use_b = step < 2  # every rank changes its control flow at step 2
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            counts.append(stats(model).trace_invalidations)
    if RANK == 0:
        print(f"trace_invalidations per step: {counts}")
        print(f"warning: {str(caught[0].message).split(';')[0]}")


def gradients_live_in_shards():
    torch.manual_seed(0)
    model = shard_module(nn.Linear(8, 4), CONFIG, comm=COMM)
    model(torch.randn(2, 8)).sum().backward()
    weight = model.weight
    full = full_grad(weight)  # a collective: every rank calls it, in the same order
    if RANK == 0:
        try:
            # No full gradient exists: reading it is an error, not None.
            print(weight.grad)
        except RuntimeError as exc:
            print(f"weight.grad: {str(exc).split(': ', 2)[1]}")
        print(
            f"local_grad: {tuple(local_grad(weight).shape)}, "
            f"full_grad: {tuple(full.shape)}"
        )
        # Outside forward and backward the parameter is released: full shape, no bytes.
        print(
            f"weight: shape {tuple(weight.shape)}, "
            f"{weight.untyped_storage().nbytes()} bytes"
        )
        try:
            weight.sum()  # reading its values outside a gather is a clear error
        except RuntimeError as exc:
            print(f"weight.sum(): {str(exc).split(', so')[0]}")


class TopOneMoE(nn.Module):
    """Sends each token to one expert; only experts that receive tokens run."""

    def __init__(self, dim=8, experts=2):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        with torch.no_grad():  # route on features 0 and 1, so the data picks the expert
            self.router.weight.zero_()
            self.router.weight[:, :experts] = torch.eye(experts) * 10
            self.router.bias.zero_()

    def forward(self, x):
        choice = self.router(x).argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = expert(x[mask])
        return out


def routed_batch():
    x = torch.randn(4, 8) * 0.1
    x[:, RANK % 2] = (
        5.0  # rank r's tokens all go to expert r: ranks run different modules
    )
    return x


def divergent_modules():
    torch.manual_seed(0)
    model = shard_module(nn.Sequential(TopOneMoE(), nn.Linear(8, 1)), CONFIG, comm=COMM)
    try:
        model(routed_batch())
        print(f"rank {RANK}: no error (a world of one rank cannot diverge)")
    except FingerprintMismatchError as exc:
        if RANK == 0:
            print("\n".join(str(exc).splitlines()[:3]))

    torch.manual_seed(0)
    model = nn.Sequential(TopOneMoE(), nn.Linear(8, 1))
    # Gathered whole on entry: routing is free inside.
    set_leaf_modules(model, TopOneMoE)
    model = shard_module(model, CONFIG, comm=COMM)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    for _ in range(2):
        model(routed_batch()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if RANK == 0:
        gathers = stats(model).gathers
        print(
            f"with TopOneMoE as a leaf: trained; {gathers} gather(s) in the last step"
        )


trace_invalidation()
gradients_live_in_shards()
divergent_modules()
