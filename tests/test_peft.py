"""Adapters (peft) on a sharded base: adoption, training parity, saving and loading.

The base is sharded first (the big-model flow), then peft adds its adapters; every case
compares with one process running peft on ``from_pretrained``-equal weights.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from zero3.comm import GlooBackend
from zero3.core import Zero3Config, gathered_parameters
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer

pytest.importorskip("peft", reason="peft is not installed (zero3-hf's optional 'hf' extra)")

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft_config(kind: str) -> Any:
    from peft import IA3Config, LoraConfig

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


def _lora_training(kind: str, threshold: int, dtype: str) -> dict[str, Any]:
    from zero3.testing.hf_models import build_hf, tokens

    comm = GlooBackend(timeout_s=60)
    n, r = comm.world_size, comm.rank
    base = build_hf("llama")
    if dtype == "bf16":
        base.to(torch.bfloat16)
    reference = _wrap(copy.deepcopy(base), kind, seed=100)
    model = shard_module(base, Zero3Config(param_persistence_threshold=threshold), comm=comm)
    # Ranks seeded differently: adoption broadcasts rank 0's adapters (seed 100).
    peft_model = _wrap(model, kind, seed=100 + r)
    opt = PartitionedOptimizer(peft_model, torch.optim.AdamW, lr=1e-2)
    ropt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    start = _trainable(peft_model)
    diffs, reduced = [], []
    for step in range(3):
        ids = tokens(2 * n, step)
        loss = peft_model(input_ids=ids[2 * r : 2 * r + 2], labels=ids[2 * r : 2 * r + 2]).loss
        loss.backward()
        opt.step()
        peft_model.zero_grad()  # what the Trainer calls: on the PeftModel, not the base
        s = stats(peft_model)
        reduced.append(s.reduce_payload_bytes)
        refs = [
            reference(input_ids=ids[2 * q : 2 * q + 2], labels=ids[2 * q : 2 * q + 2]).loss
            for q in range(n)
        ]
        ref = sum(refs) / n
        ref.backward()
        ropt.step()
        ropt.zero_grad()
        mean = loss.detach().float().clone()
        comm.all_reduce(mean).wait()
        diffs.append(abs(float(mean) / n - float(ref)))
    end = _trainable(peft_model)
    ref_end = {
        n.replace(".base_layer", ""): p.detach()
        for n, p in reference.named_parameters()
        if p.requires_grad
    }
    off = max((end[k].float() - ref_end[k].float()).abs().max().item() for k in ref_end)
    moved = max((end[k].float() - start[k].float()).abs().max().item() for k in end)
    trainable_bytes = sum(p.numel() * p.element_size() for p in end.values())
    return {
        "loss": max(diffs),
        "off": off,
        "moved": moved,
        "same_keys": sorted(end) == sorted(ref_end),
        "reduced": reduced,
        "trainable_bytes": trainable_bytes,
        "gathers": stats(peft_model).gathers,
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["lora", "lora_save", "ia3"])
def test_adapters_added_after_sharding_train_like_one_process(worker_pool, kind, world):
    for result in worker_pool(world).run(_lora_training, kind, 0, "fp32", timeout=240):
        assert result["same_keys"], result
        assert result["moved"] > 1e-3, result
        assert result["loss"] < 1e-5, result
        assert result["off"] < 1e-5, result
        assert result["gathers"] > 0


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
    return {
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
        keys = result["saved_keys"]
        assert keys and all("lora_" in k or "lm_head" in k for k in keys), keys
    assert (tmp_path / "adapter_config.json").exists()
