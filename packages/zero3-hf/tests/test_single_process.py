"""zero3-hf in one process: the DeepSpeed config filling, the warnings, the refusals,
and a world-of-one Zero3Trainer that trains exactly like the stock Trainer.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

from zero3.core import Zero3Config
from zero3.hf import Zero3Trainer
from zero3.hf._deepspeed import (
    check_scheduler_steps,
    fill_from_training_args,
    warn_unused_sections,
)
from zero3.hooks import shard_module
from zero3.testing.hf_models import build_hf, lm_rows, trainer_arguments

pytestmark = pytest.mark.transformers

DS_JSON = Path(__file__).resolve().parents[2] / "zero3-core" / "tests" / "data"
TRANSFORMERS_ZERO3 = json.loads((DS_JSON / "transformers_zero3.json").read_text())


def _args(tmp_path: Path, **overrides: object) -> TrainingArguments:
    return trainer_arguments(tmp_path, **overrides)


def _data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    return lm_rows(n, 1)


# -- filling "auto" ----------------------------------------------------------------------


def test_every_auto_is_filled_as_transformers_fills_it(tmp_path):
    args = _args(tmp_path, bf16=True)
    filled = fill_from_training_args(TRANSFORMERS_ZERO3, args, build_hf("gpt2"))
    assert filled["train_micro_batch_size_per_gpu"] == 2
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 1 * 2 * 2
    assert filled["gradient_clipping"] == 1.0
    assert filled["optimizer"]["params"] == {
        "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1,
    }  # fmt: skip
    assert filled["scheduler"]["params"]["warmup_min_lr"] == 0
    assert filled["scheduler"]["params"]["warmup_max_lr"] == 1e-2
    assert filled["scheduler"]["params"]["warmup_num_steps"] == "auto"  # needs the step count
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    zero = filled["zero_optimization"]
    assert zero["reduce_bucket_size"] == 32 * 32  # hidden_size**2
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert zero["stage3_param_persistence_threshold"] == 10 * 32
    assert TRANSFORMERS_ZERO3["train_batch_size"] == "auto"  # the input is not modified


def test_values_that_contradict_the_arguments_are_listed_in_one_error(tmp_path):
    config = copy.deepcopy(TRANSFORMERS_ZERO3)
    config["gradient_accumulation_steps"] = 4
    config["optimizer"]["params"]["lr"] = 3e-4
    config["bf16"]["enabled"] = True
    with pytest.raises(ValueError, match="mismatch TrainingArguments") as info:
        fill_from_training_args(config, _args(tmp_path), build_hf("gpt2"))
    message = str(info.value)
    assert "ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2" in message
    assert "ds optimizer.params.lr=0.0003 vs hf learning_rate=0.01" in message
    assert "ds bf16.enabled=True vs hf bf16|bf16_full_eval=False" in message


def test_scheduler_step_counts_are_checked_when_the_scheduler_is_built(tmp_path):
    config = copy.deepcopy(TRANSFORMERS_ZERO3)
    config["scheduler"]["params"]["warmup_num_steps"] = 5
    with pytest.raises(ValueError, match=r"ds scheduler\.params\.warmup_num_steps=5 vs hf"):
        check_scheduler_steps(config, _args(tmp_path), num_training_steps=10)
    config["scheduler"]["params"]["warmup_num_steps"] = 2
    check_scheduler_steps(config, _args(tmp_path), num_training_steps=10)


def test_a_model_without_hidden_size_cannot_fill_the_bucket_sizes(tmp_path):
    with pytest.raises(ValueError, match="neither `hidden_size` nor `hidden_sizes`"):
        fill_from_training_args(TRANSFORMERS_ZERO3, _args(tmp_path), torch.nn.Linear(2, 2))


def test_sections_asking_for_something_else_are_logged_with_what_is_used(tmp_path, caplog):
    config = {
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-2, "max_coeff": 10.0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}},
    }
    with caplog.at_level(logging.WARNING, logger="zero3.hf"):
        warn_unused_sections(config, _args(tmp_path), torch.optim.AdamW)
    text = caplog.text
    assert "optimizer.type 'Lamb' is not used" in text
    assert "torch.optim.adamw.AdamW (optim='adamw_torch_fused'" in text
    assert "optimizer.params ['max_coeff'] are not used" in text
    assert "scheduler" not in text  # WarmupDecayLR with a linear warmup is the "linear" one
    caplog.clear()
    config = {"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupCosineLR"}}
    with caplog.at_level(logging.WARNING, logger="zero3.hf"):
        warn_unused_sections(config, _args(tmp_path), torch.optim.AdamW)
    assert "optimizer" not in caplog.text  # DeepSpeed's Adam is AdamW by default
    assert "scheduler.type 'WarmupCosineLR' (warmup_type 'log') is not used" in caplog.text


# -- the Trainer, world of one -------------------------------------------------------------


def test_a_world_of_one_trains_like_the_stock_trainer(tmp_path):
    data = _data()
    stock = Trainer(model=build_hf("llama"), args=_args(tmp_path / "a"), train_dataset=data)
    stock.train()
    zero3 = Zero3Trainer(model=build_hf("llama"), args=_args(tmp_path / "b"), train_dataset=data)
    zero3.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (stock, zero3)]
    assert losses[0] == losses[1]
    for (name, a), b in zip(stock.model.state_dict().items(), zero3.model.state_dict().values(),
                            strict=True):  # fmt: skip
        # the global norm for clipping is summed in another order: rounding differs
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="torch_compile=True"):
        Zero3Trainer(model=build_hf("gpt2"), args=_args(tmp_path, torch_compile=True))
    model = build_hf("gpt2")
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"must hold a zero3\.optim\.PartitionedOptimizer"):
        Zero3Trainer(model=model, args=_args(tmp_path), optimizers=(plain, None))
    with pytest.raises(ValueError, match=r"param_dtype is torch\.float16 but the TrainingArgument"):
        Zero3Trainer(model=build_hf("gpt2"), args=_args(tmp_path, bf16=True),
                     zero3_config=Zero3Config(param_dtype="fp16"))  # fmt: skip
    with pytest.raises(ValueError, match=r"gradient_clipping is 0\.5 but .*max_grad_norm is 1\.0"):
        Zero3Trainer(model=build_hf("gpt2"), args=_args(tmp_path),
                     zero3_config=Zero3Config(gradient_clipping=0.5))  # fmt: skip
    sharded = shard_module(build_hf("gpt2"), Zero3Config())
    with pytest.raises(ValueError, match="already sharded with its own Zero3Config"):
        Zero3Trainer(model=sharded, args=_args(tmp_path), zero3_config=Zero3Config())
    with torch.device("meta"):
        meta = build_hf("gpt2")
    with pytest.raises(ValueError, match="parameters on the meta device; shard it first"):
        Zero3Trainer(model=meta, args=_args(tmp_path))


def test_the_trainers_optimizer_choice_and_groups_are_kept(tmp_path):
    trainer = Zero3Trainer(
        model=build_hf("gpt2"),
        args=_args(tmp_path, max_steps=1),
        train_dataset=_data(),
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    )
    trainer.train()
    inner = trainer.partitioned_optimizer.optimizer
    assert type(inner) is torch.optim.SGD and inner.defaults["momentum"] == 0.9
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    assert [g["weight_decay"] for g in inner.param_groups] == [0.1, 0.0]
    named = [n for n, _ in trainer.model.named_parameters()]  # tied weights once
    assert len(inner.param_groups[0]["params"]) == len([n for n in named if n in decay])
    assert trainer.model_wrapped is trainer.model


def test_save_only_model_checkpoints_are_loadable_weights(tmp_path):
    trainer = Zero3Trainer(
        model=build_hf("gpt2"),
        args=_args(
            tmp_path,
            max_steps=4,
            eval_strategy="steps",
            eval_steps=2,
            save_steps=2,
            save_strategy="steps",
            save_only_model=True,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
        ),
        train_dataset=_data(),
        eval_dataset=_data(8),
    )
    trainer.train()  # reloads the best checkpoint's consolidated weights at the end
    best = Path(trainer.state.best_model_checkpoint)
    assert {"model.safetensors", "config.json"} <= {p.name for p in best.iterdir()}
    assert not (best / "zero3").exists()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric, rel=1e-6)
    with pytest.raises(ValueError, match="no zero3 checkpoint in"):
        trainer.train(resume_from_checkpoint=str(best))
