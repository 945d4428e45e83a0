"""Benchmark all-gather and reduce-scatter bandwidth of zero3.comm backends on CPU.

Run under MPI, which provides the ranks; gloo is set up in the same processes through a
file store whose path rank 0 broadcasts over MPI::

    ./dev run mpiexec -n 2 python tools/bench_comm.py
    ./dev run mpiexec -n 2 python tools/bench_comm.py --sizes 1M,16M --iters 50

Bandwidths follow nccl-tests: ``algbw = bytes / time`` with ``bytes`` the full buffer
(the all-gather output, the reduce-scatter input) and ``busbw = algbw * (n - 1) / n``
for both collectives. Each timed iteration starts after an (untimed) MPI barrier; the
time of an iteration is the slowest rank's, and the table shows the median over
iterations. Backends are interleaved per size so machine drift hits them alike.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zero3.comm import CommBackend, GlooBackend, MPIBackend, ReduceOp, Work

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = UNITS.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in UNITS else text) * scale)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="full buffer sizes, e.g. 4K,1M,64M")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per point")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per point")
    parser.add_argument(
        "--backends",
        default="gloo,mpi",
        help="comma list of gloo, gloo-native, gloo-allreduce, mpi, mpi-nothread",
    )
    parser.add_argument("--ops", default="all_gather,reduce_scatter")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout (s)")
    return parser.parse_args(argv)


#: gloo variants: the defaults (broadcast all-gather, exchange reduce-scatter), gloo's own
#: collectives, and reduce-scatter through an all-reduce.
GLOO_VARIANTS: dict[str, dict[str, str]] = {
    "gloo": {},
    "gloo-native": {"all_gather_via": "native", "reduce_scatter_via": "native"},
    "gloo-allreduce": {"reduce_scatter_via": "all_reduce"},
}


def _init_gloo(comm: Any, timeout_s: float) -> None:
    """The default gloo group over a file store whose path rank 0 broadcasts over MPI."""
    path = None
    if comm.Get_rank() == 0:
        tmpdir = tempfile.mkdtemp(prefix="zero3-bench-")
        atexit.register(shutil.rmtree, tmpdir, ignore_errors=True)
        path = os.path.join(tmpdir, "store")
    path = comm.bcast(path, root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def make_backends(names: list[str], mpi: Any, timeout_s: float) -> dict[str, CommBackend]:
    comm = mpi.COMM_WORLD
    backends: dict[str, CommBackend] = {}
    for name in names:
        if name in ("mpi", "mpi-nothread"):
            # mpi-nothread: no progress thread, requests advance only inside wait().
            backends[name] = MPIBackend(timeout_s=timeout_s, progress_thread=name == "mpi")
        elif name in GLOO_VARIANTS:
            if not dist.is_initialized():
                _init_gloo(comm, timeout_s)
            backends[name] = GlooBackend(timeout_s=timeout_s, **GLOO_VARIANTS[name])
        else:
            choices = ", ".join([*GLOO_VARIANTS, "mpi", "mpi-nothread"])
            raise SystemExit(f"unknown backend {name!r} (choose from {choices})")
    return backends


def make_op(backend: CommBackend, op: str, nbytes: int, dtype: torch.dtype) -> Callable[[], Work]:
    n = backend.world_size
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_rank = max(1, nbytes // (itemsize * n))
    full = torch.ones(per_rank * n, dtype=dtype)
    part = torch.ones(per_rank, dtype=dtype)
    if op == "all_gather":
        return lambda: backend.all_gather(full, part)
    if op == "reduce_scatter":
        return lambda: backend.reduce_scatter(part, full, op=ReduceOp.SUM)
    raise SystemExit(f"unknown op {op!r} (choose from all_gather, reduce_scatter)")


def time_point(mpi: Any, run: Callable[[], Work], warmup: int, iters: int) -> float:
    """Median over iterations of the slowest rank's time for one collective (seconds)."""
    comm = mpi.COMM_WORLD
    for _ in range(warmup):
        run().wait()
    times = []
    for _ in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        run().wait()
        times.append(time.perf_counter() - start)
    slowest = comm.allgather(times)
    per_iter = [max(rank_times[i] for rank_times in slowest) for i in range(iters)]
    return float(statistics.median(per_iter))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        print(
            "run under mpiexec with at least 2 ranks, e.g. "
            "./dev run mpiexec -n 2 python tools/bench_comm.py"
        )
        return 2
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    dtype = DTYPES[args.dtype]
    backends = make_backends(names, MPI, args.timeout)
    results: dict[tuple[str, int, str], float] = {}
    started = time.perf_counter()
    for op in ops:
        for nbytes in sizes:
            for name in names:
                run = make_op(backends[name], op, nbytes, dtype)
                results[op, nbytes, name] = time_point(MPI, run, args.warmup, args.iters)
    if rank == 0:
        print_table(results, ops, sizes, names, n, args, time.perf_counter() - started)
    for backend in backends.values():
        backend.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def print_table(
    results: dict[tuple[str, int, str], float],
    ops: list[str],
    sizes: list[int],
    names: list[str],
    n: int,
    args: argparse.Namespace,
    elapsed: float,
) -> None:
    print(
        f"world {n}, {args.dtype}, {args.iters} iters (+{args.warmup} warmup), "
        f"median of the slowest rank, torch threads {args.threads}, {elapsed:.1f} s\n"
    )
    header = ["op", "bytes"]
    for name in names:
        header += [f"{name} time (us)", f"{name} algbw (GB/s)", f"{name} busbw (GB/s)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for op in ops:
        for nbytes in sizes:
            row = [op, human(nbytes)]
            for name in names:
                seconds = results[op, nbytes, name]
                algbw = nbytes / seconds / 1e9
                busbw = algbw * (n - 1) / n
                row += [f"{seconds * 1e6:.0f}", f"{algbw:.2f}", f"{busbw:.2f}"]
            print("| " + " | ".join(row) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
