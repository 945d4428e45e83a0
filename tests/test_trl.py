"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer on zero3 (``zero3_trainer``) at world 2,
against the same TRL trainer under DDP in the same processes.

Tiny models are built from configs and saved to a directory first (DPO and GRPO build
their reference model from the policy's path); the tokenizer is a word-level one made in
memory; GRPO generates with transformers' ``generate`` (no vLLM) and a toy reward.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]

STEPS = 3


def _quiet() -> None:
    # No hub, no telemetry: TRL pings the hub from rank 0 unless told not to.
    # The pool's ranks already share a process group; accelerate still reads the address.
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    import transformers

    transformers.logging.set_verbosity_error()


def _common(out: Path) -> dict[str, Any]:
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        bf16=False,
        disable_tqdm=True,
    )


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _pair(cls: Any, make_args: Any, tmp: str, **kwargs: Any) -> dict[str, Any]:
    """Train the stock ``cls`` (DDP) and its zero3 version on the same data; their logs."""
    import torch
    from transformers import AutoModelForCausalLM

    from zero3.core import Zero3Config
    from zero3.core.engine import try_sharded_state
    from zero3.hf import zero3_trainer
    from zero3.hooks import stats
    from zero3.testing.hf_models import save_tiny, tiny_tokenizer

    path = Path(tmp) / "model"
    if torch.distributed.get_rank() == 0:  # save_pretrained writes on rank 0 only
        save_tiny("gpt2", path)
    torch.distributed.barrier()
    common = dict(processing_class=tiny_tokenizer(), **kwargs)
    ddp = cls(model=AutoModelForCausalLM.from_pretrained(path), args=make_args("ddp"), **common)
    ddp.train()
    z3 = zero3_trainer(cls)(
        model=AutoModelForCausalLM.from_pretrained(path),
        args=make_args("z3"),
        zero3_config=Zero3Config(param_persistence_threshold=0),
        **common,
    )
    z3.train()
    ref = getattr(z3, "ref_model", None)
    return {
        "ddp": _losses(ddp),
        "z3": _losses(z3),
        "logs": [h for h in z3.state.log_history if "loss" in h],
        "ddp_logs": [h for h in ddp.state.log_history if "loss" in h],
        "ddp_wrapped": type(ddp.model_wrapped).__name__,
        "z3_wrapped": z3.model_wrapped is z3.model,
        "gathers": stats(z3.model).gathers,
        "ref_sharded": ref is not None and try_sharded_state(ref) is not None,
        "blocks": try_sharded_state(z3.model).unsharded_blocks,  # type: ignore[union-attr]
    }


def _sft(tmp: str) -> dict[str, Any]:
    _quiet()
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from zero3.testing.hf_models import words

    data = Dataset.from_dict({"text": [words(8, s) for s in range(24)]})
    return _pair(
        SFTTrainer,
        lambda tag: SFTConfig(**_common(Path(tmp) / tag), max_length=16),
        tmp,
        train_dataset=data,
    )


def _dpo(tmp: str) -> dict[str, Any]:
    _quiet()
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from zero3.testing.hf_models import words

    rows = range(24)
    data = Dataset.from_dict(
        {
            "prompt": [words(4, s) for s in rows],
            "chosen": [words(5, 100 + s) for s in rows],
            "rejected": [words(5, 200 + s) for s in rows],
        }
    )
    return _pair(
        DPOTrainer,
        lambda tag: DPOConfig(**_common(Path(tmp) / tag), max_length=16, beta=0.1),
        tmp,
        train_dataset=data,
    )


def _reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A toy reward: the share of words with an even id."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in str(text).split() if w.startswith("w") and w[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(1, len(ids)))
    return out


def _grpo(tmp: str) -> dict[str, Any]:
    _quiet()
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from zero3.testing.hf_models import words

    data = Dataset.from_dict({"prompt": [words(4, s) for s in range(24)]})
    return _pair(
        GRPOTrainer,
        lambda tag: GRPOConfig(
            **_common(Path(tmp) / tag),
            num_generations=2,
            max_completion_length=6,
            beta=0.1,  # a reference model, sharded too
        ),
        tmp,
        train_dataset=data,
        reward_funcs=_reward,
    )


@pytest.mark.parametrize("case", ["sft", "dpo"])
def test_sft_and_dpo_losses_equal_ddp(worker_pool, tmp_path, case):
    fn = {"sft": _sft, "dpo": _dpo}[case]
    for r in worker_pool(2).run(fn, str(tmp_path), timeout=300):
        assert len(r["z3"]) == STEPS, r
        assert r["z3"] == pytest.approx(r["ddp"], rel=1e-5, abs=1e-6), r
        assert r["ddp_wrapped"] == "DistributedDataParallel" and r["z3_wrapped"], r
        assert r["gathers"] > 0, r
        if case == "dpo":
            assert r["ref_sharded"], r


def test_grpo_runs_with_sharded_rollouts_and_reference(worker_pool, tmp_path):
    """The rollouts are sampled: both runs draw from the same RNG state with logits equal
    to float rounding (~1e-7), so they sample the same completions (their rewards are
    equal) and the losses then differ by rounding only; 1e-6 absolute on losses of
    ~1e-3 leaves room for that, and a different completion would miss it by far.
    """
    for r in worker_pool(2).run(_grpo, str(tmp_path), timeout=300):
        assert len(r["z3"]) == STEPS, r
        assert r["ref_sharded"] and r["blocks"] >= STEPS and r["gathers"] > 0, r
        assert [h["reward"] for h in r["logs"]] == [h["reward"] for h in r["ddp_logs"]], r
        assert r["z3"] == pytest.approx(r["ddp"], rel=1e-4, abs=1e-6), r


def _predict_with_generate(tmp: str) -> dict[str, Any]:
    """``Seq2SeqTrainer(predict_with_generate=True)`` passes ``synced_gpus=False`` for a
    model it does not know is sharded; zero3's generate syncs the ranks anyway.
    """
    _quiet()
    import torch
    from transformers import AutoModelForCausalLM, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from zero3.core import Zero3Config
    from zero3.core.engine import try_sharded_state
    from zero3.hf import zero3_trainer
    from zero3.testing.hf_models import EOS, lm_rows, save_tiny

    path = Path(tmp) / "model"
    if torch.distributed.get_rank() == 0:
        save_tiny("gpt2", path)
    torch.distributed.barrier()
    rows = [{"input_ids": r["input_ids"][:5], "labels": r["input_ids"][:5]} for r in lm_rows(6, 3)]

    def args(tag: str) -> Any:
        return Seq2SeqTrainingArguments(
            **_common(Path(tmp) / tag), predict_with_generate=True, per_device_eval_batch_size=1
        )

    def model() -> Any:
        m = AutoModelForCausalLM.from_pretrained(path)
        m.generation_config.max_new_tokens = 8
        m.generation_config.eos_token_id = EOS
        return m

    ddp = Seq2SeqTrainer(model=model(), args=args("ddp"))
    want = ddp.predict(rows).predictions
    z3 = zero3_trainer(Seq2SeqTrainer)(
        model=model(), args=args("z3"), zero3_config=Zero3Config(param_persistence_threshold=0)
    )
    got = z3.predict(rows).predictions
    return {
        "equal": bool((torch.as_tensor(want) == torch.as_tensor(got)).all()),
        "shape": [list(want.shape), list(got.shape)],
        "blocks": try_sharded_state(z3.model).unsharded_blocks,  # type: ignore[union-attr]
    }


def test_zero3_trainer_predict_with_generate_syncs_ranks(worker_pool, tmp_path):
    for r in worker_pool(2).run(_predict_with_generate, str(tmp_path), timeout=300):
        assert r["equal"] and r["shape"][0] == r["shape"][1], r
        assert r["blocks"] > 0, r
