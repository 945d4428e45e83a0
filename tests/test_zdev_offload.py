"""Optimizer offload with the model on an accelerator (the zdev simulated device).

Rank ``r`` keeps its shards on ``zdev:r``. Two sharded copies of one model train side by
side in every worker: one with its optimizer on the device, one with
``offload_optimizer`` (cpu or nvme), whose masters and optimizer state live on the host
and step there while gradient shards go device→host and stepped shards host→device on
copy streams of their own. Both optimizers use torch's single-tensor kernels
(``foreach=False``: the device run would otherwise take the multi-tensor path), so the
shards must match bit for bit after every step. The race detector is on throughout:
a copy the compute stream does not wait for, or a staging buffer reused before its copy
is over, raises.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

from zero3.core import (
    Zero3Config,
    estimate_model_states,
    local_grad,
    local_shard,
)
from zero3.core.engine import sharded_state
from zero3.hooks import memory_stats, shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import OPTIMIZERS, build, loss_of, step_past_a_broken_swap

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(300)]

LOCAL = 2
STEPS = 3

# (optimizer, param_dtype, offload device, pin, accumulate, clip, overflow at, ratio, flat)
CASES: dict[str, tuple[str, str | None, str, bool, int, float | None, int | None, float, bool]] = {
    "adamw-fp32-cpu-pinned": ("adamw", None, "cpu", True, 1, None, None, 1.0, False),
    "adamw-bf16-nvme-pinned": ("adamw", "bf16", "nvme", True, 1, 0.05, None, 1.0, False),
    "adagrad-bf16-cpu": ("adagrad", "bf16", "cpu", False, 1, None, None, 1.0, False),
    "sgd-accumulate-clip-nvme": ("sgd-momentum", None, "nvme", True, 2, 0.05, None, 1.0, False),
    "adamw-fp16-overflow-cpu": ("adamw", "fp16", "cpu", True, 1, None, 1, 1.0, False),
    "adamw-fp32-half-offloaded": ("adamw", None, "cpu", True, 1, None, None, 0.5, False),
    "adamw-bf16-flat-nvme": ("adamw", "bf16", "nvme", True, 1, None, None, 1.0, True),
}


def _sparams(model: torch.nn.Module) -> list[Any]:
    return list(sharded_state(model).params)


def _pair(case: str, root: str) -> dict[str, Any]:
    """Train the in-device and offloaded copies side by side; compare after every step."""
    import torch.distributed as dist

    from zero3.testing.device import detector

    name, dtype, kind, pin, accumulate, clip, overflow_at, ratio, flat = CASES[case]
    dev = torch.device("zdev", int(os.environ["LOCAL_RANK"]))
    n, r = dist.get_world_size(), dist.get_rank()
    model, make = build("gpt_tied")
    model.to(dev)
    twin = copy.deepcopy(model)
    base = dict(backend="zdev", param_persistence_threshold=0, gradient_clipping=clip,
                param_dtype=dtype, initial_scale_power=8, overlap_comm=True,
                overlap_chunk_size=2000)  # fmt: skip
    shard_module(model, Zero3Config(**base))
    offload = {"device": kind, "nvme_path": root, "buffer_count": 2, "pin_memory": pin,
               "ratio": ratio}  # fmt: skip
    shard_module(twin, Zero3Config(**base, sub_group_size=700, offload_optimizer=offload))
    cls, kwargs = OPTIMIZERS[name]
    opts = [PartitionedOptimizer(m, cls, flat=flat, foreach=False, **kwargs) for m in (model, twin)]
    store = opts[1].offload
    assert store is not None and store.host_stepped
    diffs, syncs = [], []
    for step in range(STEPS):
        for m, opt in zip((model, twin), opts, strict=True):
            for micro in range(accumulate):
                x = make(LOCAL * n, step * 10 + micro).to(dev)
                opt.scale_loss(loss_of(m(x[r * LOCAL : (r + 1) * LOCAL])) / accumulate).backward()
            if step == overflow_at and r == 0:
                local_grad(next(iter(m.parameters())))[0] = float("inf")
            before = detector.host_syncs()
            opt.step()
            after = detector.host_syncs()
            syncs.append({k: after[k] - before[k] for k in after})
            opt.zero_grad()
        diffs.append(
            sum(
                int((a.shard.float() != b.shard.float()).sum().item())
                for a, b in zip(_sparams(model), _sparams(twin), strict=True)
            )
        )
    memory = memory_stats(twin, opts[1])  # before the masters are read back
    masters = [
        int((a.cpu() != b.cpu()).sum())
        for a, b in zip(opts[0].master_shards(), opts[1].master_shards(), strict=True)
    ]
    detector.check()
    result = {
        "diffs": diffs,
        "masters": sum(masters),
        "master_devices": sorted({str(t.device) for t in opts[1].master_shards()}),
        "shard_devices": sorted({str(sp.shard.device) for sp in _sparams(twin)}),
        "in_device_syncs": syncs[0::2],
        "offloaded_syncs": syncs[1::2],
        "subgroups": len(opts[1]._subgroups),
        "gathers": stats(twin).gathers,
        "reductions": stats(twin).reduce_collectives,
        "host_bytes": memory.host_master_bytes + memory.host_optimizer_bytes,
        "nvme_bytes": memory.nvme_bytes,
        "written": store.stats.written_bytes,
        "to_host": store.stats.to_host_bytes,
        "to_device": store.stats.to_device_bytes,
        "host_step_s": store.stats.step_s,
    }
    store.close()
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_training_on_an_accelerator_equals_training_on_it(zdev_pool, case, tmp_path):
    world = 1 if case == "adamw-fp32-cpu-pinned" else 2
    results = zdev_pool(world).run(_pair, case, str(tmp_path), timeout=240)
    name, dtype, kind, _, _, _, overflow_at, ratio, _ = CASES[case]
    # What the estimator foresees in host memory for a model on an accelerator.
    offload = {"device": kind, "ratio": ratio, "nvme_path": "/x"}
    config = Zero3Config(
        param_persistence_threshold=0, param_dtype=dtype, offload_optimizer=offload
    )
    estimate = estimate_model_states(
        build("gpt_tied")[0], world, optimizer=name.split("-")[0], config=config, device="cuda"
    )
    for rank, result in enumerate(results):
        assert result["diffs"] == [0] * STEPS and result["masters"] == 0, result
        assert result["shard_devices"] == [f"zdev:{rank}"], result
        if ratio == 1.0:
            assert result["master_devices"] == ["cpu"], result
        else:  # the first half of the sub-groups on the host, the rest on the device
            assert result["master_devices"] == ["cpu", f"zdev:{rank}"], result
        assert result["subgroups"] > 2, result  # several batches: the copies pipeline
        # The last step's copies, counted: every offloaded gradient came down, every
        # stepped shard went up (gradients in the reduce dtype, shards in theirs).
        assert result["to_host"] > 0 and result["to_device"] > 0, result
        assert result["host_step_s"] > 0, result
        if world > 1:
            assert result["gathers"] > 0 and result["reductions"] > 0, result
        if kind == "nvme":
            assert result["nvme_bytes"] > 0 and result["written"] > 0, result
        elif ratio == 1.0:  # what the estimator foresaw is what is in host memory
            assert result["host_bytes"] == estimate.host_bytes > 0, (result, estimate)
        else:  # ratio counts sub-groups, the estimate elements: close, not equal
            assert 0.5 < result["host_bytes"] / estimate.host_bytes < 2, (result, estimate)
        # After the first step no master is compared with its shard (a blocking read):
        # the offloaded step reads back no more than the in-device one, plus nvme's two
        # agreements on I/O faults (before stepping, before writing back).
        agreements = 2 if kind == "nvme" else 0
        for step in range(1, STEPS):
            if step == overflow_at:
                continue
            mine, theirs = result["offloaded_syncs"][step], result["in_device_syncs"][step]
            assert mine["to-host"] <= theirs["to-host"] + agreements, (mine, theirs)
            assert mine["event"] > 0, mine  # the host waited for its copies, no more


# -- parameter offload: shards in host memory or a swap file, gathered to the device -----------
#
# With ``cpu`` the coordinator reads the next gathers' host shards ahead onto the device, on
# an upload stream (HostShards): from the second step on, a gather packs each host shard
# from its copy ahead (the compute stream waits for the copy's event; a missing wait, or a
# copy freed without record_stream, is a race the detector raises) and makes no blocking
# host-to-device copy for it; one not read ahead is packed from the host, counted. With
# ``nvme`` (ParamSwap) a shard read ahead from its file goes on to the device the same way
# once its read is in, and a gather whose shard's read was not in queues the copy itself:
# no gather of a shard from the file makes a blocking host-to-device copy, in any step.

#: The largest fetch unit of gpt_tied (an MLP linear, 4096 + 128 elements): a prefetch of
#: one unit, as the auto window gives a model above its floor. The coordinator reads host
#: shards ahead by one prefetch's shards, so with it every gather finds its copy ahead.
UNIT = 4224

# (optimizer, param_dtype, offload_param device, offload_optimizer device or None, pin,
#  prefetch_bucket_size, edit a host shard in place before step 2 of 0, 1, 2)
PARAM_CASES: dict[str, tuple[str, str | None, str, str | None, bool, int, bool]] = {
    "adamw-fp32-params-nvme": ("adamw", None, "nvme", None, True, UNIT, False),
    "adamw-bf16-params-cpu-pinned": ("adamw", "bf16", "cpu", None, True, UNIT, False),
    # A window smaller than a unit, pageable read buffers.
    "adagrad-bf16-both-nvme": ("adagrad", "bf16", "nvme", "nvme", False, 2000, False),
    # A shard read back and edited in place between steps: packed from memory, written back.
    "adamw-bf16-params-nvme-edited": ("adamw", "bf16", "nvme", None, True, UNIT, True),
    "adamw-fp32-both-cpu": ("adamw", None, "cpu", "cpu", True, UNIT, False),
    # A window smaller than a unit (some gathers miss their copy, counted), pageable host
    # shards, and an in-place edit that outdates a copy already read ahead.
    "adamw-bf16-params-cpu-small-edited": ("adamw", "bf16", "cpu", None, False, 2000, True),
    # Masters in a swap file between steps: the host shards say whether they were edited.
    "adamw-bf16-cpu-optim-nvme": ("adamw", "bf16", "cpu", "nvme", True, UNIT, False),
}
EDITED = "wte.weight"  # the first shard the trace gathers: read ahead at every commit
#: Reads in flight of a swap file (offload_param.buffer_count): a window of one unit (two
#: shards) on the device and the next window's reads.
READS = 5


def _param_pair(case: str, root: str) -> dict[str, Any]:
    """Train in-device and parameter-offloaded copies side by side on zdev."""
    import torch.distributed as dist

    from zero3.testing.device import detector

    name, dtype, param_kind, optim_kind, pin, prefetch, edit = PARAM_CASES[case]
    dev = torch.device("zdev", int(os.environ["LOCAL_RANK"]))
    n, r = dist.get_world_size(), dist.get_rank()
    model, make = build("gpt_tied")
    model.to(dev)
    twin = copy.deepcopy(model)
    base = dict(backend="zdev", param_persistence_threshold=0, param_dtype=dtype,
                overlap_comm=True, overlap_chunk_size=2000,
                prefetch_bucket_size=prefetch)  # fmt: skip
    shard_module(model, Zero3Config(**base))
    extra: dict[str, Any] = {
        "offload_param": {"device": param_kind, "nvme_path": root, "buffer_count": READS,
                          "max_in_cpu": 0, "pin_memory": pin},
    }  # fmt: skip
    if optim_kind is not None:
        extra["offload_optimizer"] = {"device": optim_kind, "nvme_path": root,
                                      "buffer_count": 2, "pin_memory": pin}  # fmt: skip
        extra["sub_group_size"] = 700
    shard_module(twin, Zero3Config(**base, **extra))
    cls, kwargs = OPTIMIZERS[name]
    opts = [PartitionedOptimizer(m, cls, foreach=False, **kwargs) for m in (model, twin)]
    held = sorted({str(sp.held_shard.device) for sp in _sparams(twin) if sp.held_shard.numel()})
    state = sharded_state(twin)
    # What the gathers of offloaded shards found (both homes count alike).
    if state.host_shards is not None:
        counts = state.host_shards.stats
    else:
        assert state.param_swap is not None
        counts = state.param_swap.device_stats
    diffs, found, uploads, let_go = [], [], [], []
    edited = next(sp for sp in _sparams(twin) if sp.name == EDITED)
    for step in range(STEPS):
        for m, opt in zip((model, twin), opts, strict=True):
            unused = counts.unused_bytes
            # The same edit of both: the twin's copy ahead is outdated (cpu: let go and
            # made again when the step begins), or its shard is read back (nvme: copied
            # onto the device from the edited values when the step begins).
            if edit and step == 2:
                local_shard(dict(m.named_parameters())[EDITED]).mul_(0.5)
            x = make(LOCAL * n, step).to(dev)
            before = _found(counts)
            syncs = detector.host_syncs()["to-device"]
            loss_of(m(x[r * LOCAL : (r + 1) * LOCAL])).backward()
            # Blocking host-to-device copies in the forward and backward: a gather that
            # packs a shard from host memory makes one, one packing a device copy none.
            uploads.append(detector.host_syncs()["to-device"] - syncs)
            if m is twin:
                found.append(tuple(a - b for a, b in zip(_found(counts), before, strict=True)))
                let_go.append(counts.unused_bytes - unused)
            opt.step()
            opt.zero_grad()
        memory = memory_stats(twin, opts[1])  # before the comparison reads shards back
        pairs = zip(_sparams(model), _sparams(twin), strict=True)
        diffs.append(sum(int((a.shard.cpu() != b.shard.cpu()).sum()) for a, b in pairs))
        for sp in _sparams(twin):  # comparing read them back: let them go
            if sp.home is not None:
                sp.home.drop(sp)
    detector.check()
    swap = sharded_state(twin).param_swap
    result = {
        "diffs": diffs,
        "held": held,
        "swap": swap is not None,
        "host_param": memory.host_param_bytes,
        "nvme_param": memory.nvme_param_bytes,
        "device_param": memory.param_bytes,
        "gathers": stats(twin).gathers,
        "reductions": stats(twin).reduce_collectives,
        "read": swap.stats.read_bytes if swap is not None else 0,
        "unit": sharded_state(twin).window.unit_numel,
        "found": found,  # per step: shards packed from a copy ahead, at the gather, the host
        "in_device_uploads": uploads[0::2],
        "offloaded_uploads": uploads[1::2],
        "unused_bytes": counts.unused_bytes,
        "let_go": let_go,  # per step: bytes of copies let go unused
        "edited_bytes": edited.shard_numel * edited.itemsize,
    }
    for opt in opts:
        if opt.offload is not None:
            opt.offload.close()
    return result


def _found(counts: Any) -> tuple[int, int, int]:
    """Shards packed so far from a copy ahead, from a copy queued by their gather, and
    from host memory (``DeviceCopyStats``).
    """
    return counts.ahead, counts.at_gather, counts.on_demand


#: The cases also run in a world of one (one device, the model larger than it: every
#: parameter is its own shard, fetched from the host or the swap file for its module).
ONE_DEVICE = ("adamw-fp32-params-nvme", "adamw-bf16-params-cpu-pinned", "adamw-fp32-both-cpu")


@pytest.mark.parametrize(
    ("case", "world"), [(c, 2) for c in PARAM_CASES] + [(c, 1) for c in ONE_DEVICE]
)
def test_parameter_offload_on_an_accelerator_equals_training_on_it(
    zdev_pool, case, world, tmp_path
):
    results = zdev_pool(world).run(_param_pair, case, str(tmp_path), timeout=240)
    _, dtype, param_kind, optim_kind, _, prefetch, edit = PARAM_CASES[case]
    # Where the estimator foresees the shards (parameter offload alone: max_in_cpu 0).
    offload = {"device": param_kind, "nvme_path": "/x", "max_in_cpu": 0}
    config = Zero3Config(param_persistence_threshold=0, param_dtype=dtype, offload_param=offload)
    estimate = estimate_model_states(build("gpt_tied")[0], world, config=config, device="cuda")
    foreseen = estimate.host_bytes if param_kind == "cpu" else estimate.nvme_bytes
    for result in results:
        assert result["diffs"] == [0] * STEPS, result
        assert result["gathers"] > 0, result
        assert result["reductions"] > 0 or world == 1, result
        if optim_kind is None:  # the shards are where the estimate put them
            moved = result["host_param"] if param_kind == "cpu" else result["nvme_param"]
            assert moved == foreseen > 0, (result, estimate)
            assert result["device_param"] == estimate.param_bytes == 0, (result, estimate)
        if param_kind == "cpu":  # every shard (none persistent) in host memory
            assert result["held"] == ["cpu"] and result["host_param"] > 0, result
            assert result["device_param"] == 0 and not result["swap"], result
            _check_read_ahead(result, prefetch, edit)
        else:  # in the swap file between uses, read back for each gather
            assert result["held"] == [] and result["nvme_param"] > 0, result
            assert result["swap"] and result["read"] > 0, result
            _check_swap_read_ahead(result, prefetch, edit, world)


def _check_read_ahead(result: dict[str, Any], prefetch: int, edit: bool) -> None:
    """Host shards reach their gathers through copies read ahead onto the device."""
    found, mine, theirs = result["found"], result["offloaded_uploads"], result["in_device_uploads"]
    assert [f[1] for f in found] == [0] * STEPS, result  # none is queued by its gather
    ahead, _, on_demand = found[0]
    assert ahead == 0 and on_demand > 0, result  # the first step records the trace
    for step in range(1, STEPS):
        ahead, _, on_demand = found[step]
        assert ahead > 0, result
        # Each shard packed from the host is one blocking copy more than the in-device
        # model makes; each packed from its copy ahead is none.
        assert mine[step] - theirs[step] == on_demand, result
    if prefetch >= result["unit"]:  # a prefetch's shards cover every next gather
        assert [f[2] for f in found[1:]] == [0] * (STEPS - 1), result
        assert mine[1:] == theirs[1:] and result["unused_bytes"] == 0, result
    else:  # a window under a fetch unit still reads a unit ahead: most gathers find copies
        assert all(ahead > on_demand for ahead, _, on_demand in found[1:]), result
    if edit:  # the edited shard's outdated copy was let go and made again, not used
        assert found[2] == found[1], result
        assert result["let_go"][2] - result["let_go"][1] == result["edited_bytes"], result


def _check_swap_read_ahead(result: dict[str, Any], prefetch: int, edit: bool, world: int) -> None:
    """Shards from the swap file reach their gathers through copies on the device."""
    found, mine, theirs = result["found"], result["offloaded_uploads"], result["in_device_uploads"]
    ahead, at_gather, on_demand = found[0]
    assert ahead == 0 and at_gather > 0, result  # the first step records the trace
    # The same gathers every step once the trace is recorded, each counted once.
    assert len({sum(f) for f in found[1:]}) == 1, result
    # The first step: every shard read on demand, none copied to the device by a blocking
    # copy (the in-device model, run first, also makes its one-time copies then; in a
    # world of one it gathers nothing, so the gathers' one-time copies are the twin's).
    assert found[0][2] == 0 and (mine[0] <= theirs[0] or world == 1), result
    for step in range(1, STEPS):
        ahead, at_gather, on_demand = found[step]
        # No shard is copied to the device by a blocking copy: even the edited one (read
        # back, edited in place) is copied on the upload stream when the step begins.
        assert on_demand == 0, result
        assert mine[step] - theirs[step] == on_demand, result
        if prefetch >= result["unit"]:
            # From the second step on, gathers find their shards on the device: read
            # from the file a window ahead, copied at the read-ahead that found them in.
            assert ahead > 0, (found, mine, theirs)


def _swap_fault(root: str) -> str:
    """Truncate one rank's parameter swap file after a good step (its shards go on to the
    device through copies): return the next step's error.
    """
    import torch.distributed as dist

    dev = torch.device("zdev", int(os.environ["LOCAL_RANK"]))
    n, r = dist.get_world_size(), dist.get_rank()
    model, make = build("gpt_tied")
    model.to(dev)
    offload = {"device": "nvme", "nvme_path": root, "buffer_count": READS, "max_in_cpu": 0}
    config = Zero3Config(backend="zdev", param_persistence_threshold=0,
                         prefetch_bucket_size=UNIT, offload_param=offload)  # fmt: skip
    shard_module(model, config)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=False)
    return step_past_a_broken_swap(
        model, opt, make, rank=r, world=n, local=LOCAL, size=4096, device=dev
    )


def test_a_broken_param_swap_file_on_an_accelerator_fails_every_rank(zdev_pool, tmp_path):
    # A read that fails is never copied to the device: the gather that needs it stops
    # every rank, naming the rank, as on a CPU run.
    results = zdev_pool(2).run(_swap_fault, str(tmp_path), timeout=240)
    for text in results:
        assert "rank 1" in text and "could not read its parameter shard back" in text, results
    assert "params.swp" in results[1] and "short read" in results[1], results


# -- checkpoints of offloaded state, on the device -------------------------------------------

CHECKPOINT_CASES = ["optimizer-cpu", "optimizer-nvme", "both-nvme", "params-cpu"]


def _checkpoint_config(case: str, root: str) -> Zero3Config:
    extra: dict[str, Any] = {}
    if case.startswith(("optimizer", "both")):
        kind = "cpu" if case.endswith("cpu") else "nvme"
        extra["offload_optimizer"] = {"device": kind, "nvme_path": root, "pin_memory": True}
        extra["sub_group_size"] = 700
    if case.startswith(("both", "params")):
        kind = "cpu" if case.endswith("cpu") else "nvme"
        extra["offload_param"] = {"device": kind, "nvme_path": root, "max_in_cpu": 0}
    return Zero3Config(backend="zdev", param_persistence_threshold=0, param_dtype="bf16",
                       **extra)  # fmt: skip


def _resume(case: str, root: str) -> dict[str, Any]:
    """Train 2 steps, save, train 1; load the save into a fresh model, train 1: equal."""
    import torch.distributed as dist

    from zero3.optim import load_checkpoint, save_checkpoint

    dev = torch.device("zdev", int(os.environ["LOCAL_RANK"]))
    n, r = dist.get_world_size(), dist.get_rank()
    path = os.path.join(root, "ckpt")

    def fresh() -> tuple[torch.nn.Module, PartitionedOptimizer, Any]:
        torch.manual_seed(0)
        model, make = build("gpt_tied")
        model.to(dev)
        shard_module(model, _checkpoint_config(case, root))
        return model, PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=False), make

    def train(model: torch.nn.Module, opt: PartitionedOptimizer, make: Any, step: int) -> None:
        x = make(LOCAL * n, step).to(dev)
        loss_of(model(x[r * LOCAL : (r + 1) * LOCAL])).backward()
        opt.step()
        opt.zero_grad()

    model, opt, make = fresh()
    for step in range(2):
        train(model, opt, make, step)
    save_checkpoint(path, model, opt)
    train(model, opt, make, 2)
    again, opt2, _ = fresh()
    load_checkpoint(path, again, opt2)
    train(again, opt2, make, 2)
    pairs = zip(_sparams(model), _sparams(again), strict=True)
    diffs = sum(int((a.shard.cpu() != b.shard.cpu()).sum()) for a, b in pairs)
    masters = zip(opt.master_shards(), opt2.master_shards(), strict=True)
    master_diffs = sum(int((a.cpu() != b.cpu()).sum()) for a, b in masters)
    for o in (opt, opt2):
        if o.offload is not None:
            o.offload.close()
    return {"diffs": diffs, "masters": master_diffs,
            "shards_on": sorted({str(sp.shard.device) for sp in _sparams(again)})}  # fmt: skip


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_offloaded_state_on_an_accelerator_saves_and_resumes_exactly(zdev_pool, case, tmp_path):
    for result in zdev_pool(2).run(_resume, case, str(tmp_path), timeout=240):
        assert result["diffs"] == 0 and result["masters"] == 0, result
