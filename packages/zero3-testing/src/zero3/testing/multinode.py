"""One rank of a multi-node parity run: ``python -m zero3.testing.multinode --out DIR``.

Start it under any launcher (``torchrun --nnodes 2 ...``, ``mpiexec`` placed on two
hosts): every rank trains a small GPT through zero3 and, beside it, the same model in one
process on the whole batch, then writes ``DIR/rank<R>.json`` with

* who it is: global rank, world size, the rank on its node as the launcher says it
  (``zero3.comm``'s :func:`~zero3.comm.local_rank`) and a node key (torchrun's
  ``GROUP_RANK``, or under MPI the global rank of the node's first process);
* the accelerator index ``nccl``/``hccl``/``cupy-nccl`` would pick on a node with
  ``--devices`` devices (:func:`~zero3.comm.local_device_index`);
* how far sharded training is from the one-process reference (losses, parameters).

A test then checks the placement (two nodes, local ranks 0..n-1 on each, device index =
local rank, never the global rank) and the parity.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

from zero3.comm import CommBackend, create_backend, local_device_index, local_rank

__all__ = ["main", "node_key", "train_against_one_process"]

LOCAL = 2  # sequences per rank per step


def node_key(comm: CommBackend) -> int:
    """An id shared by exactly the ranks on one node."""
    if "GROUP_RANK" in os.environ:  # torchrun: the node's rank
        return int(os.environ["GROUP_RANK"])
    from mpi4py import MPI  # under mpiexec: the node's first global rank

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return int(node.bcast(MPI.COMM_WORLD.Get_rank(), root=0))
    finally:
        node.Free()


def train_against_one_process(comm: CommBackend, steps: int) -> dict[str, float]:
    """Train TinyGPT sharded over ``comm`` and in one process; return the largest loss
    difference and the share of parameter elements off by more than 1e-4 + 1e-3 * |v|.
    """
    from zero3.core import Zero3Config
    from zero3.hooks import full_state_dict, shard_module, stats
    from zero3.optim import PartitionedOptimizer
    from zero3.testing.models import build, train_beside

    model, make = build("gpt_tied")
    reference = copy.deepcopy(model)
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    diffs = train_beside(model, opt, reference, ref_opt, make, comm, steps, LOCAL)
    full = full_state_dict(model)
    off = total = 0
    for key, value in reference.state_dict().items():
        gap = (full[key] - value).abs()
        off += int((gap > 1e-4 + 1e-3 * value.abs()).sum())
        total += value.numel()
    return {
        "max_loss_diff": max(diffs),
        "off": off / total,
        "gathers": float(stats(model).gathers),
    }


def main(argv: list[str] | None = None) -> int:
    """Run one rank; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<R>.json")
    parser.add_argument("--backend", default="auto", help="zero3.comm backend name")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2, help="devices per node to assume")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = create_backend(args.backend, timeout_s=120)
    found = local_rank()
    result: dict[str, Any] = {
        "rank": comm.rank,
        "world": comm.world_size,
        "backend": comm.name,
        "local_rank": None if found is None else found[0],
        "local_rank_from": None if found is None else found[1],
        "node": node_key(comm),
        "device_index": local_device_index(args.devices, comm.name),
        **train_against_one_process(comm, args.steps),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{comm.rank}.json").write_text(json.dumps(result))
    comm.barrier().wait()
    comm.close()
    return 0


if __name__ == "__main__":
    code = main()
    if any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        raise SystemExit(code)  # MPI must be finalized: leave normally
    # Under torchrun: skip interpreter teardown, where gloo's threads can abort a rank that
    # has finished its work ("terminate called without an active exception").
    os._exit(code)
