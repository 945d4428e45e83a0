"""Multi-rank tests of zero3.comm's gloo backend, run in pooled worker groups."""

from __future__ import annotations

import os
import time

import pytest
import torch

from zero3.comm import CommError, GlooBackend, ReduceOp, UnsupportedDTypeError
from zero3.testing import RankExited

pytestmark = pytest.mark.multirank

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rank_values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers are exact in every dtype, so sums compare exactly.
    return (torch.arange(n, dtype=torch.float32) % 7 + rank * 3).to(dtype)


_VIA = {
    "default": {},
    "native": {"all_gather_via": "native", "reduce_scatter_via": "native"},
    "all_reduce": {"reduce_scatter_via": "all_reduce"},
}


def _all_collectives(dtype: torch.dtype, asynchronous: bool, via: str = "default") -> None:
    comm = GlooBackend(timeout_s=30, **_VIA[via])
    r, n = comm.rank, comm.world_size

    def done(work) -> None:
        if asynchronous:
            work.wait()
        else:
            work.wait()
            assert work.is_completed()

    # all_gather: rank order, uneven chunk length.
    x = _rank_values(r, 5, dtype)
    out = torch.empty(5 * n, dtype=dtype)
    done(comm.all_gather(out, x))
    expected = torch.cat([_rank_values(q, 5, dtype) for q in range(n)])
    assert torch.equal(out, expected)

    # reduce_scatter SUM / AVG / MAX / MIN, all in flight at once before any wait (the
    # exchange pairs each message with its own call), then in place (output = own chunk).
    full = [_rank_values(q, 4 * n, dtype) for q in range(n)]
    stacked = torch.stack(full).float()
    cases = (
        (ReduceOp.SUM, stacked.sum(0)),
        (ReduceOp.AVG, stacked.mean(0)),
        (ReduceOp.MAX, stacked.amax(0)),
        (ReduceOp.MIN, stacked.amin(0)),
    )
    results = [torch.empty(4, dtype=dtype) for _ in cases]
    works = [
        comm.reduce_scatter(res, full[r], op=op)
        for res, (op, _) in zip(results, cases, strict=True)
    ]
    for work, res, (op, ref) in zip(works, results, cases, strict=True):
        done(work)
        assert torch.equal(res, ref[4 * r : 4 * r + 4].to(dtype)), (op, res)
    own = full[r].clone()
    done(comm.reduce_scatter(own[4 * r : 4 * r + 4], own, op=ReduceOp.SUM))
    assert torch.equal(own[4 * r : 4 * r + 4], stacked.sum(0)[4 * r : 4 * r + 4].to(dtype))

    # all_reduce.
    t = _rank_values(r, 6, dtype)
    done(comm.all_reduce(t, op=ReduceOp.SUM))
    assert torch.equal(t, sum(_rank_values(q, 6, torch.float32) for q in range(n)).to(dtype))

    # broadcast from the last rank.
    b = _rank_values(r, 3, dtype)
    done(comm.broadcast(b, src=n - 1))
    assert torch.equal(b, _rank_values(n - 1, 3, dtype))

    # coalesced forms.
    ins = [_rank_values(r, 3, dtype), _rank_values(r, 2, dtype) * 2]
    outs = [torch.empty(3 * n, dtype=dtype), torch.empty(2 * n, dtype=dtype)]
    done(comm.all_gather_coalesced(outs, ins))
    assert torch.equal(outs[0], torch.cat([_rank_values(q, 3, dtype) for q in range(n)]))
    assert torch.equal(outs[1], torch.cat([_rank_values(q, 2, dtype) * 2 for q in range(n)]))

    rs_in = [_rank_values(r, 2 * n, dtype), _rank_values(r, 3 * n, dtype)]
    rs_out = [torch.empty(2, dtype=dtype), torch.empty(3, dtype=dtype)]
    done(comm.reduce_scatter_coalesced(rs_out, rs_in, op=ReduceOp.SUM))
    for k, size in enumerate((2, 3)):
        ref = sum(_rank_values(q, size * n, torch.float32) for q in range(n))
        assert torch.equal(rs_out[k], ref[size * r : size * (r + 1)].to(dtype))

    # non-contiguous input is made contiguous, never sent in memory order.
    nc = _rank_values(r, 8, dtype).view(2, 4).t()
    out_nc = torch.empty(8 * n, dtype=dtype)
    done(comm.all_gather(out_nc, nc))
    assert torch.equal(out_nc[8 * r : 8 * r + 8], nc.reshape(-1))

    done(comm.barrier())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("via", list(_VIA))
def test_every_collective(worker_pool, world_size, dtype, asynchronous, via):
    worker_pool(world_size).run(_all_collectives, dtype, asynchronous, via)


def _async_is_real() -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    late = comm.world_size - 1
    x = torch.full((1 << 16,), float(comm.rank))
    out = torch.empty(x.numel() * comm.world_size)
    if comm.rank == late:
        time.sleep(1.0)
        comm.all_gather(out, x).wait()
        return {"late": True}
    start = time.monotonic()
    work = comm.all_gather(out, x)
    returned_after = time.monotonic() - start
    seen_incomplete = not work.is_completed()
    busy = 0
    while not work.is_completed():  # the caller keeps computing meanwhile
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        busy += 1
        if time.monotonic() - start > 20:
            break
    work.wait()
    assert torch.equal(out.view(comm.world_size, -1)[:, 0], torch.arange(comm.world_size).float())
    return {
        "late": False,
        "returned_after": returned_after,
        "seen_incomplete": seen_incomplete,
        "busy": busy,
    }


def test_async_collective_overlaps_a_late_peer(worker_pool):
    results = worker_pool(2).run(_async_is_real)
    early = results[0]
    assert early["late"] is False
    assert early["returned_after"] < 0.5  # issuing did not block on the late peer
    assert early["seen_incomplete"]
    assert early["busy"] > 0


def _unsupported_dtype() -> str:
    comm = GlooBackend(timeout_s=10)
    t = torch.ones(4, dtype=torch.bool)
    with pytest.raises(UnsupportedDTypeError) as info:
        comm.all_reduce(t)
    return str(info.value)


def test_unsupported_dtype_is_refused_before_any_collective(worker_pool):
    messages = worker_pool(2).run(_unsupported_dtype)
    assert "cannot reduce torch.bool" in messages[0]
    assert "reduce_dtype" in messages[0]


def _peer_dies() -> dict[str, object]:
    comm = GlooBackend(timeout_s=20)
    if comm.rank == 1:
        time.sleep(0.3)
        os._exit(3)  # dies while rank 0 waits in the collective
    out = torch.empty(2 * 1024)
    start = time.monotonic()
    try:
        comm.all_gather(out, torch.ones(1024)).wait()
    except CommError as exc:
        return {"elapsed": time.monotonic() - start, "message": str(exc)}
    return {"elapsed": time.monotonic() - start, "message": "no error"}


def test_dead_peer_raises_within_seconds_naming_the_collective(worker_pool):
    results = worker_pool(2).run(_peer_dies, allow_rank_exit=True)
    assert isinstance(results[1], RankExited)
    survivor = results[0]
    assert "all_gather" in survivor["message"], survivor
    assert survivor["elapsed"] < 10, survivor


def _stuck_peer() -> dict[str, object]:
    comm = GlooBackend(timeout_s=2)
    if comm.rank == 1:
        return {"skipped": True}  # never joins
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(8)).wait()
    except CommError as exc:
        return {
            "elapsed": time.monotonic() - start,
            "message": str(exc),
            "type": type(exc).__name__,
        }
    return {"message": "no error"}


def test_peer_that_never_joins_times_out_naming_the_collective(worker_pool):
    results = worker_pool(2).run(_stuck_peer, timeout=60)
    assert results[0]["type"] == "CommTimeoutError", results[0]
    assert "all_reduce" in results[0]["message"]
    assert results[0]["elapsed"] < 15


def _rank1_fails() -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("deliberate failure on rank 1")
    return 0


def _hangs() -> None:
    if int(os.environ["RANK"]) == 0:
        time.sleep(600)


def _sum_ranks() -> float:
    comm = GlooBackend(timeout_s=10)
    t = torch.tensor([float(comm.rank)])
    comm.all_reduce(t).wait()
    return float(t)


def test_harness_reports_failing_rank_and_recovers_from_a_hang(worker_pool):
    from zero3.testing import CaseError

    group = worker_pool(2)
    with pytest.raises(CaseError) as info:
        group.run(_rank1_fails)
    assert "rank 1 raised" in str(info.value)
    assert "deliberate failure on rank 1" in str(info.value)
    with pytest.raises(CaseError) as info:
        group.run(_hangs, timeout=3)
    assert "timed out" in str(info.value)
    assert "_hangs" in str(info.value)  # the hung rank's stack is in the report
    assert worker_pool(2).run(_sum_ranks) == [1.0, 1.0]


def _in_place_all_gather(native: bool) -> list[float]:
    comm = GlooBackend(timeout_s=20, all_gather_via="native" if native else "broadcast")
    out = torch.zeros(3 * comm.world_size)
    mine = out.view(comm.world_size, -1)[comm.rank]
    mine.fill_(float(comm.rank + 1))
    comm.all_gather(out, mine).wait()
    return out.tolist()


@pytest.mark.parametrize("native", [False, True], ids=["broadcast", "native"])
def test_in_place_all_gather(worker_pool, native):
    for result in worker_pool(2).run(_in_place_all_gather, native):
        assert result == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]


def _duplicates_in_a_row(subgroup: bool) -> list[float]:
    """Create, use and close duplicates again and again, rank 0 always arriving late.

    A late rank 0 is the case that broke CI: a re-created group took its store keys from
    the group closed before it and the peer dialled a listener that no longer existed.
    """
    import torch.distributed as dist

    world = GlooBackend(timeout_s=20)
    members = [0, 1] if subgroup else list(range(world.world_size))
    # new_group without local synchronization is collective over the whole world.
    group = dist.new_group(members) if subgroup else None
    sums: list[float] = []
    if world.rank not in members:
        return sums
    parent = GlooBackend(group=group, timeout_s=20) if subgroup else world
    for round_ in range(4):
        if parent.rank == 0 and round_ > 0:
            time.sleep(0.5)
        twin = parent.duplicate()
        t = torch.tensor([float(twin.rank + round_)])
        twin.all_reduce(t).wait()
        sums.append(float(t))
        twin.close()
    return sums


@pytest.mark.parametrize(("world_size", "subgroup"), [(2, False), (4, True)])
def test_duplicates_can_be_recreated_after_close(worker_pool, world_size, subgroup):
    results = worker_pool(world_size).run(_duplicates_in_a_row, subgroup, timeout=90)
    for rank, sums in enumerate(results):
        if subgroup and rank >= 2:
            assert sums == []
        else:
            assert sums == [1.0, 3.0, 5.0, 7.0], (rank, sums)
