"""Overlap chunks on real ranks: big buckets and prefetches leave as several collectives.

``reduce_bucket_size`` and ``prefetch_bucket_size`` stay the upper bounds; with
``overlap_comm`` a bucket is planned in chunks of ``overlap_chunk_size`` elements and a
prefetch is cut into gathers of that size at module boundaries (core/_reducer.py and
``cut_at_modules`` in core/params/_gather.py, Notes "overlap chunks"). The results must not
change.
"""

from __future__ import annotations

import copy

import pytest

from zero3.comm import GlooBackend
from zero3.core import Zero3Config, full_grad
from zero3.core.engine import sharded_state
from zero3.hooks import shard_module, stats
from zero3.testing.models import build, loss_of

pytestmark = pytest.mark.multirank

LOCAL = 2


def _chunked_step(chunk: int, overlap: bool) -> dict[str, object]:
    """Two steps of TinyGPT with DeepSpeed's huge buckets and the given chunk size."""
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    reference = copy.deepcopy(model)
    config = Zero3Config(
        param_persistence_threshold=0,
        reduce_bucket_size=500_000_000,
        prefetch_bucket_size=50_000_000,
        overlap_comm=overlap,
        overlap_chunk_size=chunk,
    )
    shard_module(model, config, comm=comm)
    state = sharded_state(model)
    worst = 0.0
    headers = 0
    for step in range(2):  # step 0 records the trace, step 1 prefetches from it
        headers = state.guard.exchanges
        x = make(LOCAL * n, step)
        out = model(x[r * LOCAL : (r + 1) * LOCAL])
        loss_of(out).backward()
        headers = state.guard.exchanges - headers  # the step's (full_grad's come after)
        loss_of(reference(x)).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            if q.grad is not None:
                worst = max(worst, (full_grad(p) - q.grad).abs().max().item())
        model.zero_grad()  # a new window: gradients are rewritten, not added
        reference.zero_grad()
    s = stats(model)
    # Padded elements per bucket: at most the chunk unless the bucket is one parameter.
    sizes = [
        (sum(sp.padded_numel for sp in b.params), len(b.params)) for b in state.reducer.buckets
    ]
    return {
        "worst": worst,
        "buckets": len(state.reducer.buckets),
        "oversized": [size for size, members in sizes if size > chunk and members > 1],
        "reductions": s.reduce_collectives,
        "prefetch_gathers": s.prefetch_gathers,
        "forward_gathers": s.forward_gathers,
        "hit_rate": s.prefetch_hit_rate,
        "misses": s.prefetch_misses,
        "headers": headers,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_chunks_split_buckets_and_prefetches_without_changing_gradients(worker_pool, world_size):
    group = worker_pool(world_size)
    whole = group.run(_chunked_step, 4_194_304, True)  # TinyGPT fits in one chunk
    chunked = group.run(_chunked_step, 600, True)
    serial = group.run(_chunked_step, 600, False)  # no overlap: DeepSpeed's launch units
    for results in (whole, chunked, serial):
        for result in results:
            assert result["worst"] < 1e-5, result
            assert result["reductions"] == result["buckets"], result  # one each, every step
            assert result["misses"] == 0, result
    w, c, s = whole[0], chunked[0], serial[0]
    assert w["buckets"] == 1 and s["buckets"] == 1
    assert c["buckets"] > 2 and not c["oversized"], c
    # One prefetch decision (the whole model fits prefetch_bucket_size) leaves as one
    # gather whole, as several cut at module boundaries chunked.
    assert w["prefetch_gathers"] == 1 and s["prefetch_gathers"] == 1, (w, s)
    assert c["prefetch_gathers"] > 2, c
    assert c["hit_rate"] == 1.0, c
    # One header per prefetch, not per gather: the chunks of a prefetch are announced
    # together, so the ranks meet once per prefetch decision (and once per fetch or
    # step-end exchange), never at every cut.
    assert c["headers"] < c["prefetch_gathers"], c
