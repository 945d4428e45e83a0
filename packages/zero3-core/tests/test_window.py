"""The gather window's rule (GatherWindow, resolve_window) and the buffer pool's accounting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero3.core import Zero3Config, estimate_model_states
from zero3.core.config._window import FLOOR_NUMEL, MAX_CHUNK_NUMEL, resolve_window
from zero3.core.engine import BufferPool, ShardedModelState
from zero3.testing.recording import RecordingBackend

U = 3 * FLOOR_NUMEL  # a fetch unit above the floor


def _resolve(config: Zero3Config, units=(U, U // 2), sharded=20 * U, world=4):
    return resolve_window(
        config, units, sharded_numel=sharded, element_size=4, world_size=world,
        shard_bytes=2 * 4 * sharded // world,
    )  # fmt: skip


def test_auto_window_follows_the_largest_fetch_unit():
    w = _resolve(Zero3Config())
    assert (w.prefetch_numel, w.live_numel, w.reuse_numel) == (U, 2 * U, U)
    assert w.chunk_numel == min(MAX_CHUNK_NUMEL, U // 4)
    assert w.unit_numel == U
    assert w.auto == {"prefetch_numel", "live_numel", "reuse_numel", "chunk_numel"}
    assert w.bound_numel == 2 * U + U + 2 * U < 20 * U  # a bounded part of the model
    assert w.pool_bytes == 2 * 4 * U + 4 * U // 4 + (1 << 20)  # two receive, one send
    assert "max_reuse_distance=" in w.describe() and "(auto)" in w.describe()


def test_explicit_values_win_and_the_rest_stays_auto():
    w = _resolve(Zero3Config(max_reuse_distance=0, prefetch_bucket_size=7, overlap_chunk_size=9))
    assert (w.prefetch_numel, w.reuse_numel, w.chunk_numel) == (7, 0, 9)
    assert w.live_numel == 2 * U  # never below two units, whatever the prefetch
    assert w.auto == {"live_numel"}
    absolute = _resolve(Zero3Config(max_live_parameters=10**9, max_reuse_distance=10**9))
    assert absolute.live_numel == 10**9 and absolute.reuse_numel == 10**9
    assert absolute.bound_numel == 20 * U  # DeepSpeed's values: the whole model


def test_small_models_keep_the_floor_and_the_caps():
    tiny = _resolve(Zero3Config(), units=(1000,), sharded=5000)
    assert tiny.prefetch_numel == tiny.live_numel == 5000  # capped at the model
    assert tiny.reuse_numel == FLOOR_NUMEL  # a trace distance: kept whole into backward
    assert tiny.bound_numel == 5000
    floored = _resolve(Zero3Config(), units=(1000,), sharded=10 * FLOOR_NUMEL)
    assert floored.prefetch_numel == floored.reuse_numel == FLOOR_NUMEL
    assert floored.chunk_numel == FLOOR_NUMEL // 4


def test_pool_bound_never_exceeds_the_shards():
    w = _resolve(Zero3Config(), units=(U,), sharded=U, world=2)
    assert w.pool_bytes == w.shard_bytes == 2 * 4 * U // 2


def test_deepspeed_config_without_window_keys_gets_the_auto_window():
    c = Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3}})
    assert c.prefetch_bucket_size is None and c.max_live_parameters is None
    assert c.max_reuse_distance is None and c.overlap_chunk_size is None
    auto = Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3,
                                       "stage3_max_reuse_distance": "auto"}})  # fmt: skip
    assert auto.max_reuse_distance is None
    given = Zero3Config.from_deepspeed(
        {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 123}}
    )
    assert given.max_reuse_distance == 123


def _stack(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def test_the_sharded_model_and_the_estimate_resolve_the_same_window():
    model = _stack(1100, 6)  # units of 1,211,100 elements: above the floor
    with torch.device("meta"):
        meta = _stack(1100, 6)
    config = Zero3Config(param_persistence_threshold=0)
    state = ShardedModelState.create(model, config, RecordingBackend(world_size=4, rank=1))
    estimate = estimate_model_states(meta, 4, config=config)
    assert state.window.unit_numel == 1100 * 1100 + 1100
    assert estimate.window == state.window
    assert estimate.window_bytes == state.window.bound_bytes < 6 * 1100 * 1101 * 4
    assert estimate.pool_bytes == state.window.pool_bytes
    assert estimate.peak_bytes == estimate.per_rank_bytes + estimate.transient_bytes
    assert state.pool.limit_bytes == state.window.pool_bytes
    assert state.reducer.chunk_numel == state.window.chunk_numel


def test_pool_counts_what_it_lends_and_caches():
    pool = BufferPool(limit_bytes=1 << 20)
    cpu = torch.device("cpu")
    a = pool.take(1000, cpu)
    b = pool.take(3000, cpu, kind="bucket")
    s = pool.take_storage(2000, cpu)
    assert pool.in_use_bytes == 6000 and pool.peak_bytes == 6000
    assert pool.peak_kind_bytes == {"gather": 1000, "bucket": 3000, "param": 2000}
    pool.give(a)
    pool.give_storage(s)
    assert pool.in_use_bytes == 3000 and pool.cached_bytes == 3000
    again = pool.take(900, cpu)  # best fit: the 1000-byte buffer comes back
    assert pool.cached_bytes == 2000 and pool.in_use_bytes == 4000
    pool.give(again)
    pool.give(b)
    assert pool.in_use_bytes == 0 and pool.cached_bytes == 6000
    assert pool.peak_cached_bytes == 6000 and pool.peak_bytes == 6000
    pool.clear()
    assert pool.cached_bytes == 0
    pool.reset_peaks()
    assert pool.peak_bytes == 0 and pool.peak_kind_bytes == {"gather": 0, "bucket": 0, "param": 0}


@pytest.mark.parametrize("limit", [0, 2500])
def test_pool_limit_bounds_the_cache(limit):
    pool = BufferPool(limit_bytes=limit)
    cpu = torch.device("cpu")
    bufs = [pool.take(1000, cpu) for _ in range(4)]
    for buf in bufs:
        pool.give(buf)
    assert pool.cached_bytes <= limit and pool.in_use_bytes == 0
