"""Sharded checkpoints across ranks: exact resume, resharding, interop, faults.

Every case runs in pooled gloo worker groups with a timeout. The global batch is the
same at every world size (12 samples), so runs at different world sizes see the same
data and their losses agree within fp32 reduction noise.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zero3.comm import GlooBackend
from zero3.core import CheckpointError, Zero3Config, sharded_state_dict
from zero3.core.engine import CheckpointStorageWriter, full_state_dict
from zero3.hooks import shard_module, stats
from zero3.optim import (
    PartitionedOptimizer,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from zero3.testing import RankExited
from zero3.testing.models import TinyGPT, build, loss_of

pytestmark = pytest.mark.multirank

GLOBAL = 12  # samples per step, divisible by 2, 3 and 4


def _setup(seed: int = 0, dtype: torch.dtype | None = None, flat: bool = False, model: Any = None):
    comm = GlooBackend(timeout_s=30)
    if model is None:
        model, make = build("gpt_tied", seed=seed)
    else:
        torch.manual_seed(seed)
        model, make = model(), build("gpt_tied")[1]
    config = Zero3Config(param_persistence_threshold=0, param_dtype=dtype)
    shard_module(model, config, comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, flat=flat)
    return comm, model, opt, make


def _steps(comm, model, opt, make, first: int, count: int, accumulate: int = 1) -> list[float]:
    n, r = comm.world_size, comm.rank
    local = GLOBAL // n
    losses = []
    for step in range(first, first + count):
        total = torch.zeros(())
        for micro in range(accumulate):
            x = make(GLOBAL, 100 * step + micro)
            loss = loss_of(model(x[r * local : (r + 1) * local])) / accumulate
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        comm.all_reduce(total).wait()
        losses.append(float(total) / n)
    return losses


# -- exact resume ---------------------------------------------------------------------------

MODES = {
    "sync": {},
    "async": {"async_save": True},
    "accumulate": {"accumulate": 2},
    "bf16-flat": {"dtype": torch.bfloat16, "flat": True},
}


def _train_and_save(root: str) -> dict[str, Any]:
    out = {}
    for mode, opts in MODES.items():
        comm, model, opt, make = _setup(dtype=opts.get("dtype"), flat=opts.get("flat", False))
        accumulate = opts.get("accumulate", 1)
        _steps(comm, model, opt, make, 0, 3, accumulate)
        path = os.path.join(root, mode)
        future = save_checkpoint(
            path, model, opt, extra={"step": 3}, async_save=opts.get("async_save", False)
        )
        # Training goes on while an async save writes: the checkpoint must still hold
        # the weights of step 3 (staged before save_checkpoint returned).
        losses = _steps(comm, model, opt, make, 3, 3, accumulate)
        if future is not None:
            assert future.result(timeout=60) == Path(path).absolute()
        out[mode] = {"losses": losses, "weights": full_state_dict(model)}
    return out


def _load_and_train(root: str) -> dict[str, Any]:
    out = {}
    for mode, opts in MODES.items():
        comm, model, opt, make = _setup(
            seed=7, dtype=opts.get("dtype"), flat=opts.get("flat", False)
        )
        extra = load_checkpoint(os.path.join(root, mode), model, opt)
        losses = _steps(comm, model, opt, make, extra["step"], 3, opts.get("accumulate", 1))
        out[mode] = {"losses": losses, "weights": full_state_dict(model)}
    return out


def test_exact_resume_in_fresh_processes(worker_pool, tmp_path):
    group = worker_pool(2)
    before = group.run(_train_and_save, str(tmp_path), timeout=240)
    group.close()  # the loads run in new processes
    after = worker_pool(2).run(_load_and_train, str(tmp_path), timeout=240)
    for rank in range(2):
        for mode in MODES:
            assert after[rank][mode]["losses"] == before[rank][mode]["losses"], mode
            want, got = before[rank][mode]["weights"], after[rank][mode]["weights"]
            assert want.keys() == got.keys()
            assert all(torch.equal(want[k], got[k]) for k in want), mode


# -- resharding -----------------------------------------------------------------------------


def _save_and_continue(path: str) -> list[float]:
    comm, model, opt, make = _setup()
    _steps(comm, model, opt, make, 0, 3)
    save_checkpoint(path, model, opt, extra={"step": 3})
    assert stats(model).gathers > 0
    return _steps(comm, model, opt, make, 3, 3)


def _load_and_continue(path: str) -> list[float]:
    comm, model, opt, make = _setup(seed=11)
    extra = load_checkpoint(path, model, opt)
    return _steps(comm, model, opt, make, extra["step"], 3)


@pytest.mark.parametrize(("saved", "loaded"), [(4, 2), (4, 3), (2, 4)])
def test_resharding_continues_the_same_losses(worker_pool, tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    reference = worker_pool(saved).run(_save_and_continue, path, timeout=240)[0]
    resumed = worker_pool(loaded).run(_load_and_continue, path, timeout=240)
    for losses in resumed:
        assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)


class TinyParams(nn.Module):
    """Parameters smaller than the world: a 1-element one and a 0-d one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.gate = nn.Parameter(torch.tensor([0.5]))
        self.temp = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gate / self.temp


def _tiny_setup(seed: int):
    from zero3.testing.models import float_batch

    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(seed)
    model = TinyParams()
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    return comm, model, PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2), float_batch(5)


def _tiny_save(path: str) -> list[float]:
    comm, model, opt, make = _tiny_setup(0)
    _steps(comm, model, opt, make, 0, 2)
    save_checkpoint(path, model, opt, extra={"step": 2})
    return _steps(comm, model, opt, make, 2, 2)


def _tiny_load(path: str) -> list[float]:
    comm, model, opt, make = _tiny_setup(4)
    extra = load_checkpoint(path, model, opt)
    return _steps(comm, model, opt, make, extra["step"], 2)


def test_parameters_smaller_than_the_world(worker_pool, tmp_path):
    """Ranks holding nothing of a parameter (and a 0-d one) save and load their part."""
    path = str(tmp_path / "ckpt")
    reference = worker_pool(3).run(_tiny_save, path, timeout=120)[0]
    for losses in worker_pool(2).run(_tiny_load, path, timeout=120):
        assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)


# -- construct-time loading: shard_module(checkpoint=<zero3 checkpoint>) --------------------


def _save_bf16(path: str) -> dict[str, torch.Tensor]:
    comm, model, opt, make = _setup(dtype=torch.bfloat16)
    _steps(comm, model, opt, make, 0, 2)
    save_checkpoint(path, model, opt, extra={"step": 2})
    return full_state_dict(model)


def _build_from_checkpoint(path: str) -> dict[str, Any]:
    from zero3.hooks import empty_init
    from zero3.testing.models import ZOO

    comm = GlooBackend(timeout_s=30)
    with empty_init():
        model, make = ZOO["gpt_tied"]()
    on_meta = all(p.is_meta for p in model.parameters())
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm, checkpoint=path)
    weights = full_state_dict(model)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _steps(comm, model, opt, make, 2, 1)
    return {"on_meta": on_meta, "weights": weights, "gathers": stats(model).gathers}


def test_shard_module_builds_from_a_zero3_checkpoint_at_another_world_size(worker_pool, tmp_path):
    """A bf16 run saved at world 2 builds an fp32 model at world 3 that never exists
    whole: the weights are the checkpoint's fp32 masters (finer than its bf16 weights)."""
    path = str(tmp_path / "ckpt")
    saved = worker_pool(2).run(_save_bf16, path, timeout=120)[0]
    for out in worker_pool(3).run(_build_from_checkpoint, path, timeout=120):
        assert out["on_meta"]
        assert out["gathers"] > 0
        finer = False
        for key, value in saved.items():
            loaded = out["weights"][key]
            assert loaded.dtype == torch.float32, key
            assert torch.equal(loaded.to(torch.bfloat16), value), key
            finer |= bool((loaded != value.float()).any())
        assert finer, "the loaded weights are the bf16 values, not the fp32 masters"


# -- interop and layout ---------------------------------------------------------------------


class WithBuffers(nn.Module):
    """Sharded and persistent parameters, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(8, 8)  # weight: 64 elements, sharded at threshold 20
        self.small = nn.Linear(8, 2)  # 16 + 2 elements: persistent
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.tanh(self.big(x) * self.scale))


def _save_with_buffers(path: str) -> dict[str, torch.Tensor]:
    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(0)
    model = WithBuffers()
    with torch.no_grad():
        model.scale.mul_(3.0)  # not the value a fresh model starts from
    shard_module(model, Zero3Config(param_persistence_threshold=20), comm=comm)
    save_checkpoint(path, model)
    return full_state_dict(model)


def _load_with_buffers(path: str, threshold: int) -> dict[str, torch.Tensor]:
    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(1)
    model = WithBuffers()
    shard_module(model, Zero3Config(param_persistence_threshold=threshold), comm=comm)
    load_checkpoint(path, model)
    return full_state_dict(model)


def _to_torch_save(path: str, out: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out)


def test_dcp_tools_open_it_and_replicated_entries_are_saved_once(worker_pool, tmp_path):
    from zero3.core.engine import CheckpointReader

    path = str(tmp_path / "ckpt")
    saved = worker_pool(2).run(_save_with_buffers, path, timeout=120)[0]
    reader = CheckpointReader(path)
    chunks = {
        key: len(reader.metadata.state_dict_metadata[f"model.{key}"].chunks)
        for key in reader.section_keys("model")
    }
    assert chunks == {
        "big.weight": 2, "big.bias": 1, "small.weight": 1, "small.bias": 1, "scale": 1,
    }  # fmt: skip  # sharded: a box per rank; persistent and buffers: one copy
    written = [i.fqn for i in reader.metadata.storage_data]
    assert sorted(f for f in written if f == "model.scale") == ["model.scale"]  # deduplicated
    # torch's own converter rebuilds the unsharded tensors, and plain torch opens them.
    _to_torch_save(path, str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    reference = WithBuffers().state_dict()
    assert {k: v.shape for k, v in full["model"].items()} == {
        k: v.shape for k, v in reference.items()
    }
    assert all(torch.equal(full["model"][k], saved[k]) for k in saved)
    assert full["zero3"]["format_version"] == 1
    # CheckpointReader (construct-time loading's WeightSource): any flat range of any key.
    assert reader.describe() == path
    assert {k: shape for k, (shape, _) in reader.entries().items()} == {
        k: tuple(v.shape) for k, v in reference.items()
    }
    for key, value in full["model"].items():
        flat = value.reshape(-1)
        n = flat.numel()
        for start, stop in [(0, n), (1, n - 1), (n // 3, 2 * n // 3), (n - 1, n)]:
            assert torch.equal(reader.read_flat(key, start, stop), flat[start:stop]), key
    reader.close()
    for threshold in (20, 0):  # persistent entries load into sharded parameters too
        loaded = worker_pool(2).run(_load_with_buffers, path, threshold, timeout=120)
        for got in loaded:
            assert all(torch.equal(got[k], saved[k]) for k in saved), threshold


def _tinygpt_other_vocab() -> nn.Module:
    return TinyGPT(vocab=67)


def _save_gpt(path: str, dtype: torch.dtype | None = None) -> None:
    comm, model, opt, make = _setup(dtype=dtype)
    _steps(comm, model, opt, make, 0, 2)
    save_checkpoint(path, model, opt, extra={"step": 2})


def _save_other_version(path: str) -> None:
    import torch.distributed.checkpoint as dcp

    _, model, _, _ = _setup()
    state = {"zero3": {"format_version": 999, "info": {}}, "model": sharded_state_dict(model)}
    dcp.save(state, storage_writer=CheckpointStorageWriter(path))


def _load_errors(paths: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Try each broken checkpoint in turn; every rank must raise, then go on."""
    out = {}
    for kind, path in paths.items():
        model_fn = _tinygpt_other_vocab if kind == "shape" else None
        _, model, opt, _ = _setup(seed=3, model=model_fn)
        try:
            load_checkpoint(path, model, opt)
            out[kind] = ("loaded", "")
        except CheckpointError as exc:
            out[kind] = (type(exc).__name__, str(exc))
    return out


def _albert_save(path: str) -> None:
    comm = GlooBackend(timeout_s=30)
    model, _ = build("albert_reused")
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    save_checkpoint(path, model)


def test_bad_checkpoints_fail_clearly_on_every_rank(worker_pool, tmp_path):
    group = worker_pool(2)
    good = tmp_path / "good"
    group.run(_save_gpt, str(good), timeout=120)
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    data = truncated / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    flipped = tmp_path / "flipped"
    shutil.copytree(good, flipped)
    data = flipped / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / ".metadata").unlink()
    group.run(_save_other_version, str(tmp_path / "version"), timeout=120)
    group.run(_albert_save, str(tmp_path / "albert"), timeout=120)
    paths = {
        "truncated": str(truncated),
        "flipped": str(flipped),
        "partial": str(partial),
        "missing": str(tmp_path / "nowhere"),
        "version": str(tmp_path / "version"),
        "other": str(tmp_path / "albert"),
        "shape": str(good),
    }
    expected = {
        "truncated": ("CorruptCheckpointError", "corrupted checkpoint"),
        "flipped": ("CorruptCheckpointError", "corrupted checkpoint"),
        "partial": ("IncompleteCheckpointError", "incomplete checkpoint"),
        "missing": ("CheckpointNotFoundError", "no checkpoint at"),
        "version": ("CheckpointVersionError", "incompatible checkpoint"),
        "other": ("CheckpointMismatchError", "checkpoint of another model"),
        "shape": ("CheckpointMismatchError", "checkpoint of another model"),
    }
    results = group.run(_load_errors, paths, timeout=180)
    for rank, result in enumerate(results):
        for kind, (cls, start) in expected.items():
            name, message = result[kind]
            assert name == cls, (rank, kind, message)
            assert message.startswith(start), (rank, kind, message)
            assert paths[kind] in message, (rank, kind, message)
    assert "fail their CRC-32 check" in results[0]["flipped"][1]
    assert "is truncated" in results[1]["truncated"][1]
    assert "missing keys" in results[0]["other"][1]
    assert "other shapes: wte.weight: (61, 32) saved, (67, 32) here" in results[0]["shape"][1]
    # The good checkpoint still loads on the same, reused, worker group.
    assert group.run(_load_errors, {"good": str(good)}, timeout=120)[0]["good"] == ("loaded", "")


# -- extra: per-rank values must not be silently dropped ---------------------------------------


def _save_extra(path: str) -> dict[str, Any]:
    import random

    comm, model, opt, _ = _setup()
    out: dict[str, Any] = {}
    for what, extra in {
        "differs": {"rng": torch.tensor([comm.rank])},
        "object": {"when": object()},
    }.items():
        try:
            save_checkpoint(path, model, opt, extra=extra)
            out[what] = "saved"
        except (ValueError, TypeError) as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    random.seed(5)
    gen = torch.Generator().manual_seed(3)
    extra = {
        "step": 7,
        "rng": torch.get_rng_state(),
        "generator": gen.get_state(),
        "python": random.getstate(),
        f"rank{comm.rank}": {"position": 100 + comm.rank},  # per-rank values, per-rank keys
    }
    save_checkpoint(path, model, opt, extra=extra)
    got = load_checkpoint(path, model, opt)
    out["round_trip"] = (
        got["step"] == 7
        and torch.equal(got["rng"], extra["rng"])
        and torch.equal(got["generator"], extra["generator"])
        and tuple(got["python"][1]) == extra["python"][1]
        and got["rank0"] == {"position": 100}
        and got["rank1"] == {"position": 101}
    )
    return out


def test_extra_round_trip_and_refusals(worker_pool, tmp_path):
    for result in worker_pool(2).run(_save_extra, str(tmp_path / "ckpt"), timeout=120):
        assert result["differs"].startswith("ValueError: save_checkpoint: extra['rng'] differs")
        assert result["object"].startswith("TypeError: save_checkpoint: extra['when'] is a object")
        assert result["round_trip"] is True


# -- a rank killed in the middle of a save ----------------------------------------------------


def _save_then_die(path: str, pause: str) -> dict[str, Any]:
    from zero3.core.files._format import TEST_PAUSE_ENV

    comm, model, opt, make = _setup()
    _steps(comm, model, opt, make, 0, 2)
    save_checkpoint(path, model, opt, extra={"step": 2})
    published = full_state_dict(model)
    _steps(comm, model, opt, make, 2, 2)
    if comm.rank == 1:
        os.environ[TEST_PAUSE_ENV] = pause  # rank 1 stops inside the save; the test kills it
    try:
        save_checkpoint(path, model, opt, extra={"step": 4})
        return {"error": None}
    except CheckpointError as exc:
        return {"error": str(exc), "published": published}


def _kill_when_paused(pause: Path, stop: threading.Event) -> None:
    marker = pause / "rank1.pid"
    while not stop.is_set():
        if marker.exists() and marker.read_text():
            os.kill(int(marker.read_text()), signal.SIGKILL)
            return
        time.sleep(0.05)


def _load_weights(path: str) -> dict[str, Any]:
    _, model, opt, _ = _setup(seed=9)
    try:
        extra = load_checkpoint(path, model, opt)
    except CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"extra": extra, "weights": full_state_dict(model)}


def test_rank_killed_mid_save_leaves_the_previous_checkpoint(worker_pool, tmp_path):
    path, pause = tmp_path / "ckpt", tmp_path / "pause"
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when_paused, args=(pause, stop), daemon=True)
    killer.start()
    try:
        results = worker_pool(2).run(
            _save_then_die, str(path), str(pause), timeout=180, allow_rank_exit=True
        )
    finally:
        stop.set()
        killer.join(timeout=5)
    assert isinstance(results[1], RankExited)
    assert results[0]["error"] is not None
    assert str(path) in results[0]["error"]
    staging = list(tmp_path.glob(".ckpt.zero3-saving-*"))
    assert len(staging) == 1 and not (staging[0] / ".metadata").exists()
    group = worker_pool(2)  # rebuilt: rank 1 died
    for got in group.run(_load_weights, str(path), timeout=120):
        assert got["extra"] == {"step": 2}
        want = results[0]["published"]
        assert all(torch.equal(got["weights"][k], want[k]) for k in want)
    for got in group.run(_load_weights, str(staging[0]), timeout=120):
        assert got["error"].startswith(
            f"IncompleteCheckpointError: incomplete checkpoint {staging[0]}"
        )


# -- FSDP2 <-> zero3: the model's weights move through DCP both ways ---------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: uneven splits for both engines
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _fsdp2_to_zero3(fsdp_path: str, zero3_path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from zero3.core import load_sharded_state_dict

    comm = GlooBackend(timeout_s=30)
    fsdp = _mlp()
    with torch.no_grad():
        for p in fsdp.parameters():
            p.mul_(1.5)  # not what a fresh _mlp() holds
    fully_shard(fsdp)
    dcp.save({"model": get_model_state_dict(fsdp)}, checkpoint_id=fsdp_path)
    want = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True))
    # FSDP2's checkpoint into zero3, with DCP resharding its row blocks into zero3's boxes.
    model = _mlp()
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    sd = {"model": sharded_state_dict(model)}
    dcp.load(sd, checkpoint_id=fsdp_path)
    load_sharded_state_dict(model, sd["model"])
    into_zero3 = full_state_dict(model)
    # zero3's checkpoint into FSDP2, read by DCP's own reader.
    save_checkpoint(zero3_path, model)
    back = _mlp()
    fully_shard(back)
    sd = {"model": get_model_state_dict(back)}
    dcp.load(sd, checkpoint_id=zero3_path)
    set_model_state_dict(back, sd["model"])
    into_fsdp = get_model_state_dict(back, options=StateDictOptions(full_state_dict=True))
    return {
        "into_zero3": all(torch.equal(into_zero3[k], want[k]) for k in want),
        "into_fsdp": all(torch.equal(into_fsdp[k], want[k]) for k in want),
        "keys": sorted(into_zero3) == sorted(want),
    }


def test_weights_move_between_fsdp2_and_zero3(worker_pool, tmp_path):
    results = worker_pool(2).run(
        _fsdp2_to_zero3, str(tmp_path / "fsdp"), str(tmp_path / "zero3"), timeout=180
    )
    assert results == [{"into_zero3": True, "into_fsdp": True, "keys": True}] * 2


# -- transformers: trained by zero3, consolidated, loaded by from_pretrained -------------------


def _llama_train_save_consolidate(ckpt: str, out: str) -> dict[str, Any]:
    from zero3.testing.hf_models import build_hf, tokens

    comm = GlooBackend(timeout_s=60)
    n, r = comm.world_size, comm.rank
    model = build_hf("llama")
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        ids = tokens(4, step)[2 * r : 2 * (r + 1)]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(ckpt, model, opt)
    model.eval()
    probe = tokens(3, 99)
    with torch.no_grad():
        sharded = model(input_ids=probe).logits
    result: dict[str, Any] = {"n": n}
    if r == 0:
        from transformers import AutoModelForCausalLM

        files = consolidate_checkpoint(ckpt, out, max_shard_size="40KB")
        hf = AutoModelForCausalLM.from_pretrained(out)
        hf.eval()
        with torch.no_grad():
            result["diff"] = (hf(input_ids=probe).logits - sharded).abs().max().item()
        result["files"] = sorted(p.name for p in files)
        result["class"] = type(hf).__name__
    return result


@pytest.mark.transformers
def test_llama_consolidated_loads_with_from_pretrained(worker_pool, tmp_path):
    result = worker_pool(2).run(
        _llama_train_save_consolidate, str(tmp_path / "ckpt"), str(tmp_path / "hf"), timeout=300
    )[0]
    assert result["class"] == "LlamaForCausalLM"
    assert result["diff"] < 1e-5, result
    assert "model.safetensors.index.json" in result["files"]
    assert "config.json" in result["files"]
    assert sum(f.endswith(".safetensors") for f in result["files"]) > 1
