"""Optimizer offload (cpu, nvme) trains exactly as in-memory zero3, at world 1 to 4.

Each case trains two sharded copies of one model side by side in every worker: one with
its optimizer state in memory, one offloaded, and compares their master shards and
parameter shards bit for bit after every step. Swap I/O is asserted to have happened
(bytes read and written, some of the reads started during the backward) and the swap
files' pages not to be in the page cache.
"""

from __future__ import annotations

import copy
import os
import platform
import re
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from zero3.comm import GlooBackend
from zero3.core import Zero3Config, local_grad
from zero3.core.engine import resident_pages
from zero3.hooks import memory_stats, shard_module, stats
from zero3.optim import OffloadError, PartitionedOptimizer
from zero3.testing.models import OPTIMIZERS, build, loss_of

pytestmark = pytest.mark.multirank

LOCAL = 2
STEPS = 3

# (optimizer, param_dtype, device, accumulate, clip, overflow at step)
CASES: dict[str, tuple[str, str | None, str, int, float | None, int | None]] = {
    "adamw-fp32-nvme": ("adamw", None, "nvme", 1, None, None),
    "adagrad-bf16-nvme": ("adagrad", "bf16", "nvme", 1, None, None),
    "sgd-accumulate-clip-nvme": ("sgd-momentum", None, "nvme", 2, 0.05, None),
    "adamw-fp16-overflow-nvme": ("adamw", "fp16", "nvme", 1, None, 1),
    "adamw-bf16-cpu": ("adamw", "bf16", "cpu", 1, 0.05, None),
}


def _pair(case: str, root: str) -> dict[str, Any]:
    """Train in-memory and offloaded copies side by side; compare after every step."""
    name, dtype, device, accumulate, clip, overflow_at = CASES[case]
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    twin = copy.deepcopy(model)
    base = dict(param_persistence_threshold=0, gradient_clipping=clip, param_dtype=dtype,
                initial_scale_power=8)  # fmt: skip
    shard_module(model, Zero3Config(**base), comm=comm)
    offload = {"device": device, "nvme_path": root, "buffer_count": 2}
    shard_module(
        twin, Zero3Config(**base, sub_group_size=700, offload_optimizer=offload), comm=comm
    )
    cls, kwargs = OPTIMIZERS[name]
    opts = [PartitionedOptimizer(m, cls, **kwargs) for m in (model, twin)]
    store = opts[1].offload
    assert store is not None
    diffs, written, read, ahead = [], [], 0, 0
    for step in range(STEPS):
        for m, opt in zip((model, twin), opts, strict=True):
            for micro in range(accumulate):
                x = make(LOCAL * n, step * 10 + micro)
                opt.scale_loss(loss_of(m(x[r * LOCAL : (r + 1) * LOCAL])) / accumulate).backward()
            if step == overflow_at and r == 0:
                local_grad(next(iter(m.parameters())))[0] = float("inf")
            opt.step()
            opt.zero_grad()
        written.append(store.stats.written_bytes)
        read += store.stats.read_bytes
        ahead += store.stats.read_ahead_bytes
        shards = [
            int((pa.detach().float() != pb.detach().float()).sum())
            for pa, pb in zip(
                (s.shard for s in _sparams(model)), (s.shard for s in _sparams(twin)), strict=True
            )
        ]
        diffs.append(sum(shards))
    # What memory_stats says of each copy (before anything is read back).
    inside, outside = memory_stats(model, opts[0]), memory_stats(twin, opts[1])
    memory = {
        "in memory": inside.master_bytes + inside.optimizer_bytes,
        "nvme": outside.nvme_bytes,
        "left in memory": outside.master_bytes + outside.optimizer_bytes,
        "unsharded": (inside.unsharded_bytes, outside.unsharded_bytes),
    }
    # Reading the masters brings them back from disk: once, at the end.
    masters = [int((a != b).sum()) for a, b in
               zip(opts[0].master_shards(), opts[1].master_shards(), strict=True)]  # fmt: skip
    diffs.append(sum(masters))
    files = store.files
    resident = sum(resident_pages(f)[0] for f in files)
    direct = store.direct_io
    result = {
        "diffs": diffs,
        "written": written,
        "read": read,
        "ahead": ahead,
        "files": len(files),
        "resident": resident,
        "direct": direct,
        "gathers": stats(twin).gathers,
        "reductions": stats(twin).reduce_collectives,
        "subgroups": len(opts[1]._subgroups),
        "memory": memory,
    }
    directory = store.directory
    store.close()
    result["cleaned"] = directory is None or not directory.exists()
    return result


def _sparams(model: torch.nn.Module) -> list[Any]:
    from zero3.core.engine import sharded_state

    return list(sharded_state(model).params)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_offloaded_training_equals_in_memory(worker_pool, world_size, tmp_path):
    group = worker_pool(world_size)
    for case in CASES:
        root = tmp_path / case
        results = group.run(_pair, case, str(root))
        for rank, res in enumerate(results):
            assert res["diffs"] == [0] * (STEPS + 1), (case, rank, res)
            if world_size > 1:
                assert res["gathers"] > 0 and res["reductions"] > 0, (case, res)
            assert res["subgroups"] > 1, res  # several sub-groups: the walk pipelines
            assert res["cleaned"], (case, res)  # close() removes this rank's files
            if CASES[case][2] == "nvme":
                assert res["files"] >= 1 and res["read"] > 0, (case, res)
                # The first records' reads started in the backward (the walk took them).
                assert 0 < res["ahead"] < res["read"], (case, res)
                assert res["direct"] and res["resident"] == 0, (case, res)
                # memory_stats counts the state in the swap files, not in memory (the
                # scalars, like Adam's step counts, stay), and the same unsharded total.
                mem = res["memory"]
                assert 0.95 * mem["in memory"] <= mem["nvme"] <= mem["in memory"], mem
                assert mem["left in memory"] <= 0.05 * mem["in memory"], mem
                assert mem["unsharded"][0] == mem["unsharded"][1], mem
            else:
                assert res["files"] == 0 and res["memory"]["nvme"] == 0, (case, res)
            overflow_at = CASES[case][5]
            if overflow_at is not None:
                # The overflow step wrote nothing back (and both copies stay equal).
                assert res["written"][overflow_at] == 0, res
                assert all(w > 0 for i, w in enumerate(res["written"]) if i != overflow_at)
        assert not any(root.glob("zero3-*")), case


def _fault(kind: str, root: str) -> str:
    """Break the last rank's optimizer offload after a good step (its first swap file
    ``"truncated"`` or ``"removed"``, ``"no-memory"`` for record buffers, or
    ``"torch-oom"``: the wrapped optimizer's step raises what torch raises when host
    memory runs out); return the error of the next step.
    """
    from zero3.optim import _offload

    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    offload = {"device": "nvme", "nvme_path": root}
    config = Zero3Config(param_persistence_threshold=0, sub_group_size=700,
                         offload_optimizer=offload)  # fmt: skip
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    store = opt.offload
    assert store is not None
    real = _offload.AlignedBuffer

    def exhausted(nbytes: int, *, pin: bool = False) -> Any:
        raise MemoryError(f"no room for a {nbytes}-byte record buffer (test)")

    def torch_out_of_memory(*args: Any, **kwargs: Any) -> Any:
        # torch's CPU allocator raises a plain RuntimeError, not MemoryError
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory (test)")

    try:
        for step in range(2):
            if step == 1 and r == n - 1:
                victim = store.files[0]
                if kind == "truncated":
                    os.truncate(victim, 4096)
                elif kind == "removed":
                    victim.unlink()
                elif kind == "torch-oom":
                    opt.optimizer.step = torch_out_of_memory  # type: ignore[method-assign]
                else:
                    _offload.AlignedBuffer = exhausted  # type: ignore[misc]
            x = make(LOCAL * n, step)
            try:
                loss_of(model(x[r * LOCAL : (r + 1) * LOCAL])).backward()
                opt.step()
            except OffloadError as exc:
                return str(exc)
            finally:
                _offload.AlignedBuffer = real  # type: ignore[misc]
            opt.zero_grad()
    finally:
        store.close()
    return "no error"


@pytest.mark.parametrize("kind", ["truncated", "removed"])
def test_a_broken_swap_file_on_one_rank_fails_every_rank_alike(worker_pool, kind, tmp_path):
    results = worker_pool(2).run(_fault, kind, str(tmp_path))
    assert results[0] == results[1], results  # the same error on the rank whose file is fine
    assert "optimizer offload failed on rank 1" in results[0]
    word = "is truncated" if kind == "truncated" else "is gone"
    assert word in results[0] and "subgroup00000.swp" in results[0], results


def test_the_wrapped_optimizer_failing_on_one_rank_fails_every_rank_alike(worker_pool, tmp_path):
    """A failure of the walk that is not I/O (torch out of host memory inside the
    wrapped optimizer's step) is agreed too: the other rank does not wait for it."""
    results = worker_pool(2).run(_fault, "torch-oom", str(tmp_path))
    assert results[0] == results[1], results
    assert "optimizer offload failed on rank 1" in results[0]
    assert "RuntimeError while stepping offloaded sub-groups" in results[0], results
    assert "can't allocate memory" in results[0], results


def _in_flight(root: str, shape: str) -> dict[str, int]:
    """What the walk (and the backward's read-ahead) held at once, against its budget.
    ``"large"``: two records far larger than a sub-group (an embedding and a head) among
    small ones; ``"mixed"``: every record within a sub-group, most about 0.6 of a full
    one, so reads queued while the bytes in flight were below the budget overshot it.
    """
    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(0)
    if shape == "large":
        model = torch.nn.Sequential(
            torch.nn.Embedding(2048, 64),
            *[torch.nn.Linear(64, 64) for _ in range(6)],
            torch.nn.Linear(64, 2048),
        )
    else:  # sub-groups of 5,200 or 5,184 elements, and one full (8,192) at the end
        pairs = [(torch.nn.Linear(64, 80), torch.nn.Linear(80, 64)) for _ in range(4)]
        model = torch.nn.Sequential(
            torch.nn.Embedding(64, 64), *[m for pair in pairs for m in pair],
            torch.nn.Linear(64, 128),
        )  # fmt: skip
    offload = {"device": "nvme", "nvme_path": root, "buffer_count": 4}
    config = Zero3Config(param_persistence_threshold=0, sub_group_size=8192,
                         offload_optimizer=offload)  # fmt: skip
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    store = opt.offload
    assert store is not None
    peaks, ahead = [], []
    for step in range(3):
        tokens = torch.randint(0, 2048, (4, 8), generator=torch.Generator().manual_seed(step))
        tokens = tokens % model[0].num_embeddings
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        peaks.append(store.stats.peak_in_flight_bytes)
        ahead.append(store.stats.read_ahead_bytes)
    records = sorted(slot.nbytes for slot in store.slots())
    result = {"peak": max(peaks[1:]), "budget": store.budget_bytes(), "ahead": max(ahead),
              "largest": records[-1], "count": store.config.buffer_count}  # fmt: skip
    store.close()
    return result


def test_the_walk_holds_a_byte_budget_not_a_count_of_records(worker_pool, tmp_path):
    """buffer_count counts sub-groups' worth of bytes: a record larger than a sub-group
    (an embedding, a head) takes the room of several, so the walk never holds
    buffer_count of the largest records at once (in a world of one, that was as much as
    the state offload moved out)."""
    res = worker_pool(1).run(_in_flight, str(tmp_path), "large")[0]
    # Two moments of fp32 per element: a full sub-group's record is 8192 * 8 bytes
    # (and the pages the largest record's segments are aligned to).
    assert 4 * 8192 * 8 <= res["budget"] < 4 * 8192 * 8 * 1.1, res
    assert res["largest"] > 2 * res["budget"] // 4, res  # the head: 133,120 elements
    assert res["peak"] <= res["budget"] + res["largest"], res
    assert res["peak"] < 2 * res["largest"], res  # never both large records at once


def test_the_walk_and_the_read_ahead_stay_within_the_budget(worker_pool, tmp_path):
    """Records within a sub-group never take the walk over its byte budget, nor the
    backward's read-ahead over half of it (a read is queued only where it fits, not
    while the total is below the budget, which let one more record overshoot it)."""
    res = worker_pool(1).run(_in_flight, str(tmp_path), "mixed")[0]
    assert res["largest"] <= res["budget"] // 4, res  # every record within a sub-group
    assert res["budget"] - res["largest"] < res["peak"] <= res["budget"], res
    # The backward reads ahead half the budget: it holds those buffers at its end.
    assert res["budget"] // 2 - res["largest"] < res["ahead"] <= res["budget"] // 2, res


def test_no_host_memory_for_a_record_on_one_rank_fails_every_rank_alike(worker_pool, tmp_path):
    """Out of memory while swapping is agreed like an I/O error: the rank with room
    does not step on alone or wait in the next collective."""
    results = worker_pool(2).run(_fault, "no-memory", str(tmp_path))
    assert results[0] == results[1], results
    assert "optimizer offload failed on rank 1" in results[0]
    assert "no room for a" in results[0], results


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _heap_freed(root: str, trim: bool | None, when: str) -> dict[str, float]:
    """Resident MiB handed back while 128 MiB of freed blocks sit on the heap (as a
    backward's activations do under glibc's default allocator): by the optimizer step
    (``when="step"``: freed after the backward), or by the backward itself (``"backward"``:
    freed after the forward, measured when the backward returns).
    """
    comm = GlooBackend(timeout_s=30)
    model, make = build("gpt_tied")
    offload = {"device": "nvme", "nvme_path": root}
    config = Zero3Config(param_persistence_threshold=0, offload_optimizer=offload,
                         trim_host_heap=trim)  # fmt: skip
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    x = make(LOCAL, 0)
    loss = loss_of(model(x))
    if when == "step":
        loss.backward()
    # 128 MiB of 64 KiB blocks, each followed by a small block kept, then freed: below
    # glibc's smallest mmap threshold (128 KiB), so they come from the heap whatever
    # this worker ran before, and the kept blocks pin their pages there.
    kept, blocks = [], []
    for _ in range(2048):
        blocks.append(torch.ones(16 * 1024))
        kept.append(torch.ones(1024))
    del blocks
    before = _rss_mib()
    if when == "step":
        opt.step()
    else:
        loss.backward()
    return {"freed": before - _rss_mib(), "trims": float(config.trims_host_heap)}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
@pytest.mark.parametrize("when", ["step", "backward"])
@pytest.mark.parametrize("trim", [None, False])
def test_an_nvme_offloaded_step_hands_the_freed_heap_back(worker_pool, trim, when, tmp_path):
    """With nvme offload the step ends by trimming the heap (auto), and the backward
    trims it when half done (the forward's activations it freed), so what the state
    moved out is not refilled by heap glibc kept; ``trim_host_heap=False`` keeps it.
    """
    ((result),) = worker_pool(1).run(_heap_freed, str(tmp_path), trim, when)
    if trim is None:
        assert result["trims"] and result["freed"] > 100, result
    else:
        assert not result["trims"] and result["freed"] < 20, result


def _bad_path(root: str) -> str:
    comm = GlooBackend(timeout_s=30)
    model, _ = build("gpt_tied")
    if comm.rank == 1:
        # A file stands where rank 1's own swap directory must go (its name holds the
        # host, process id and rank), so only rank 1 cannot create it.
        host = socket.gethostname().replace("-", "_")
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / f"zero3-optim-{host}-{os.getpid()}-rank1").write_text("in the way")
    offload = {"device": "nvme", "nvme_path": root}
    shard_module(model, Zero3Config(param_persistence_threshold=0,
                                    offload_optimizer=offload), comm=comm)  # fmt: skip
    try:
        PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    except OffloadError as exc:
        return str(exc)
    return "no error"


def test_an_unusable_nvme_path_on_one_rank_fails_every_rank(worker_pool, tmp_path):
    results = worker_pool(2).run(_bad_path, str(tmp_path))
    assert results[0] == results[1], results
    assert "optimizer offload failed on rank 1" in results[0]
    assert "cannot create the swap directory" in results[0], results


def _too_little_space(mount: str) -> str:
    model, _ = build("gpt_tied")
    offload = {"device": "nvme", "nvme_path": mount}
    shard_module(model, Zero3Config(backend="gloo", offload_optimizer=offload))
    try:
        PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    except OffloadError as exc:
        return str(exc)
    return "no error"


def test_too_little_free_space_is_refused_up_front_naming_path_and_bytes(worker_pool):
    mount = Path(tempfile.mkdtemp(prefix="zero3-small-"))
    if os.system(f"mount -t tmpfs -o size=64k tmpfs {mount} 2>/dev/null") != 0:
        os.rmdir(mount)
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        # In a worker: shard_module would leave this process a torch.distributed world.
        (message,) = worker_pool(1).run(_too_little_space, str(mount))
        assert re.search(r"not enough free space .* bytes needed", message), message
    finally:
        os.system(f"umount {mount}")
        os.rmdir(mount)
