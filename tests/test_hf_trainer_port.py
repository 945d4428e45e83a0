"""A DeepSpeed + transformers script ported to Zero3Trainer, at world 2 under torchrun.

The ``TrainingArguments(deepspeed=...)`` line is kept, checkpoint folders load with
``from_pretrained`` when the config asks for 16-bit weights on save, the tokenizer travels
with the weights, and DeepSpeed settings zero3 does not honour are warnings on rank 0.
Like ``tests/test_hf_trainer.py``, the file is also the script torchrun runs (``torchrun
tests/test_hf_trainer_port.py OUT``): one launch runs every check, rank 0 writes JSON.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.transformers

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DS_JSON = ROOT / "packages" / "zero3-core" / "tests" / "data" / "transformers_zero3.json"
LAUNCH_TIMEOUT_S = 420


# -- the torchrun side ------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from zero3.testing.hf_models import VOCAB

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def _trainer(out: Path, args: Any = None, **kwargs: Any) -> Any:
    from transformers import default_data_collator

    from zero3.hf import Zero3Trainer
    from zero3.testing.hf_models import build_hf, lm_rows, trainer_arguments

    return Zero3Trainer(
        model=build_hf("gpt2"),
        args=args if args is not None else trainer_arguments(out, max_steps=4),
        train_dataset=lm_rows(32, 1),
        data_collator=default_data_collator,
        processing_class=_tokenizer(),
        **kwargs,
    )


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _deepspeed_argument(out: Path) -> dict[str, Any]:
    """``deepspeed=`` kept in the arguments, against the same JSON as ``zero3_config``."""
    from zero3.hf import Zero3TrainingArguments
    from zero3.testing.hf_models import trainer_arguments

    reference = _trainer(out / "ref", zero3_config=str(DS_JSON))
    reference.train()
    settings = dict(output_dir=str(out / "kept"), use_cpu=True, report_to=[], max_steps=4,
                    per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_grad_norm=1.0, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2,
                    lr_scheduler_type="linear", seed=0, logging_steps=1, save_strategy="no",
                    disable_tqdm=True, deepspeed=str(DS_JSON))  # fmt: skip
    kept = _trainer(out / "kept", Zero3TrainingArguments(**settings))
    kept.train()
    # TrainingArguments(deepspeed=...) as DeepSpeed users build them (here without
    # DeepSpeed installed, so the value is set after construction).
    plain = trainer_arguments(out / "plain", max_steps=4)
    plain.deepspeed = str(DS_JSON)
    taken = _trainer(out / "plain", plain)
    taken.train()
    try:
        _trainer(out / "twice", plain, zero3_config=str(DS_JSON))
        twice = "no error"
    except ValueError as exc:
        twice = str(exc)
    return {
        "reference": _losses(reference),
        "kept": _losses(kept),
        "taken": _losses(taken),
        "thresholds": [t.zero3_config.param_persistence_threshold for t in (kept, taken)],
        "args_deepspeed": [kept.args.deepspeed, taken.args.deepspeed, plain.deepspeed],
        "twice": twice,
    }


def _checkpoint_folders(out: Path) -> dict[str, Any]:
    """checkpoint-N with and without ``stage3_gather_16bit_weights_on_model_save``."""
    import transformers

    from zero3.hooks import full_state_dict
    from zero3.testing.hf_models import trainer_arguments

    config = json.loads(DS_JSON.read_text())  # asks for the weights on save
    runs = {}
    for name, gather in (("gather", True), ("nogather", False)):
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
        args = trainer_arguments(out / name, max_steps=4, save_strategy="steps", save_steps=4)
        run = _trainer(out / name, args, zero3_config=config)
        run.train()
        runs[name] = full_state_dict(run.model)
    result: dict[str, Any] = {}
    if int(os.environ["RANK"]) == 0:
        folder = out / "gather" / "checkpoint-4"
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        result["gather"] = {
            "files": sorted(p.name for p in folder.iterdir()),
            "weight_diff": max(
                float((v - runs["gather"][k]).abs().max()) for k, v in model.state_dict().items()
            ),
            "tokens": tokenizer("w3 w5").input_ids,
        }
        result["nogather"] = sorted(p.name for p in (out / "nogather" / "checkpoint-4").iterdir())
        exported = out / "exported"
        command = [str(BIN / "zero3-consolidate"), str(out / "nogather" / "checkpoint-4")]
        cli = subprocess.run([*command, str(exported)], capture_output=True, text=True, check=False)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
        result["consolidated"] = {
            "code": cli.returncode,
            "files": sorted(p.name for p in exported.iterdir()),
            "tokens": transformers.AutoTokenizer.from_pretrained(exported)("w3 w5").input_ids,
            "weight_diff": max(
                float((v - runs["nogather"][k].to(v.dtype)).abs().max())
                for k, v in reloaded.state_dict().items()
            ),
        }
    return result


def main() -> None:
    import torch.distributed as dist

    out = Path(sys.argv[1])
    records = _Records()
    for name in ("zero3.core", "zero3.hf"):
        logging.getLogger(name).addHandler(records)
    result = {"deepspeed": _deepspeed_argument(out), "checkpoints": _checkpoint_folders(out)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records.messages)
    result["warnings"] = gathered
    if int(os.environ["RANK"]) == 0:
        (out / "port.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the pytest side ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("port")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", __file__, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                          check=False)  # fmt: skip
    path = out / "port.json"
    assert proc.returncode == 0 and path.exists(), proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_training_arguments_deepspeed_is_taken_as_the_zero3_config(port):
    r = port["deepspeed"]
    assert len(r["reference"]) == 4
    assert r["kept"] == pytest.approx(r["reference"], rel=1e-6, abs=1e-7)
    assert r["taken"] == pytest.approx(r["reference"], rel=1e-6, abs=1e-7)
    assert r["thresholds"] == [320, 320]  # "auto" filled from the model: the JSON was read
    # The trainers' arguments say no DeepSpeed; the caller's keep their value.
    assert r["args_deepspeed"] == [None, None, str(DS_JSON)]
    assert "given twice" in r["twice"] and "keep one" in r["twice"], r["twice"]


def test_checkpoint_folders_load_with_from_pretrained_when_the_config_asks(port):
    r = port["checkpoints"]["gather"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "zero3"} <= set(r["files"])
    assert r["weight_diff"] == 0.0
    assert r["tokens"] == [3, 5]
    plain = port["checkpoints"]["nogather"]
    assert {"config.json", "tokenizer.json", "zero3"} <= set(plain)
    assert "model.safetensors" not in plain  # as DeepSpeed: weights only when asked


def test_zero3_consolidate_writes_the_tokenizer_beside_the_weights(port):
    r = port["checkpoints"]["consolidated"]
    assert r["code"] == 0
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(r["files"])
    assert r["tokens"] == [3, 5] and r["weight_diff"] == 0.0


def test_offload_settings_leave_no_warning_on_any_rank(port):
    rank0, rank1 = port["warnings"]
    # offload_param is honoured now (cpu on a CPU run: nothing moves, said at INFO).
    assert not [m for m in rank0 if "offload_param" in m], rank0
    assert rank1 == [], rank1


if __name__ == "__main__":
    main()
