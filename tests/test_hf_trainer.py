"""Zero3Trainer at world 2 (and 3) under torchrun, against the stock Trainer under DDP.

The file is also the script torchrun runs (``torchrun tests/test_hf_trainer.py CASE
OUT``): each launch runs several checks in one process group and rank 0 writes their
results as JSON, so the tests share a few launches (importing torch and transformers
and meeting over gloo costs more than the tiny trainings do).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.transformers

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DS_JSON = ROOT / "packages" / "zero3-core" / "tests" / "data" / "transformers_zero3.json"
STEPS = 5
LAUNCH_TIMEOUT_S = 420  # a whole torchrun launch (imports, several tiny trainings)


# -- the torchrun side ------------------------------------------------------------------


def _data(n: int, seed: int) -> list[dict[str, Any]]:
    from zero3.testing.hf_models import lm_rows

    return lm_rows(n, seed)


def _args(out: Path, **overrides: Any) -> Any:
    """Accumulation 2, clipping 1.0, linear warmup, weight decay, a seed."""
    from zero3.testing.hf_models import trainer_arguments

    settings = {"per_device_eval_batch_size": 4, "max_steps": STEPS, **overrides}
    return trainer_arguments(out, **settings)


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _zero3(name: str, out: Path, data: Any, evals: Any = None, **overrides: Any) -> Any:
    from zero3.core import Zero3Config
    from zero3.hf import Zero3Trainer
    from zero3.testing.hf_models import build_hf

    config = overrides.pop("zero3_config", Zero3Config(param_persistence_threshold=0))
    return Zero3Trainer(
        model=build_hf(name),
        args=_args(out, **overrides),
        train_dataset=data,
        eval_dataset=evals,
        zero3_config=config,
    )


def _compare_with_ddp(name: str, out: Path) -> dict[str, Any]:
    import torch
    from transformers import Trainer

    from zero3.hooks import full_state_dict, stats
    from zero3.testing.hf_models import build_hf

    data, evals = _data(32, 1), _data(8, 2)
    ddp = Trainer(model=build_hf(name), args=_args(out / f"ddp-{name}"), train_dataset=data,
                  eval_dataset=evals)  # fmt: skip
    ddp.train()
    ddp_weights = {k: v.detach().clone() for k, v in ddp.model.state_dict().items()}
    ddp_eval = ddp.evaluate()["eval_loss"]
    ddp_pred = torch.as_tensor(ddp.predict(evals).predictions)

    z = _zero3(name, out / f"z3-{name}", data, evals)
    early_eval = z.evaluate()["eval_loss"]  # before training: no optimizer yet
    z.train()
    last = stats(z.model)
    weights = full_state_dict(z.model)
    z_pred = torch.as_tensor(z.predict(evals).predictions)
    return {
        "ddp_losses": _losses(ddp),
        "z3_losses": _losses(z),
        "weight_diff": _max_diff(weights, ddp_weights),
        "missing_keys": sorted(set(ddp_weights) - set(weights)),
        "ddp_wrapped": type(ddp.model_wrapped).__name__,
        "z3_wrapped": type(z.model_wrapped).__name__,
        "z3_model": type(z.model).__name__,
        "early_eval": early_eval,
        "eval": [ddp_eval, z.evaluate()["eval_loss"]],
        "pred_shapes": [list(ddp_pred.shape), list(z_pred.shape)],
        "pred_diff": float((ddp_pred - z_pred).abs().max()),
        "gathers": last.forward_gathers + last.backward_gathers,
        "reductions": last.reduce_collectives,
    }


def _case_parity(out: Path) -> dict[str, Any]:
    import torch
    import transformers

    from zero3.hooks import full_state_dict

    result: dict[str, Any] = {name: _compare_with_ddp(name, out) for name in ("gpt2", "llama")}
    data = _data(32, 1)

    gc = _zero3("gpt2", out / "gc", data, gradient_checkpointing=True)
    gc.train()
    result["checkpointing"] = {
        "losses": _losses(gc),
        "enabled": bool(gc.model.is_activation_checkpointing),
    }

    seen = _Warnings()
    logging.getLogger("zero3.hf").addHandler(seen)
    ds = _zero3("gpt2", out / "ds", data, zero3_config=str(DS_JSON))
    ds.train()
    config = ds.zero3_config
    result["deepspeed"] = {
        "losses": _losses(ds),
        "warnings": seen.messages,
        "param_persistence_threshold": config.param_persistence_threshold,
        "prefetch_bucket_size": config.prefetch_bucket_size,
        "reduce_bucket_size": config.reduce_bucket_size,
        "gradient_clipping": config.gradient_clipping,
        "train_batch_size": config.extras["train_batch_size"],
        "optimizer_params": config.extras["optimizer"]["params"],
    }
    # fp16 starts at a loss scale that overflows: those steps are skipped (and so is the
    # scheduler's step for them, as with DeepSpeed) until the scale has come down.
    fp16_config = json.loads(DS_JSON.read_text())
    fp16_config["fp16"].update(initial_scale_power=19, hysteresis=1)
    for precision, config in (("bf16", str(DS_JSON)), ("fp16", fp16_config)):
        run = _zero3("gpt2", out / precision, data, zero3_config=config, max_steps=4,
                     **{precision: True})  # fmt: skip
        run.train()
        opt = run.partitioned_optimizer
        result[precision] = {
            "dtype": str(next(run.model.parameters()).dtype),
            "losses": _losses(run),
            "loss_scaled": bool(opt.fp16),
            "master_dtype": str(opt.master_shards()[0].dtype),
            "skipped": opt.scaler.skipped_steps,
            "scheduler_steps": run.lr_scheduler.last_epoch,
        }

    # save_model: consolidated safetensors that from_pretrained loads
    saved = out / "saved"
    ds.save_model(str(saved))
    batch = torch.stack([row["input_ids"] for row in _data(4, 3)])
    with torch.no_grad():
        ds.model.eval()
        sharded_logits = ds.model(input_ids=batch).logits
    full = full_state_dict(ds.model)
    if int(os.environ["RANK"]) == 0:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
        with torch.no_grad():
            logits = reloaded(input_ids=batch).logits
        result["save_model"] = {
            "files": sorted(p.name for p in saved.iterdir()),
            "logit_diff": float((logits - sharded_logits).abs().max()),
            "weight_diff": _max_diff(reloaded.state_dict(), full),
        }
    return result


def _resume_args(world: int) -> dict[str, Any]:
    """Per-rank batches for a global batch of 6 at world 2 or 3, saves every 3 steps."""
    return dict(per_device_train_batch_size=6 // world, max_steps=6, save_strategy="steps",
                save_steps=3)  # fmt: skip


def _case_kill(out: Path) -> dict[str, Any]:
    """An uninterrupted run, then the same run killed after its step-3 checkpoint."""
    from transformers import TrainerCallback

    data = _data(48, 1)
    # Evaluated every 3 steps and reloading the best checkpoint at the end
    # (load_best_model_at_end): evaluation must not disturb training.
    full = _zero3("llama", out / "full", data, _data(8, 2), eval_strategy="steps", eval_steps=3,
                  load_best_model_at_end=True, metric_for_best_model="eval_loss",
                  **_resume_args(2))  # fmt: skip
    full.train()
    best = {"checkpoint": Path(full.state.best_model_checkpoint).name,
            "metric": full.state.best_metric, "after": full.evaluate()["eval_loss"]}  # fmt: skip
    if int(os.environ["RANK"]) == 0:
        (out / "kill.json").write_text(json.dumps({"losses": _losses(full), "best": best}))

    class Kill(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 4:
                os.kill(os.getpid(), signal.SIGKILL)

    killed = _zero3("llama", out / "killed", data, **_resume_args(2))
    killed.add_callback(Kill())
    killed.train()
    raise AssertionError("the run was not killed")


def _case_resume(out: Path, world: int) -> dict[str, Any]:
    data = _data(48, 1)
    run = _zero3("llama", out / f"resumed-{world}", data, **_resume_args(world))
    run.train(resume_from_checkpoint=str(out / "killed" / "checkpoint-3"))
    resumed = [h for h in run.state.log_history if "loss" in h and h["step"] > 3]
    return {"losses": [h["loss"] for h in resumed], "steps": [h["step"] for h in resumed]}


def main() -> None:
    import torch.distributed as dist

    case, out = sys.argv[1], Path(sys.argv[2])
    if case == "parity":
        result = _case_parity(out)
    elif case == "kill":
        result = _case_kill(out)
    else:
        result = _case_resume(out, int(os.environ["WORLD_SIZE"]))
    if int(os.environ["RANK"]) == 0:
        (out / f"{case}-{os.environ['WORLD_SIZE']}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the pytest side ------------------------------------------------------------------------


def _launch(case: str, out: Path, world: int = 2) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(world), __file__,
           case, str(out)]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                          check=False)  # fmt: skip


def _result(case: str, out: Path, world: int = 2) -> dict[str, Any]:
    proc = _launch(case, out, world)
    path = out / f"{case}-{world}.json"
    assert proc.returncode == 0 and path.exists(), proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(path.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _result("parity", tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_losses_and_weights_equal_the_stock_trainer_under_ddp(parity, name):
    r = parity[name]
    assert len(r["z3_losses"]) == STEPS
    assert r["z3_losses"] == pytest.approx(r["ddp_losses"], rel=1e-5, abs=1e-6)
    assert r["weight_diff"] < 1e-4
    assert r["missing_keys"] == []
    assert r["gathers"] > 0 and r["reductions"] > 0  # the model really was sharded


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_never_wrapped_in_ddp(parity, name):
    r = parity[name]
    assert r["ddp_wrapped"] == "DistributedDataParallel"  # what the stock Trainer does
    assert r["z3_wrapped"] == r["z3_model"]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_evaluate_and_predict_on_the_sharded_model(parity, name):
    r = parity[name]
    assert r["early_eval"] > 0
    assert r["eval"][1] == pytest.approx(r["eval"][0], rel=1e-5)
    assert r["pred_shapes"][0] == r["pred_shapes"][1] == [8, 12, 64]
    assert r["pred_diff"] < 1e-3


def test_gradient_checkpointing_trains_to_the_same_losses(parity):
    r = parity["checkpointing"]
    assert r["enabled"]
    assert r["losses"] == pytest.approx(parity["gpt2"]["z3_losses"], rel=1e-5, abs=1e-6)


def test_the_transformers_deepspeed_json_works_unchanged(parity):
    r = parity["deepspeed"]
    assert r["losses"] == pytest.approx(parity["gpt2"]["z3_losses"], rel=1e-5, abs=1e-6)
    hidden = 32  # hf_models' GPT-2
    assert r["param_persistence_threshold"] == 10 * hidden
    assert r["prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    assert r["reduce_bucket_size"] == hidden * hidden
    assert r["gradient_clipping"] is None  # the Trainer clips with max_grad_norm
    assert r["train_batch_size"] == 2 * 2 * 2  # world x micro batch x accumulation
    assert r["optimizer_params"] == {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                     "weight_decay": 0.1}  # fmt: skip
    scheduler = [m for m in r["warnings"] if "scheduler.type 'WarmupLR'" in m]
    assert scheduler and "lr_scheduler_type='linear'" in scheduler[0]


@pytest.mark.parametrize(
    ("precision", "dtype", "scaled"),
    [("bf16", "torch.bfloat16", False), ("fp16", "torch.float16", True)],
)
def test_bf16_and_fp16_auto_cast_the_parameters(parity, precision, dtype, scaled):
    r = parity[precision]
    assert r["dtype"] == dtype
    assert r["master_dtype"] == "torch.float32"
    assert r["loss_scaled"] is scaled
    assert len(r["losses"]) == 4 and all(0 < loss < 10 for loss in r["losses"])
    if scaled:  # overflow steps are skipped, and the scheduler does not step for them
        assert 0 < r["skipped"] < 4
    assert r["scheduler_steps"] == 4 - r["skipped"]


def test_save_model_loads_with_from_pretrained(parity):
    r = parity["save_model"]
    assert "model.safetensors" in r["files"] and "config.json" in r["files"]
    assert not any(name.startswith(".zero3") for name in r["files"])
    assert r["weight_diff"] == 0.0
    assert r["logit_diff"] < 1e-5


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume")
    proc = _launch("kill", out)
    assert proc.returncode != 0, "the killed run finished"
    assert (out / "killed" / "checkpoint-3" / "zero3").is_dir(), proc.stderr[-8000:]
    assert not (out / "killed" / "checkpoint-6").exists()
    return out


def test_load_best_model_at_end_reloads_the_best_checkpoint(killed):
    best = json.loads((killed / "kill.json").read_text())["best"]
    assert best["checkpoint"] in ("checkpoint-3", "checkpoint-6")
    assert best["after"] == pytest.approx(best["metric"], rel=1e-6)


def test_resume_after_a_kill_equals_the_uninterrupted_run(killed):
    full = json.loads((killed / "kill.json").read_text())["losses"]
    resumed = _result("resume", killed, world=2)
    assert resumed["steps"] == [4, 5, 6]
    assert resumed["losses"] == full[3:]


def test_resume_at_world_3_from_a_world_2_checkpoint_continues_the_curve(killed):
    full = json.loads((killed / "kill.json").read_text())["losses"]
    resumed = _result("resume", killed, world=3)
    assert resumed["steps"] == [4, 5, 6]
    assert resumed["losses"] == pytest.approx(full[3:], rel=1e-4)


def _tool(out: Path, *flags: str) -> tuple[str, list[float]]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    tiny = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch",
            "2", "--accumulation", "1", "--eval-samples", "8", "--output", str(out)]  # fmt: skip
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "hf_train.py"), *tiny, *flags]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    losses = [float(x) for x in re.findall(r"'loss': '([0-9.]+)'", proc.stdout)]
    return proc.stdout, losses


def test_the_hf_train_tool_fine_tunes_saves_and_starts_again_from_its_weights(tmp_path):
    out, first = _tool(tmp_path / "a", "--steps", "6", "--lr", "1e-2")
    assert "held-out loss" in out
    # The whole room of --seq-len 32 positions: not cut at the first "\n" (eos_token_id).
    sample = re.search(r"--- sample \(32 characters\) ---\n(.*?)\n--- end of sample ---", out, re.S)
    assert sample is not None and sample[1].startswith("ROMEO:\n"), out[-2000:]
    assert len(sample[1]) == 32, sample[1]
    assert (tmp_path / "a" / "final" / "model.safetensors").exists()
    out, again = _tool(tmp_path / "b", "--steps", "2", "--init-from", str(tmp_path / "a" / "final"))
    assert len(first) == 6 and len(again) == 2
    assert again[0] < first[0] - 0.1  # it starts from the trained weights, not from scratch


if __name__ == "__main__":
    main()
