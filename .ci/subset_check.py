"""Checks that an installed subset of zero3 is enough for what it promises.

Run under torchrun with 2 ranks from an environment holding only some packages:

    comm      zero3-comm alone: a 2-rank async all-gather and reduce-scatter
    inference zero3-comm + zero3-core + zero3-hooks: a sharded forward equals the model's
"""

from __future__ import annotations

import importlib.util
import sys

import torch


def comm_only() -> None:
    from zero3.comm import create_backend

    assert importlib.util.find_spec("zero3.core") is None, "zero3.core should not be installed"
    comm = create_backend("gloo", timeout_s=60)
    out = torch.empty(4 * comm.world_size)
    comm.all_gather(out, torch.full((4,), float(comm.rank))).wait()
    assert out.tolist() == [float(r) for r in range(comm.world_size) for _ in range(4)]
    shard = torch.empty(2)
    comm.reduce_scatter(shard, torch.ones(2 * comm.world_size)).wait()
    assert shard.tolist() == [1.0, 1.0]
    print(f"rank {comm.rank}: zero3-comm alone works ({comm.name}, world {comm.world_size})")


def inference() -> None:
    import copy

    from zero3.core import Zero3Config
    from zero3.hooks import shard_module, stats

    assert importlib.util.find_spec("zero3.optim") is None, "zero3.optim should not be installed"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(backend="gloo", param_persistence_threshold=0))
    x = torch.randn(5, 32)
    with torch.no_grad():
        diff = (model(x) - reference(x)).abs().max().item()
    assert diff < 1e-6, diff
    assert stats(model).gathers > 0
    print(f"sharded inference with comm+core+hooks works (max diff {diff:.1e})")


if __name__ == "__main__":
    {"comm": comm_only, "inference": inference}[sys.argv[1]]()
