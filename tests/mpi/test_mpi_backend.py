"""The MPI backend against gloo, on every rank of ``mpiexec -n 2`` (or 4).

Run with::

    .venv/bin/mpiexec -n 2 .venv/bin/python -m pytest tests/mpi -q -p no:cacheprovider

Each test issues the same collectives on every rank and asserts only after all of them
completed, so a failing assertion on one rank never leaves a peer waiting on a
collective it skipped; the backend timeout and pytest-timeout bound anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch


def _mpi_world_size() -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        return 0
    return int(MPI.COMM_WORLD.Get_size())


if _mpi_world_size() < 2:
    pytest.skip(
        "needs an MPI world of 2 or more ranks: run "
        "`mpiexec -n 2 python -m pytest tests/mpi` (mpi4py from zero3-comm[mpi])",
        allow_module_level=True,
    )

from zero3.comm import (  # noqa: E402  (only importable usefully under mpiexec)
    CommBackend,
    CommTimeoutError,
    GlooBackend,
    MPIBackend,
    ReduceOp,
    Work,
)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["sync", "async"]


def exact_values(dtype: torch.dtype, n: int, rank: int, seed: int = 0) -> torch.Tensor:
    """Small integers (and halves): sums over 4 ranks and their averages stay exact."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randint(-16, 17, (n,), generator=g) / 2).to(dtype)


def random_values(dtype: torch.dtype, n: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank + 7)
    return (torch.randn(n, generator=g) * 10).to(dtype)


def burn(seconds: float) -> None:
    """Busy host compute (torch work) without any MPI call."""
    a = torch.randn(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def run_pair(
    mpib: MPIBackend,
    gloo: GlooBackend,
    mode: str,
    issue: Callable[[CommBackend], tuple[Work, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one collective on both backends; ``async`` overlaps them with host work."""
    if mode == "sync":
        work, got = issue(mpib)
        work.wait()
        ref_work, ref = issue(gloo)
        ref_work.wait()
        return got, ref
    work, got = issue(mpib)
    ref_work, ref = issue(gloo)
    burn(0.01)
    ref_work.wait()
    work.wait()
    return got, ref


def assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype
    assert torch.equal(got, ref), f"max diff {(got.double() - ref.double()).abs().max()}"


# -- every collective against gloo ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather(mpib: MPIBackend, gloo: GlooBackend, dtype: torch.dtype, mode: str) -> None:
    x = random_values(dtype, 1000, mpib.rank)

    def issue(b: CommBackend) -> tuple[Work, torch.Tensor]:
        out = torch.full((b.world_size * x.numel(),), -1.0, dtype=dtype)
        return b.all_gather(out, x), out

    got, ref = run_pair(mpib, gloo, mode, issue)
    assert_same(got, ref)
    assert_same(got[mpib.rank * 1000 : (mpib.rank + 1) * 1000], x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter(
    mpib: MPIBackend, gloo: GlooBackend, dtype: torch.dtype, op: ReduceOp, mode: str
) -> None:
    n = mpib.world_size
    make = random_values if op is ReduceOp.MAX else exact_values
    x = make(dtype, 256 * n, mpib.rank, seed=1)

    def issue(b: CommBackend) -> tuple[Work, torch.Tensor]:
        out = torch.full((256,), -1.0, dtype=dtype)
        return b.reduce_scatter(out, x, op=op), out

    got, ref = run_pair(mpib, gloo, mode, issue)
    assert_same(got, ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", list(ReduceOp), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce(
    mpib: MPIBackend, gloo: GlooBackend, dtype: torch.dtype, op: ReduceOp, mode: str
) -> None:
    make = random_values if op in (ReduceOp.MAX, ReduceOp.MIN) else exact_values
    x = make(dtype, 777, mpib.rank, seed=2)

    def issue(b: CommBackend) -> tuple[Work, torch.Tensor]:
        t = x.clone()
        return b.all_reduce(t, op=op), t

    got, ref = run_pair(mpib, gloo, mode, issue)
    assert_same(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bf16_fp16_random_sums_match_gloo(
    mpib: MPIBackend, gloo: GlooBackend, dtype: torch.dtype
) -> None:
    # Inexact values: at world 2 each element is one rounded addition, so MPI's user
    # op must round exactly like gloo. Beyond 2 ranks summation order may differ.
    x = random_values(dtype, 4096, mpib.rank, seed=3)
    got, ref = run_pair(mpib, gloo, "sync", lambda b: _all_reduce(b, x, ReduceOp.SUM))
    if mpib.world_size == 2:
        assert_same(got, ref)
    else:
        # |sums| < 128 here; three roundings of at most half an ulp at 128 each.
        ulp_at_128 = 128 * torch.finfo(dtype).eps
        torch.testing.assert_close(got, ref, rtol=0, atol=2 * ulp_at_128)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.uint8], ids=str)
def test_other_dtypes(mpib: MPIBackend, gloo: GlooBackend, dtype: torch.dtype) -> None:
    x = exact_values(torch.float32, 64 * mpib.world_size, mpib.rank, seed=4)
    x = (x.abs() if dtype == torch.uint8 else x).to(dtype)
    results = []
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
        results.append(run_pair(mpib, gloo, "sync", lambda b, op=op: _all_reduce(b, x, op)))
    for got, ref in results:
        assert_same(got, ref)


def _all_reduce(b: CommBackend, x: torch.Tensor, op: ReduceOp) -> tuple[Work, torch.Tensor]:
    t = x.clone()
    return b.all_reduce(t, op=op), t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(mpib: MPIBackend, gloo: GlooBackend, dtype: torch.dtype) -> None:
    x = random_values(dtype, 333, mpib.rank, seed=5)
    results = []
    for src in range(mpib.world_size):

        def issue(b: CommBackend, src: int = src) -> tuple[Work, torch.Tensor]:
            t = x.clone()
            return b.broadcast(t, src), t

        results.append((src, *run_pair(mpib, gloo, "async", issue)))
    for src, got, ref in results:
        assert_same(got, ref)
        assert_same(got, random_values(dtype, 333, src, seed=5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_coalesced(mpib: MPIBackend, gloo: GlooBackend, dtype: torch.dtype) -> None:
    n, rank = mpib.world_size, mpib.rank
    sizes = (5, 1, 64)
    parts = [random_values(dtype, s, rank, seed=s) for s in sizes]
    chunks = [exact_values(dtype, s * n, rank, seed=s).view(n, s) for s in sizes]

    def coalesced(b: CommBackend) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = [torch.empty(s * n, dtype=dtype) for s in sizes]
        scattered = [torch.empty(s, dtype=dtype) for s in sizes]
        gather = b.all_gather_coalesced(gathered, parts)
        scatter = b.reduce_scatter_coalesced(scattered, chunks, op=ReduceOp.AVG)
        scatter.wait()
        gather.wait()  # the unpacking into the outputs happens inside wait()
        return torch.cat(gathered), torch.cat(scattered)

    gathered, scattered = coalesced(mpib)
    gathered_ref, scattered_ref = coalesced(gloo)
    assert_same(gathered, gathered_ref)
    assert_same(scattered, scattered_ref)
    # The first output: row ``rank`` of every rank's first input, averaged over ranks.
    first = sizes[0]
    rows = [exact_values(dtype, first * n, r, seed=first).view(n, first)[rank] for r in range(n)]
    assert_same(scattered[:first], torch.stack(rows).double().mean(0).to(dtype))


def test_non_contiguous_input(mpib: MPIBackend, gloo: GlooBackend) -> None:
    x = random_values(torch.float32, 24, mpib.rank).reshape(4, 6).t()
    assert not x.is_contiguous()

    def issue(b: CommBackend) -> tuple[Work, torch.Tensor]:
        out = torch.empty(24 * b.world_size)
        return b.all_gather(out, x), out

    got, _ = run_pair(mpib, gloo, "sync", issue)
    ref = torch.empty(24 * gloo.world_size)
    gloo.all_gather(ref, x.contiguous()).wait()
    assert_same(got, ref)


def test_many_in_flight(mpib: MPIBackend, gloo: GlooBackend) -> None:
    # Several collectives outstanding at once, waited in reverse order.
    n, rank = mpib.world_size, mpib.rank
    x = exact_values(torch.bfloat16, 512 * n, rank, seed=6)

    def issue_all(b: CommBackend) -> tuple[list[Work], list[torch.Tensor]]:
        gathered = torch.empty(512 * n * n, dtype=torch.bfloat16)
        scattered = torch.empty(512, dtype=torch.bfloat16)
        reduced = x.clone()
        cast = x.clone()
        works = [
            b.all_gather(gathered, x),
            b.reduce_scatter(scattered, x, op=ReduceOp.SUM),
            b.all_reduce(reduced, op=ReduceOp.AVG),
            b.broadcast(cast, n - 1),
            b.barrier(),
        ]
        return works, [gathered, scattered, reduced, cast]

    works, got = issue_all(mpib)
    burn(0.02)
    for work in reversed(works):
        work.wait()
    ref_works, ref = issue_all(gloo)
    for work in ref_works:
        work.wait()
    for g, r in zip(got, ref, strict=True):
        assert_same(g, r)


def test_barrier_waits_for_the_last_rank(mpi: Any, mpib: MPIBackend) -> None:
    start = time.monotonic()
    if mpib.rank == 0:
        time.sleep(0.3)
    mpib.barrier().wait()
    elapsed = mpi.COMM_WORLD.allgather(time.monotonic() - start)
    assert all(e >= 0.25 for e in elapsed), elapsed


# -- asynchronous progress --------------------------------------------------------------


def test_progress_thread_completes_while_caller_computes(mpi: Any, mpib: MPIBackend) -> None:
    # Rank 1 joins late; rank 0 computes and only reads is_completed(), which with a
    # progress thread never calls into MPI: if it turns True, the thread did the work.
    x = torch.full((1 << 18,), float(mpib.rank))
    out = torch.empty(x.numel() * mpib.world_size)
    mpib.barrier().wait()
    if mpib.rank == 1:
        time.sleep(0.3)
    work = mpib.all_gather(out, x)
    seen_at = None
    start = time.monotonic()
    if mpib.rank == 0:
        a = torch.randn(128, 128)
        while seen_at is None and time.monotonic() - start < 20:
            a = torch.tanh(a @ a)
            if work.is_completed():
                seen_at = time.monotonic() - start
    work.wait()
    seen = mpi.COMM_WORLD.bcast(seen_at, root=0)
    assert seen is not None, "the all-gather never completed while rank 0 computed"
    assert seen >= 0.2  # it really waited for the late rank
    expected = torch.arange(mpib.world_size, dtype=torch.float32).repeat_interleave(x.numel())
    assert torch.equal(out, expected)


@pytest.mark.parametrize("thread", [True, False], ids=["thread", "no-thread"])
def test_progress_needs_the_thread(mpi: Any, thread: bool) -> None:
    # Rank 0 computes for 1.5 s without calling MPI; the others wait for a 4 MiB
    # gather. With the progress thread they finish long before rank 0 returns to MPI;
    # without it MPI makes no progress on rank 0 (MPI advances requests only inside
    # MPI calls) and they wait it out.
    backend = MPIBackend(timeout_s=30, progress_thread=thread)
    try:
        x = torch.full((1 << 20,), float(backend.rank))
        out = torch.empty(x.numel() * backend.world_size)
        backend.barrier().wait()
        start = time.monotonic()
        work = backend.all_gather(out, x)
        if backend.rank == 0:
            burn(1.5)
        work.wait()
        waited = mpi.COMM_WORLD.allgather(time.monotonic() - start)
    finally:
        backend.close()
    others = waited[1:]
    if thread:
        assert max(others) < 0.75, waited
    else:
        assert min(others) >= 1.2, waited


# -- failure ----------------------------------------------------------------------------


def test_timeout_names_the_collective(mpi: Any) -> None:
    backend = MPIBackend(timeout_s=1.0)
    try:
        t = torch.ones(16)
        error = None
        if backend.rank == 0:
            work = backend.all_reduce(t)
            try:
                work.wait()
            except CommTimeoutError as exc:
                error = str(exc)
        mpi.COMM_WORLD.Barrier()
        # Now the other ranks issue the matching collective: the request completes.
        if backend.rank != 0:
            work = backend.all_reduce(t)
        work.wait()
        first_error = mpi.COMM_WORLD.bcast(error, root=0)
    finally:
        backend.close()
    assert first_error is not None and "all_reduce" in first_error
    assert "rank 0" in first_error and "1 s" in first_error
    assert t.tolist() == [float(backend.world_size)] * 16


@pytest.mark.timeout(60)
def test_duplicate_has_its_own_collective_sequence():
    import torch

    from zero3.comm import MPIBackend

    first = MPIBackend(timeout_s=20)
    second = first.duplicate()
    try:
        assert (second.rank, second.world_size) == (first.rank, first.world_size)
        # Issue on the two in opposite orders on even and odd ranks: with one shared
        # sequence the pairs would cross; with two they cannot.
        a = torch.full((4,), float(first.rank))
        b = torch.full((2,), 10.0 + first.rank)
        out_a = torch.empty(4 * first.world_size)
        out_b = torch.empty(2 * first.world_size)
        if first.rank % 2:
            wb = second.all_gather(out_b, b)
            wa = first.all_gather(out_a, a)
        else:
            wa = first.all_gather(out_a, a)
            wb = second.all_gather(out_b, b)
        wa.wait()
        wb.wait()
        n = first.world_size
        assert out_a.tolist() == [float(r) for r in range(n) for _ in range(4)]
        assert out_b.tolist() == [10.0 + r for r in range(n) for _ in range(2)]
    finally:
        second.close()
        first.close()


@pytest.mark.timeout(60)
def test_in_place_all_gather_matches():
    import torch

    from zero3.comm import MPIBackend

    comm = MPIBackend(timeout_s=20)
    try:
        out = torch.zeros(3 * comm.world_size)
        mine = out.view(comm.world_size, -1)[comm.rank]
        mine.fill_(float(comm.rank + 1))
        comm.all_gather(out, mine).wait()
        assert out.tolist() == [float(r + 1) for r in range(comm.world_size) for _ in range(3)]
    finally:
        comm.close()
