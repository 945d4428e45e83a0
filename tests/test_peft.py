"""Adapters (peft) on a sharded base: adoption, training parity, saving and loading.

The base is sharded first (the big-model flow), then peft adds its adapters; prompt and
prefix tuning, whose prompt encoder sits on the PeftModel beside the base, are built first
and sharded whole. Every case compares with one process running peft on
``from_pretrained``-equal weights.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from zero3.comm import GlooBackend
from zero3.core import (
    Zero3Config,
    gathered_parameters,
    load_sharded_state_dict,
    sharded_state_dict,
)
from zero3.core.engine import sharded_param
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer

pytest.importorskip("peft", reason="peft is not installed (zero3-hf's optional 'hf' extra)")

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft_config(kind: str) -> Any:
    from peft import IA3Config, LoraConfig, PrefixTuningConfig, PromptTuningConfig

    if kind == "lora":
        return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    if kind == "lora_save":
        return LoraConfig(
            r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, modules_to_save=["lm_head"]
        )
    if kind == "ia3":
        return IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        )
    if kind == "prompt":  # peft calls the word embeddings outside the base's forward
        return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    if kind == "prefix":  # past key/values made outside the base, fed to every layer
        return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    raise ValueError(kind)


def _wrap(model: torch.nn.Module, kind: str, seed: int) -> Any:
    """peft's adapters on ``model``, their initial values drawn from ``seed``."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, _peft_config(kind))
    if kind.startswith("lora"):  # LoRA starts at B = 0: give B values so every adapter matters
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return peft_model


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with gathered_parameters(list(model.parameters())):
        return {
            n.replace(".base_layer", ""): p.detach().clone()
            for n, p in model.named_parameters()
            if p.requires_grad
        }


def _lora_training(
    kind: str, threshold: int, dtype: str, comm: Any = None, **config: Any
) -> dict[str, Any]:
    from zero3.testing.hf_models import build_hf, tokens

    comm = comm or GlooBackend(timeout_s=60)
    n, r = comm.world_size, comm.rank
    first, kind = kind.endswith("_first"), kind.removesuffix("_first")
    base = build_hf("llama")
    if dtype == "bf16":
        base.to(torch.bfloat16)  # peft keeps its adapters in fp32 (autocast_adapter_dtype)
    reference = _wrap(copy.deepcopy(base), kind, seed=100)
    settings = Zero3Config(param_persistence_threshold=threshold, **config)
    if first:  # the PeftModel built first and sharded whole
        peft_model = model = shard_module(_wrap(base, kind, seed=100), settings, comm=comm)
    else:
        model = shard_module(base, settings, comm=comm)
        # Ranks seeded differently: adoption broadcasts rank 0's adapters (seed 100).
        peft_model = _wrap(model, kind, seed=100 + r)
    opt = PartitionedOptimizer(peft_model, torch.optim.AdamW, lr=1e-2)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ropt = torch.optim.AdamW(trainable, lr=1e-2)
    start = _trainable(peft_model)
    diffs, reduced, backward_gathered, forward_gathered = [], [], [], []
    for step in range(3):
        ids = tokens(2 * n, step)
        loss = peft_model(input_ids=ids[2 * r : 2 * r + 2], labels=ids[2 * r : 2 * r + 2]).loss
        loss.backward()
        opt.step()
        peft_model.zero_grad()  # what the Trainer calls: on the PeftModel, not the base
        s = stats(peft_model)
        reduced.append(s.reduce_payload_bytes)
        backward_gathered.append(s.backward_gathered_numel)
        forward_gathered.append(s.forward_gathered_numel)
        # The ranks' arithmetic: one backward per rank's rows, then the mean of their
        # gradients (in bf16 a different summation order flips the base's rounding).
        refs, grads = [], []
        for q in range(n):
            rows = ids[2 * q : 2 * q + 2]
            refs.append(reference(input_ids=rows, labels=rows).loss)
            refs[-1].backward()
            grads.append([p.grad.clone() for p in trainable])
            ropt.zero_grad()
        for j, p in enumerate(trainable):
            p.grad = functools.reduce(torch.add, [g[j] for g in grads]) / n
        ref = sum(r.detach() for r in refs) / n
        ropt.step()
        ropt.zero_grad()
        mean = loss.detach().float().clone()
        comm.all_reduce(mean).wait()
        diffs.append(abs(float(mean) / n - float(ref)))
    end = _trainable(peft_model)
    reloaded = None
    if config.get("frozen_params") == "replicate":
        # A DCP-style load writes the shards (in place) while frozen weights are whole:
        # their copies are dropped and gathered afresh, never read stale.
        ids = tokens(2, 77)
        with torch.no_grad():
            before = peft_model(input_ids=ids).logits
            state = sharded_state_dict(model)
            for key, value in state.items():
                if "lora_" not in key and isinstance(value, ShardedTensor):
                    for shard in value.local_shards():
                        shard.tensor.mul_(0.5)  # what a load of other values would do
            load_sharded_state_dict(model, state)
            after = peft_model(input_ids=ids).logits
            # The same through nn.Module.load_state_dict (frozen entries are ShardedTensors).
            whole = model.state_dict()
            for key, value in whole.items():
                if "lora_" not in key and isinstance(value, ShardedTensor):
                    for shard in value.local_shards():
                        shard.tensor.mul_(2.0)  # back to the trained values
            model.load_state_dict(whole)
            back = peft_model(input_ids=ids).logits
        reloaded = [(after - before).abs().max().item(), (back - before).abs().max().item()]
    ref_end = {
        n.replace(".base_layer", ""): p.detach()
        for n, p in reference.named_parameters()
        if p.requires_grad
    }
    off = max((end[k].float() - ref_end[k].float()).abs().max().item() for k in ref_end)
    moved = max((end[k].float() - start[k].float()).abs().max().item() for k in end)
    trainable_bytes = sum(p.numel() * p.element_size() for p in end.values())
    dtypes = sorted({str(p.dtype) for p in peft_model.parameters() if p.requires_grad})
    return {
        "adapter_dtypes": dtypes,
        "reloaded": reloaded,
        "backward_gathered": backward_gathered,
        "forward_gathered": forward_gathered,
        "loss": max(diffs),
        "diffs": diffs,
        "off": off,
        "moved": moved,
        "same_keys": sorted(end) == sorted(ref_end),
        "reduced": reduced,
        "trainable_bytes": trainable_bytes,
        "gathers": stats(peft_model).gathers,
        "adapters_whole": all(
            sharded_param(p).persistent for p in peft_model.parameters() if p.requires_grad
        ),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["lora", "lora_save", "ia3", "prompt_first", "prefix_first"])
def test_adapters_on_a_sharded_base_train_like_one_process(worker_pool, kind, world):
    for result in worker_pool(world).run(_lora_training, kind, 0, "fp32", timeout=240):
        assert result["same_keys"], result
        assert result["moved"] > 1e-3, result
        assert result["loss"] < 1e-5, result
        assert result["off"] < 1e-5, result
        assert result["gathers"] > 0
        # Frozen weights get no gradient, no reduction, no optimizer state: what is
        # reduced each step is the adapters' gradients (fp32), nothing of the base.
        assert result["reduced"] == [result["trainable_bytes"]] * 3, result


def test_adapters_on_a_base_offloaded_by_one_process_train_like_it(worker_pool, tmp_path):
    """One process with its base's parameters in a swap file (each fetched for its
    module): adapters added after sharding are not offloaded, so alone they stay whole
    (a shard in memory beside a gathered copy would hold them twice).
    """
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    (result,) = worker_pool(1).run(
        _lora_training, "lora", 0, "fp32", offload_param=offload, timeout=240
    )
    assert result["same_keys"] and result["moved"] > 1e-3, result
    assert result["loss"] < 1e-5 and result["off"] < 1e-5, result
    assert result["gathers"] > 0 and result["adapters_whole"], result


def _prompt_tuning_after_sharding() -> str:
    from peft import get_peft_model

    from zero3.testing.hf_models import build_hf

    settings = Zero3Config(param_persistence_threshold=0)
    model = shard_module(build_hf("llama"), settings, comm=GlooBackend(timeout_s=60))
    peft_model = get_peft_model(model, _peft_config("prompt"))
    try:
        PartitionedOptimizer(peft_model, torch.optim.AdamW, lr=1e-2)
    except ValueError as e:
        return str(e)
    return "built"


def test_prompt_tuning_on_a_sharded_base_is_refused_naming_the_fix(worker_pool):
    for message in worker_pool(2).run(_prompt_tuning_after_sharding, timeout=120):
        assert "'prompt_encoder.default.embedding.weight'" in message, message
        assert "outside the sharded model" in message, message
        assert "shard_module(peft.get_peft_model(model, config))" in message, message


def test_bf16_base_with_fp32_adapters_trains_like_one_process(worker_pool):
    """QLoRA's memory layout without quantization: a bf16 frozen base, fp32 adapters."""
    for result in worker_pool(2).run(_lora_training, "lora", 0, "bf16", timeout=240):
        assert result["adapter_dtypes"] == ["torch.float32"], result
        assert result["same_keys"] and result["moved"] > 1e-3, result
        # The first forward is bit for bit the one process's. Backward is not: even at
        # world 1 with nothing partitioned, zero3's hook nodes change the order of
        # autograd's bf16 arithmetic, and gradients agree to bf16 rounding only (about
        # 0.3% of the largest gradient, measured); Adam carries that into the adapters.
        assert result["diffs"][0] == 0.0, result
        assert result["loss"] < 2e-3, result
        assert result["off"] < 0.1 * result["moved"], result
        assert result["reduced"] == [result["trainable_bytes"]] * 3, result


def _frozen_options() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=60)
    # A window smaller than the tiny model, so that releasing between forward and
    # backward happens at all (auto would keep the whole tiny model gathered).
    window = dict(max_reuse_distance=0, max_live_parameters=4000, prefetch_bucket_size=2000)
    return {
        mode: _lora_training("lora", 0, "fp32", comm, frozen_params=mode, **window)
        for mode in ("regather", "keep", "replicate")
    }


def test_frozen_params_keep_gathers_the_base_once_per_step_and_replicate_never(worker_pool):
    for result in worker_pool(2).run(_frozen_options, timeout=240):
        regather, keep, replicate = result["regather"], result["keep"], result["replicate"]
        for r in (regather, keep, replicate):
            assert r["loss"] < 1e-5 and r["off"] < 1e-5 and r["moved"] > 1e-3, r
        # Backward gathers the frozen base again under "regather", not under "keep"
        # (its adapters were prefetched at the turn, or kept by reuse).
        assert min(regather["backward_gathered"]) > 0, regather
        assert max(keep["backward_gathered"]) < min(regather["backward_gathered"]) / 4, result
        assert keep["reduced"] == regather["reduced"] == replicate["reduced"], result
        # "replicate": after the first step only the (partitioned) adapters are gathered.
        adapters = replicate["trainable_bytes"] // 4
        assert replicate["forward_gathered"][0] > 4 * adapters, result
        later = replicate["forward_gathered"][1:] + replicate["backward_gathered"][1:]
        assert max(later) <= 2 * adapters, result  # their forward and backward uses
        halved, restored = replicate["reloaded"]
        assert halved > 1e-3 and restored < 1e-6, result  # what runs next is what was loaded


def _save_and_load(directory: str) -> dict[str, Any]:
    from peft import PeftModel
    from safetensors.torch import load_file

    from zero3.testing.hf_models import build_hf, tokens

    comm = GlooBackend(timeout_s=60)
    r = comm.rank
    config = Zero3Config(param_persistence_threshold=0)
    model = shard_module(build_hf("llama"), config, comm=comm)
    peft_model = _wrap(model, "lora_save", seed=100)
    opt = PartitionedOptimizer(peft_model, torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        ids = tokens(2, 10 * r + step)
        peft_model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trainable = sum(
        p.numel() * p.element_size() for p in peft_model.parameters() if p.requires_grad
    )
    whole = peft_model.state_dict()
    kinds = {
        type(v).__name__ for k, v in whole.items() if "lora_" not in k and "modules_to" not in k
    }
    before = stats(peft_model).gather_payload_bytes
    peft_model.save_pretrained(directory, is_main_process=r == 0)
    gathered = stats(peft_model).gather_payload_bytes - before
    comm.barrier().wait()
    saved = load_file(f"{directory}/adapter_model.safetensors")
    ids = tokens(2, 99)
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits
    # Into a plain model (every rank, one process each), and into a new sharded base.
    plain = PeftModel.from_pretrained(build_hf("llama"), directory)
    base2 = shard_module(build_hf("llama"), config, comm=comm)
    loaded = PeftModel.from_pretrained(base2, directory)
    with torch.no_grad():
        plain_logits = plain(input_ids=ids).logits
        loaded_logits = loaded(input_ids=ids).logits
    # merge_and_unload reads the released base weights: refused naming the fix; inside
    # gathered_parameters(..., modifier_rank=0) it merges, and the model stays sharded.
    try:
        loaded.merge_and_unload()
        refusal = ""
    except RuntimeError as exc:
        refusal = str(exc)
    with gathered_parameters(list(loaded.parameters()), modifier_rank=0):
        merged = loaded.merge_and_unload()
    plain_merged = plain.merge_and_unload()
    with torch.no_grad():
        merged_diff = (merged(input_ids=ids).logits - plain_merged(input_ids=ids).logits).abs()
    return {
        "refusal": refusal,
        "merged": merged_diff.max().item(),
        "merged_gathers": stats(merged).gathers,
        "merged_lora": [n for n, _ in merged.named_parameters() if "lora_" in n],
        "gathered": gathered,
        "trainable": trainable,
        "base": sum(p.numel() * p.element_size() for p in base2.parameters()),
        "base_kinds": sorted(kinds),
        "saved_keys": sorted(saved),
        "plain": (plain_logits - logits).abs().max().item(),
        "sharded": (loaded_logits - logits).abs().max().item(),
        "adopted": stats(loaded).gathers > 0,
    }


def test_adapters_save_small_and_load_into_plain_and_sharded_bases(worker_pool, tmp_path):
    results = worker_pool(2).run(_save_and_load, str(tmp_path), timeout=240)
    for result in results:
        assert result["plain"] < 1e-5 and result["sharded"] < 1e-5, result
        # Saving gathered the (sharded) adapters only, never the frozen base (peft reads
        # the whole state_dict, and the modules_to_save copy's own once more).
        assert 0 < result["gathered"] <= 2 * result["trainable"], result
        assert result["gathered"] < result["base"] / 3, result
        assert "ShardedTensor" in result["base_kinds"], result
        assert "gathered_parameters" in result["refusal"], result
        assert result["merged"] < 1e-5 and result["merged_gathers"] > 0, result
        assert result["merged_lora"] == [], result
        keys = result["saved_keys"]
        assert keys and all("lora_" in k or "lm_head" in k for k in keys), keys
    assert (tmp_path / "adapter_config.json").exists()


def _trainer_run(tmp: str) -> dict[str, Any]:
    import os

    from safetensors.torch import load_file

    from zero3.hf import Zero3Trainer
    from zero3.testing.hf_models import build_hf, lm_rows, trainer_arguments

    # The pool's ranks already share a process group; accelerate still reads the address.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")

    def trainer(out: str, **args: Any) -> Any:
        base = shard_module(build_hf("llama"), Zero3Config(param_persistence_threshold=0))
        model = _wrap(base, "lora", seed=100)
        settings = trainer_arguments(out, max_steps=4, **args)
        return Zero3Trainer(model=model, args=settings, train_dataset=lm_rows(32, 1))

    first = trainer(f"{tmp}/run", save_strategy="steps", save_steps=2)
    first.train()
    first.save_model(f"{tmp}/run/final")
    resumed = trainer(f"{tmp}/resumed")
    resumed.train(resume_from_checkpoint=f"{tmp}/run/checkpoint-2")
    resumed.save_model(f"{tmp}/resumed/final")
    a = load_file(f"{tmp}/run/final/adapter_model.safetensors")
    b = load_file(f"{tmp}/resumed/final/adapter_model.safetensors")

    def losses(t: Any) -> list[float]:
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    return {
        "checkpoint": sorted(os.listdir(f"{tmp}/run/checkpoint-2")),
        "final": sorted(os.listdir(f"{tmp}/run/final")),
        "losses": [losses(first)[-2:], losses(resumed)[-2:]],
        "resumed_diff": max((a[k] - b[k]).abs().max().item() for k in a),
        "same_keys": sorted(a) == sorted(b) and bool(a),
    }


def test_zero3_trainer_saves_adapters_in_checkpoints_and_resumes(worker_pool, tmp_path):
    """The stock Trainer's files for a PeftModel (adapters in checkpoint-N and in
    save_model), and a resume from checkpoint-2 that ends where the whole run ended."""
    from peft import PeftModel

    from zero3.testing.hf_models import build_hf

    for result in worker_pool(2).run(_trainer_run, str(tmp_path), timeout=300):
        for files in (result["checkpoint"], result["final"]):
            assert {"adapter_model.safetensors", "adapter_config.json"} <= set(files), result
        assert "model.safetensors" not in result["final"], result
        assert "zero3" in result["checkpoint"], result  # model + optimizer state, to resume
        assert result["losses"][0] == result["losses"][1], result
        assert result["same_keys"] and result["resumed_diff"] < 1e-6, result
    PeftModel.from_pretrained(build_hf("llama"), str(tmp_path / "run" / "final"))
