"""Parameter offload (``offload_param: nvme``) trains exactly as in-memory zero3.

Each case trains two sharded copies of one model side by side in every worker: one in
memory, one with its parameter shards in a swap file (and, in the "both" cases, its
optimizer state too), and compares the parameter shards bit for bit after every step.
The swap file is asserted to have been read (most of it ahead of the gathers) and
written, its pages not to be in the page cache, and memory_stats to count the shards
there rather than in memory.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from zero3.comm import GlooBackend
from zero3.core import CheckpointError, ParamOffloadError, Zero3Config, local_grad
from zero3.core.engine import resident_pages, sharded_state
from zero3.hooks import full_state_dict, memory_stats, shard_module, stats
from zero3.optim import PartitionedOptimizer, load_checkpoint, save_checkpoint
from zero3.testing import run_in_session
from zero3.testing.models import OPTIMIZERS, build, loss_of, step_past_a_broken_swap

pytestmark = pytest.mark.multirank

LOCAL = 2
STEPS = 3

# (optimizer, param_dtype, optimizer offload too, accumulate, clip, overflow at step)
CASES: dict[str, tuple[str, str | None, bool, int, float | None, int | None]] = {
    "adamw-fp32": ("adamw", None, False, 1, None, None),
    "adamw-fp32-both": ("adamw", None, True, 1, None, None),
    "adagrad-bf16-both": ("adagrad", "bf16", True, 1, None, None),
    "sgd-accumulate-clip": ("sgd-momentum", None, False, 2, 0.05, None),
    "adamw-fp16-overflow-both": ("adamw", "fp16", True, 1, None, 1),
}


def _offload_config(root: str, both: bool, **base: Any) -> Zero3Config:
    param = {"device": "nvme", "nvme_path": root, "buffer_count": 3, "max_in_cpu": 0}
    extra: dict[str, Any] = {"offload_param": param}
    if both:
        extra["offload_optimizer"] = {"device": "nvme", "nvme_path": root, "buffer_count": 2}
        extra["sub_group_size"] = 700
    return Zero3Config(**base, **extra)


def _pair(case: str, root: str) -> dict[str, Any]:
    """Train in-memory and offloaded copies side by side; compare after every step."""
    name, dtype, both, accumulate, clip, overflow_at = CASES[case]
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    twin = copy.deepcopy(model)
    # A prefetch window a fraction of the model (as on a model too big for memory), so
    # the gathers and the reads ahead of them move through it.
    base = dict(param_persistence_threshold=0, gradient_clipping=clip, param_dtype=dtype,
                initial_scale_power=8, prefetch_bucket_size=2000)  # fmt: skip
    shard_module(model, Zero3Config(**base), comm=comm)
    shard_module(twin, _offload_config(root, both, **base), comm=comm)
    swap = sharded_state(twin).param_swap
    cls, kwargs = OPTIMIZERS[name]
    opts = [PartitionedOptimizer(m, cls, **kwargs) for m in (model, twin)]
    diffs, losses = [], []
    read = ahead = 0  # of the gathers from the second step on (the first has no trace)
    for step in range(STEPS):
        before = (swap.stats.read_bytes, swap.stats.read_ahead_bytes) if swap else (0, 0)
        for m, opt in zip((model, twin), opts, strict=True):
            for micro in range(accumulate):
                x = make(LOCAL * n, step * 10 + micro)
                loss = loss_of(m(x[r * LOCAL : (r + 1) * LOCAL])) / accumulate
                opt.scale_loss(loss).backward()
                losses.append(float(loss))
            if step == overflow_at and r == 0:
                local_grad(next(iter(m.parameters())))[0] = float("inf")
            opt.step()
            opt.zero_grad()
        if swap is not None and step > 0:
            read += swap.stats.read_bytes - before[0]
            ahead += swap.stats.read_ahead_bytes - before[1]
        pairs = zip(sharded_state(model).params, sharded_state(twin).params, strict=True)
        diffs.append(sum(int((a.shard != b.shard).sum()) for a, b in pairs))
        for sp in sharded_state(twin).params:  # comparing read them back: let them go
            if sp.home is not None:
                sp.home.drop(sp)
    result: dict[str, Any] = {"diffs": diffs, "losses": losses, "swap": swap is not None}
    if swap is None:
        for opt in opts:
            if opt.offload is not None:
                opt.offload.close()
        return result
    # What memory_stats says (before anything more is read back).
    inside, outside = memory_stats(model, opts[0]), memory_stats(twin, opts[1])
    result.update(
        shard_bytes=sum(sp.shard_numel * sp.itemsize for sp in sharded_state(model).params),
        nvme_param=outside.nvme_param_bytes,
        param_in_memory=outside.param_bytes,
        unsharded=(inside.unsharded_bytes, outside.unsharded_bytes),
        read=read,
        ahead=ahead,
        written=swap.stats.written_bytes,
        resident=resident_pages(swap.path)[0],
        direct=swap.direct_io,
        gathers=stats(twin).gathers,
        reductions=stats(twin).reduce_collectives,
        fingerprint=stats(twin).gather_fingerprint_bytes,
        receive_buffers=sharded_state(twin).pool.peak_kind_bytes.get("gather", 0),
    )
    directory = swap.path.parent
    for opt in opts:
        if opt.offload is not None:
            opt.offload.close()
    swap.close()
    result["cleaned"] = not directory.exists()
    return result


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_param_offloaded_training_equals_in_memory(worker_pool, world_size, tmp_path):
    group = worker_pool(world_size)
    for case in CASES:
        root = tmp_path / case
        results = group.run(_pair, case, str(root))
        for rank, res in enumerate(results):
            assert res["diffs"] == [0] * STEPS, (case, rank, res)
            # A world of one offloads too: each parameter is its own shard, fetched
            # from the swap file for its module (a gather with no peer to wait for).
            assert res["swap"], res
            assert res["gathers"] > 0, (case, res)
            assert res["reductions"] > 0 or world_size == 1, (case, res)
            # Alone, a rank fills each parameter from its shard: no receive buffer,
            # nothing sent, so no fingerprint either.
            assert (res["fingerprint"] == 0) == (world_size == 1), (case, res)
            assert (res["receive_buffers"] == 0) == (world_size == 1), (case, res)
            # Every step reads the shards back (forward and backward) and writes the
            # stepped ones; most reads started ahead of the gather that used them.
            assert res["read"] >= (STEPS - 1) * res["nvme_param"] > 0, (case, res)
            assert res["ahead"] > res["read"] // 2, (case, res)
            assert res["written"] > 0, (case, res)
            assert res["direct"] and res["resident"] == 0, (case, res)
            # The shards are counted in the swap file and not in memory.
            assert res["nvme_param"] == res["shard_bytes"], (case, res)
            assert res["param_in_memory"] == 0, (case, res)
            assert res["unsharded"][0] == res["unsharded"][1], (case, res)
            assert res["cleaned"], (case, res)
        assert not any(root.glob("zero3-*")), case


GLOBAL = 6  # samples per step: the same global batch at world 2 and 3


def _train(model: torch.nn.Module, opt: PartitionedOptimizer, steps: range) -> None:
    comm_rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _, make = build("gpt_tied")
    local = GLOBAL // world
    for step in steps:
        x = make(GLOBAL, step)
        loss_of(model(x[comm_rank * local : (comm_rank + 1) * local])).backward()
        opt.step()
        opt.zero_grad()


#: Checkpoint cases: the model's settings and whether it offloads (both sections, the
#: optimizer's alone; bf16 parameters keep separate masters; "mixed": bf16 with an fp32
#: parameter, so a sub-group holds both kinds of master; flat: one optimizer tensor per
#: sub-group).
MODES: dict[str, tuple[str | None, str, bool]] = {
    "none": (None, "none", False),
    "both": (None, "both", False),
    "optimizer": (None, "optimizer", False),
    "bf16": ("bf16", "none", False),
    "optimizer-bf16": ("bf16", "optimizer", False),
    "mixed": ("mixed", "none", False),
    "optimizer-mixed": ("mixed", "optimizer", False),
    "flat": (None, "none", True),
    "optimizer-flat": (None, "optimizer", True),
}


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Scaled(torch.nn.Module):
    """The model times a one-element parameter, registered last (so it shares the last
    sub-group): at world 2 and 3 some ranks hold none of it (a member with no elements
    in their sub-group and record).
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.tail = _Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tail(self.inner(x))
        return out


def _model(
    root: str, mode: str, optimizer: str = "adamw"
) -> tuple[torch.nn.Module, PartitionedOptimizer]:
    comm = GlooBackend(timeout_s=30)
    inner, _ = build("gpt_tied")
    model = _Scaled(inner)
    dtype, offload, flat = MODES[mode]
    if dtype == "mixed":  # bf16 with an fp32 scale, in one sub-group with bf16 members
        inner.to(torch.bfloat16)
        dtype = None
    base = dict(param_persistence_threshold=0, param_dtype=dtype)
    if offload == "both":
        config = _offload_config(root, True, **base)
    elif offload == "optimizer":
        section = {"device": "nvme", "nvme_path": root, "buffer_count": 2}
        config = Zero3Config(**base, offload_optimizer=section, sub_group_size=700)
    else:
        config = Zero3Config(**base)
    shard_module(model, config, comm=comm)
    cls, kwargs = OPTIMIZERS[optimizer]
    return model, PartitionedOptimizer(model, cls, flat=flat, **kwargs)


def _save(root: str, directory: str, mode: str, optimizer: str) -> dict[str, torch.Tensor]:
    """Train 2 steps, save, train 1 more; the full weights after it."""
    model, opt = _model(root, mode, optimizer)
    _train(model, opt, range(2))
    save_checkpoint(directory, model, opt)
    _train(model, opt, range(2, 3))
    return full_state_dict(model)


def _resume(root: str, directory: str, mode: str, optimizer: str) -> dict[str, torch.Tensor]:
    """Load into a fresh model, train the third step; the full weights after it."""
    model, opt = _model(root, mode, optimizer)
    load_checkpoint(directory, model, opt)
    _train(model, opt, range(2, 3))
    assert (sharded_state(model).param_swap is not None) == (MODES[mode][1] == "both")
    assert (opt.offload is not None) == (MODES[mode][1] != "none")
    return full_state_dict(model)


@pytest.mark.parametrize(
    "saved_as, resumed_as",
    [
        ("both", "none"),
        ("none", "both"),
        ("optimizer", "none"),
        ("none", "optimizer"),
        ("optimizer-bf16", "bf16"),
        ("bf16", "optimizer-bf16"),
        ("optimizer-mixed", "mixed"),
        ("mixed", "optimizer-mixed"),
        ("optimizer-flat", "optimizer"),
        ("flat", "optimizer-flat"),
    ],
)
def test_checkpoints_of_offloaded_models_resume_with_or_without_offload(
    worker_pool, saved_as, resumed_as, tmp_path
):
    """Saved with offload, resumed without (and the other way round). At the same world
    size the resumed run ends bit for bit where the uninterrupted one does (AdamW). At
    another world size (SGD with momentum) the reductions' order differs, so the
    resumed run is compared with the same resume without offload from a checkpoint
    saved without offload: bit for bit. Saves read the offloaded records and shards as
    they write them; loads fill and write them one at a time.
    """
    ckpt = str(tmp_path / "adamw")
    saved = worker_pool(2).run(_save, str(tmp_path / "a"), ckpt, saved_as, "adamw")[0]
    resumed = worker_pool(2).run(_resume, str(tmp_path / "b"), ckpt, resumed_as, "adamw")[0]
    assert saved.keys() == resumed.keys()
    for key in saved:
        assert torch.equal(resumed[key], saved[key]), key
    # Another world size, against the same resume entirely in memory.
    ckpt, plain = str(tmp_path / "sgd"), str(tmp_path / "sgd-in-memory")
    for path, mode in ((ckpt, saved_as), (plain, _in_memory(saved_as))):
        worker_pool(2).run(_save, str(tmp_path / "a"), path, mode, "sgd-momentum")
    runs = [
        worker_pool(3).run(_resume, str(tmp_path / "b"), path, mode, "sgd-momentum")[0]
        for path, mode in ((ckpt, resumed_as), (plain, _in_memory(resumed_as)))
    ]
    assert runs[0].keys() == runs[1].keys()
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def _edited_in_forward(root: str) -> list[int]:
    """In-memory and offloaded twins whose forward scales a gathered weight in place at
    step 1 (a forward pre-hook): the edit must reach the shards; per-step differences.
    """
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    twin = copy.deepcopy(model)
    base = dict(param_persistence_threshold=0)
    shard_module(model, Zero3Config(**base), comm=comm)
    shard_module(twin, _offload_config(root, False, **base), comm=comm)
    opts = [PartitionedOptimizer(m, torch.optim.AdamW, lr=1e-2) for m in (model, twin)]
    steps, diffs = [0], []

    def scale(module: torch.nn.Module, _: Any) -> None:
        if steps[0] == 1:
            with torch.no_grad():
                module.weight.mul_(0.5)

    for m in (model, twin):
        m.blocks[0].mlp.fc.register_forward_pre_hook(scale)
    for step in range(3):
        steps[0] = step
        for m, opt in zip((model, twin), opts, strict=True):
            x = make(LOCAL * n, step)
            loss_of(m(x[r * LOCAL : (r + 1) * LOCAL])).backward()
            opt.step()
            opt.zero_grad()
        pairs = zip(sharded_state(model).params, sharded_state(twin).params, strict=True)
        diffs.append(sum(int((a.shard != b.shard).sum()) for a, b in pairs))
        for sp in sharded_state(twin).params:
            if sp.home is not None:
                sp.home.drop(sp)
    return diffs


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_edit_of_a_gathered_offloaded_parameter_reaches_its_shard(
    worker_pool, world_size, tmp_path
):
    """An in-place edit of a whole parameter while it is gathered is kept when it is
    released and written into its shard (in the swap file) by the step's sync, alone
    too, where nothing is merged across ranks.
    """
    for diffs in worker_pool(world_size).run(_edited_in_forward, str(tmp_path)):
        assert diffs == [0, 0, 0], diffs


def _save_async(root: str, directory: str, mode: str, optimizer: str) -> dict[str, Any]:
    """Train 2 steps, save asynchronously and train the third while the save writes."""
    model, opt = _model(root, mode, optimizer)
    _train(model, opt, range(2))
    future = save_checkpoint(directory, model, opt, async_save=True)
    assert future is not None
    _train(model, opt, range(2, 3))  # the swap files change under the save
    future.result()
    beside = sorted(p.name for p in Path(directory).parent.iterdir())
    return {"weights": full_state_dict(model), "beside": beside}


def test_an_async_save_of_offloaded_state_writes_the_state_it_was_called_with(
    worker_pool, tmp_path
):
    """The offloaded records and shards an async save writes are copied to a snapshot
    file when it is called (not read back into memory): training on while it writes
    changes the swap files, not the checkpoint, which resumes exactly as a synchronous
    save of the same moment; the snapshot is gone once the save is done.
    """
    # The async one's parent directory does not exist yet: the save makes it.
    sync, lazy = tmp_path / "ckpt" / "sync", tmp_path / "later" / "async"
    saved = worker_pool(2).run(_save, str(tmp_path / "a"), str(sync), "both", "adamw")[0]
    results = worker_pool(2).run(_save_async, str(tmp_path / "a"), str(lazy), "both", "adamw")
    for result in results:
        assert result["beside"] == ["async"], result["beside"]
        for key, value in saved.items():  # the same three steps either way
            assert torch.equal(result["weights"][key], value), key
    resumed = [
        worker_pool(2).run(_resume, str(tmp_path / "b"), str(d), "both", "adamw")[0]
        for d in (sync, lazy)
    ]
    for key in resumed[0]:
        assert torch.equal(resumed[0][key], resumed[1][key]), key


def _async_save_error(root: str, directory: str) -> str:
    model, opt = _model(root, "both")
    _train(model, opt, range(1))
    try:
        save_checkpoint(directory, model, opt, async_save=True)
    except CheckpointError as exc:
        _train(model, opt, range(1, 2))  # training goes on after the refused save
        return str(exc)
    return "no error"


def test_an_async_save_without_room_for_its_snapshot_fails_every_rank(worker_pool, tmp_path):
    """Where the offloaded state does not fit beside the checkpoint, every rank raises
    before anything is written, naming the bytes needed and the fix.
    """
    mount = Path(tempfile.mkdtemp(prefix="zero3-small-"))
    if os.system(f"mount -t tmpfs -o size=16k tmpfs {mount} 2>/dev/null") != 0:
        os.rmdir(mount)
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        results = worker_pool(2).run(_async_save_error, str(tmp_path), str(mount / "ckpt"))
        assert all("could not copy its offloaded state" in text for text in results), results
        assert "Free that much space there" in results[0], results
        assert list(mount.iterdir()) == [], list(mount.iterdir())
    finally:
        os.system(f"umount {mount}")
        os.rmdir(mount)


@pytest.mark.parametrize(("saved_world", "resumed_world"), [(2, 1), (1, 2)])
def test_one_device_with_offloaded_parameters_saves_and_resumes_at_another_world_size(
    worker_pool, saved_world, resumed_world, tmp_path
):
    """A world of one with its parameters in a swap file saves checkpoints any world size
    resumes, and resumes theirs: bit for bit the same resume as entirely in memory.
    """
    runs = []
    for tag, saved_as, resumed_as in (("offloaded", "both", "both"), ("plain", "none", "none")):
        ckpt = str(tmp_path / tag)
        worker_pool(saved_world).run(_save, str(tmp_path / "a"), ckpt, saved_as, "sgd-momentum")
        resumed = worker_pool(resumed_world).run(
            _resume, str(tmp_path / "b"), ckpt, resumed_as, "sgd-momentum"
        )
        runs.append(resumed[0])
    assert runs[0].keys() == runs[1].keys()
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def _in_memory(mode: str) -> str:
    """The same model and optimizer without offload."""
    return {"both": "none", "optimizer": "none"}.get(mode, mode.removeprefix("optimizer-"))


def _two_models(root: str) -> list[int]:
    """Two offloaded models in one process under one nvme_path keep apart."""
    model, opt = _model(root, "both")
    other, other_opt = _model(root, "both")
    _train(model, opt, range(1))
    _train(other, other_opt, range(1))
    swaps = [sharded_state(m).param_swap for m in (model, other)]
    assert swaps[0] is not None and swaps[1] is not None
    assert swaps[0].path != swaps[1].path
    return [s.stats.read_bytes for s in swaps]  # type: ignore[union-attr]


def test_two_param_offloaded_models_of_one_process_share_a_path(worker_pool, tmp_path):
    for reads in worker_pool(2).run(_two_models, str(tmp_path)):
        assert all(r > 0 for r in reads), reads


def _no_read_memory(swap: Any) -> None:
    """The swap's reads find no host memory for their buffers from now on."""

    def exhausted(sp: Any) -> Any:
        raise MemoryError(f"no room for the read buffer of {sp.name} (test)")

    swap._read = exhausted


def _no_write_memory(swap: Any) -> None:
    """The swap's writes find no host memory for their buffers from now on."""

    def exhausted(index: int, dtype: Any, values: Any) -> Any:
        raise MemoryError(f"no room for the write buffer of shard #{index} (test)")

    swap._buffer_of = exhausted


_BREAKERS = {"no-memory": _no_read_memory, "no-write-memory": _no_write_memory}


def _fault(kind: str, root: str) -> str:
    """Break one rank's parameter swap file (``"no-memory"``: its reads' buffers,
    ``"no-write-memory"``: its writes') after a good step; return the next step's error.
    """
    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    model, make = build("gpt_tied")
    shard_module(model, _offload_config(root, False, param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    size = 4096 if kind == "truncated" else 0
    breaker = _BREAKERS.get(kind)
    return step_past_a_broken_swap(
        model, opt, make, rank=r, world=n, local=LOCAL, size=size, breaker=breaker
    )


@pytest.mark.parametrize("kind", ["truncated", "emptied"])
def test_a_broken_param_swap_file_on_one_rank_fails_every_rank(worker_pool, kind, tmp_path):
    results = worker_pool(2).run(_fault, kind, str(tmp_path))
    for text in results:
        assert "rank 1" in text and "could not read its parameter shard back" in text, results
    # The failing rank names its file.
    assert "params.swp" in results[1] and "short read" in results[1], results


def test_a_broken_param_swap_file_in_a_world_of_one_raises(worker_pool, tmp_path):
    """One device with its parameters in the swap file: a truncated file is an error
    naming it, never zeros or stale values gathered into the model.
    """
    (text,) = worker_pool(1).run(_fault, "truncated", str(tmp_path))
    assert "rank 0" in text and "could not read its parameter shard back" in text, text
    assert "params.swp" in text and "short read" in text, text


def test_no_host_memory_for_a_shard_read_on_one_rank_fails_every_rank(worker_pool, tmp_path):
    """A read buffer that cannot be allocated is agreed at the gather like a broken
    file: the peer does not wait in the all-gather for a rank that raised."""
    results = worker_pool(2).run(_fault, "no-memory", str(tmp_path))
    for text in results:
        assert "rank 1" in text and "could not read its parameter shard back" in text, results
    assert "no room for the read buffer" in results[1], results


def test_no_host_memory_for_a_shard_write_on_one_rank_fails_every_rank(worker_pool, tmp_path):
    """A write buffer that cannot be allocated (the optimizer step writes every stepped
    shard) is a failed write, agreed where the step settles: every rank raises, naming
    the parameter; the rank does not die alone in the step while its peer waits.
    """
    results = worker_pool(2).run(_fault, "no-write-memory", str(tmp_path))
    for text in results:
        assert "parameter offload failed on rank 1" in text, results
        assert "no host memory for the" in text and "write buffer of parameter" in text, results


def _forward_after_a_lost_write(root: str) -> list[str]:
    """One process: a step whose shard writes find no buffer raises; a forward after it
    (a user who caught the error) raises too instead of gathering the older values.
    """
    comm = GlooBackend(timeout_s=30)
    model, make = build("gpt_tied")
    shard_module(model, _offload_config(root, False, param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    swap = sharded_state(model).param_swap
    x = make(LOCAL, 0)
    loss_of(model(x)).backward()
    _no_write_memory(swap)
    errors = []
    for run in (lambda: opt.step(), lambda: model(x)):
        try:
            run()
        except ParamOffloadError as exc:
            errors.append(str(exc))
    return errors


def test_a_shard_whose_write_found_no_buffer_is_never_read_back_stale(worker_pool, tmp_path):
    ((step, forward),) = worker_pool(1).run(_forward_after_a_lost_write, str(tmp_path))
    assert "write buffer of parameter" in step, step
    assert "could not read its parameter shard back" in forward, forward
    assert "holds older values" in forward, forward


def _shard_error(root: str, block_rank_1: bool) -> str:
    """The error of sharding with the shards offloaded under ``root``."""
    comm = GlooBackend(timeout_s=30)
    model, _ = build("gpt_tied")
    if block_rank_1 and comm.rank == 1:
        # A file stands where rank 1's own swap directory must go (its name holds the
        # host, process id and rank), so only rank 1 cannot create it.
        host = socket.gethostname().replace("-", "_")
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / f"zero3-params-{host}-{os.getpid()}-rank1").write_text("in the way")
    offload = {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}
    config = Zero3Config(param_persistence_threshold=0, offload_param=offload)
    try:
        shard_module(model, config, comm=comm)
    except ParamOffloadError as exc:
        return str(exc)
    return "no error"


def test_an_unusable_param_swap_path_on_one_rank_fails_every_rank(worker_pool, tmp_path):
    results = worker_pool(2).run(_shard_error, str(tmp_path), True)
    assert results[0] == results[1], results
    assert "parameter offload failed on rank 1" in results[0], results
    assert "cannot create the swap directory" in results[0], results


def test_too_little_space_for_the_shards_is_refused_at_shard_time(worker_pool):
    mount = Path(tempfile.mkdtemp(prefix="zero3-small-"))
    if os.system(f"mount -t tmpfs -o size=16k tmpfs {mount} 2>/dev/null") != 0:
        os.rmdir(mount)
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        results = worker_pool(2).run(_shard_error, str(mount), False)
        assert results[0] == results[1], results
        assert re.search(r"not enough free space .* bytes needed", results[0]), results
        assert "offloaded parameter shards" in results[0], results
    finally:
        os.system(f"umount {mount}")
        os.rmdir(mount)


# -- construction streams the shards into the swap file ------------------------------------


def _built_on_meta(root: str, from_file: bool) -> dict[str, Any]:
    """A model on meta built with its shards streamed into the swap file (initialised by
    its modules, or loaded with ``checkpoint=``) holds the in-memory build's shards and
    trains alike.
    """
    from safetensors.torch import save_file

    from zero3.hooks import empty_init
    from zero3.testing.models import TinyGPT

    comm = GlooBackend(timeout_s=30)
    n, r = comm.world_size, comm.rank
    file = None
    if from_file:
        torch.manual_seed(3)
        stored = {k: v.clone() for k, v in TinyGPT(dim=32, layers=3).state_dict().items()}
        file = f"{root}/weights-{r}.safetensors"  # one per rank: no write race
        Path(root).mkdir(parents=True, exist_ok=True)
        save_file(stored, file)
    models = []
    for offloaded in (False, True):
        with empty_init():
            model = TinyGPT(dim=32, layers=3)
        base = dict(param_persistence_threshold=0, prefetch_bucket_size=2000)
        config = _offload_config(root, False, **base) if offloaded else Zero3Config(**base)
        torch.manual_seed(5)  # the modules' initialisers draw the same numbers
        shard_module(model, config, comm=comm, checkpoint=file)
        models.append(model)
    swap = sharded_state(models[1]).param_swap
    assert swap is not None
    # Construction's writes are done and not counted; nothing was read back.
    result: dict[str, Any] = {
        "after_build": (swap.stats.written_bytes, swap.stats.read_bytes),
        "nvme_param": memory_stats(models[1]).nvme_param_bytes,
        "in_memory": memory_stats(models[1]).param_bytes,
        "shard_bytes": sum(sp.shard_numel * sp.itemsize for sp in swap.params),
        "offloaded": len(swap.params),
    }
    pairs = list(zip(sharded_state(models[0]).params, sharded_state(models[1]).params, strict=True))
    result["built_diff"] = sum(int((a.shard != b.shard).sum()) for a, b in pairs)
    opts = [PartitionedOptimizer(m, torch.optim.AdamW, lr=1e-2) for m in models]
    diffs = []
    for step in range(2):
        for m, opt in zip(models, opts, strict=True):
            x = torch.randint(0, 61, (LOCAL * n, 16), generator=torch.Generator().manual_seed(step))
            loss_of(m(x[r * LOCAL : (r + 1) * LOCAL])).backward()
            opt.step()
            opt.zero_grad()
        diffs.append(sum(int((a.shard != b.shard).sum()) for a, b in pairs))
    result["diffs"] = diffs
    result["gathers"] = stats(models[1]).gathers
    swap.close()
    return result


@pytest.mark.parametrize("from_file", [False, True], ids=["initialised", "checkpoint"])
def test_a_model_built_on_meta_streams_its_shards_into_the_swap_file(
    worker_pool, from_file, tmp_path
):
    for res in worker_pool(2).run(_built_on_meta, str(tmp_path), from_file):
        assert res["offloaded"] > 0 and res["gathers"] > 0, res
        assert res["after_build"] == (0, 0), res
        assert res["nvme_param"] == res["shard_bytes"] > 0 and res["in_memory"] == 0, res
        assert res["built_diff"] == 0 and res["diffs"] == [0, 0], res


_BUILD_RANK = """
import json, os, sys
import torch
from torch import nn
from zero3.core import Zero3Config
from zero3.hooks import empty_init, shard_module
from zero3.optim import PartitionedOptimizer, load_checkpoint, save_checkpoint

def status(field):
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the resident set now
    return status("VmRSS")

root, offloaded = sys.argv[1], sys.argv[2] == "1"
torch.manual_seed(0)
with empty_init():
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(LAYERS)])
offload = {{"device": "nvme", "nvme_path": root}}
extra = (
    {{"offload_param": {{**offload, "max_in_cpu": 0}}, "offload_optimizer": offload,
      "sub_group_size": 1 << 19}}
    if offloaded else {{}}
)
config = Zero3Config(backend="gloo", param_persistence_threshold=0, **extra)
growth = {{}}
base = reset_peak()
shard_module(model, config)
growth["build"] = status("VmHWM") - base
opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
model(torch.ones(2, 1024)).sum().backward()
opt.step()
opt.zero_grad()
base = reset_peak()
save_checkpoint(root + "/ckpt", model, opt)
growth["save"] = status("VmHWM") - base
base = reset_peak()
load_checkpoint(root + "/ckpt", model)
growth["load"] = status("VmHWM") - base
base = reset_peak()
load_checkpoint(root + "/ckpt", model, opt)
growth["load with the optimizer"] = status("VmHWM") - base
if os.environ["RANK"] == "0":
    print("GROWTH " + json.dumps(growth), flush=True)
os._exit(0)
"""


def _growth(tmp_path: Path, offloaded: bool, layers: int) -> dict[str, int]:
    import sys

    script = tmp_path / "build_rank.py"
    script.write_text(_BUILD_RANK.replace("LAYERS", str(layers)).format())
    launcher = ("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    # The threshold pinned: a freed block goes back to the kernel at once, so the peak is
    # what was live, not what glibc's heap kept from earlier allocations.
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    torchrun = Path(sys.executable).parent / "torchrun"
    root = tmp_path / ("offloaded" if offloaded else "in-memory")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(root),
           "1" if offloaded else "0"]  # fmt: skip
    returncode, out, err = run_in_session(cmd, timeout_s=120, env=env)
    assert returncode == 0, out + err[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("GROWTH "))
    growth: dict[str, int] = json.loads(line.removeprefix("GROWTH "))
    return growth


@pytest.mark.timeout(300)
def test_build_save_and_load_never_hold_all_the_offloaded_shards(tmp_path):
    """Building a model on meta with its shards offloaded, saving a checkpoint of it with
    its offloaded optimizer (AdamW after one step: 4x the shards' bytes in swap files)
    and loading it back (weights alone, and with the optimizer) each hold a few shards
    or records at a time: the peak
    grows by well under the shards per rank. The in-memory build grows by at least that
    much (the measurement sees the shards), and reading every shard and record back to
    save or load them would grow by several times it.
    """
    layers = 32  # 32 x 4 MiB of fp32 weights: 64 MiB of shards per rank at world 2
    shards = layers * (1024 * 1024 + 1024) * 4 // 2
    in_memory = _growth(tmp_path, False, layers)
    offloaded = _growth(tmp_path, True, layers)
    assert in_memory["build"] >= shards, (in_memory, shards)
    for phase in ("build", "save", "load", "load with the optimizer"):
        assert offloaded[phase] < shards // 2, (phase, offloaded, in_memory, shards)
