"""tools/train.py with DeepSpeed configs: transformers' ZeRO-3 JSON runs unchanged, and a
bad config fails in the launcher, before any rank starts, naming the key."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train.settings import lr_lambda, parser, settings_from

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tools" / "train.py"
# transformers' ZeRO-3 config: every "auto" placeholder, CPU offload, bf16/fp16 "auto".
TRANSFORMERS_ZERO3 = ROOT / "packages" / "zero3-core" / "tests" / "data" / "transformers_zero3.json"
TINY = [
    "--steps", "3", "--layers", "1", "--d-model", "64", "--heads", "4", "--seq-len", "32",
    "--batch", "2", "--param-persistence-threshold", "0", "--samples", "0", "--no-progress",
]  # fmt: skip


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, str(TRAIN), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_transformers_zero3_config_trains_unchanged(tmp_path):
    result = _run(["--nproc", "2", "--deepspeed-config", str(TRANSFORMERS_ZERO3), *TINY], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "zero3 summary: world 2" in out
    # The launcher read the config once and said what it chose and what it leaves.
    assert out.count('gradient_clipping: "auto" -> 1.0') == 1
    assert out.count('bf16.enabled: "auto" -> False') == 1
    # Optimizer offload is honoured (cpu: host memory, where a CPU run keeps it anyway);
    # so is parameter offload (cpu: nothing moves on a CPU run, said once).
    assert out.count("zero_optimization.offload_optimizer: offloaded to cpu") == 1
    assert out.count("zero_optimization.offload_param: offloaded to cpu") == 1
    assert "optimizer offload: cpu" in out
    assert "not acted on" not in out
    assert out.index("gradient_clipping") < out.index("launching 2 local ranks")
    # "auto" optimizer values took the command's own (lr 1e-3, betas (0.9, 0.95)).
    assert "AdamW({'lr': 0.001, 'betas': (0.9, 0.95), 'eps': 1e-08, 'weight_decay': 0.1})" in out
    assert "fp32, batch 2 x accumulation 1" in out
    assert "Traceback" not in result.stderr


def test_offload_flags_swap_the_optimizer_state_and_the_shards_to_files(tmp_path):
    swap = tmp_path / "swap"
    flags = ["--offload-optimizer", f"nvme:{swap}", "--offload-param", f"nvme:{swap}"]
    result = _run(["--nproc", "2", *flags, *TINY], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    line = [x for x in result.stdout.splitlines() if x.startswith("optimizer offload (nvme")]
    assert line and f"{swap}" in line[0] and "I/O wait" in line[0], result.stdout
    assert "started during the backward" in line[0], result.stdout
    assert "read 0.0 MiB" not in line[0]  # state really moved
    # The walk's record buffers stayed within buffer_count's byte budget.
    held = re.search(
        r"record buffers at most ([\d.]+) MiB at once \(budget ([\d.]+) MiB\)", line[0]
    )
    assert held and 0 < float(held[1]) <= float(held[2]), line[0]
    line = [x for x in result.stdout.splitlines() if x.startswith("parameter offload (nvme")]
    assert line and "of shards in the swap file" in line[0], result.stdout
    assert "read ahead of its gather" in line[0] and "read 0.0 MiB" not in line[0], line
    assert "host heap: its free pages handed back" in result.stdout  # auto with nvme
    assert list(swap.iterdir()) == []  # every rank's files removed at exit
    bad = _run(["--offload-optimizer", "disk", *TINY], tmp_path)
    assert bad.returncode != 0 and "--offload-optimizer must be cpu, nvme:DIR or none" in (
        bad.stdout + bad.stderr
    )


def _bad(tmp_path: Path, **changes: object) -> Path:
    config = json.loads(TRANSFORMERS_ZERO3.read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        node[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bf16__enabled": "false"}, "bf16.enabled must be true or false, got 'false'"),
        ({"train_micro_batch_size_per_gpu": "8"}, "train_micro_batch_size_per_gpu must be an int"),
        ({"scheduler__params__warmup_num_steps": "ten"},
         "DeepSpeed scheduler.params.warmup_num_steps must be an integer >= 1, got 'ten'"),
        ({"zero_optimization": None},
         "zero_optimization must be a JSON object (a mapping), got null"),
    ],
)  # fmt: skip
def test_bad_configs_fail_before_any_rank_starts(train_launcher, tmp_path, changes, message):
    code, out, err = train_launcher(
        ["--deepspeed-config", str(_bad(tmp_path, **changes)), *TINY], tmp_path
    )
    assert code == 2
    assert message in err
    assert "launching" not in out


def _settings(tmp_path: Path, config: dict[str, object], *flags: str, world: int = 2):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, **config}))
    args = parser().parse_args(["--deepspeed-config", str(path), *flags])
    return settings_from(args, world_size=world)


@pytest.mark.parametrize(
    ("config", "flags", "expected"),
    [
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, [], (8, 1)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, [], (4, 3)),
        ({"train_batch_size": 24, "gradient_accumulation_steps": 2}, [], (6, 2)),
        ({"train_batch_size": 16}, [], (8, 1)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": "auto"}, ["--batch", "2"], (2, 4)),
        ({"train_batch_size": 16}, ["--batch", "2", "--accumulation", "1"], (2, 1)),
    ],
)  # fmt: skip
def test_batch_sizes_follow_deepspeeds_rules(tmp_path, config, flags, expected):
    settings = _settings(tmp_path, config, *flags)
    assert (settings.batch, settings.accumulation) == expected


def test_batch_sizes_that_do_not_divide_are_named(tmp_path):
    with pytest.raises(ValueError, match="train_batch_size 10 is not a multiple of micro batch 4"):
        _settings(tmp_path, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})


def test_optimizer_auto_and_deepspeeds_adam(tmp_path):
    adam = {"type": "Adam", "params": {"lr": "auto", "weight_decay": 0.01}}
    settings = _settings(tmp_path, {"optimizer": adam}, "--lr", "0.01")
    assert settings.optimizer is torch.optim.AdamW  # DeepSpeed's adam_w_mode default
    assert settings.optimizer_kwargs == {"lr": 0.01, "weight_decay": 0.01}
    adam["params"]["adam_w_mode"] = False
    assert _settings(tmp_path, {"optimizer": adam}).optimizer is torch.optim.Adam
    with pytest.raises(ValueError, match=r'optimizer.params.momentum is "auto"'):
        _settings(tmp_path, {"optimizer": {"type": "SGD", "params": {"momentum": "auto"}}})
    with pytest.raises(ValueError, match=r"not valid for torch\.optim\.AdamW.*unexpected keyword"):
        _settings(tmp_path, {"optimizer": {"type": "AdamW", "params": {"bogus": 1}}})


def test_deepspeed_schedules(tmp_path):
    log_warmup = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 4},
    }
    settings = _settings(tmp_path, {"scheduler": log_warmup}, "--lr", "0.1")
    f = lr_lambda(settings, warmup=10)
    # DeepSpeed steps its scheduler after each optimizer step: step k runs at iteration
    # k - 1, and the warmup rises as log(i + 1) / log(4) from 0 ("auto") to the lr.
    expected = [0.0, 0.0, math.log(2) / math.log(4), math.log(3) / math.log(4), 1.0, 1.0]
    assert [f(k) for k in range(6)] == pytest.approx(expected)
    decay = {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 2,
            "warmup_type": "linear", "total_num_steps": 6,
        },
    }  # fmt: skip
    f = lr_lambda(_settings(tmp_path, {"scheduler": decay}, "--lr", "0.1"), warmup=0)
    lrs = [0.1 * f(k) for k in range(8)]
    # Linear warmup from the min over 2 iterations, then linear decay back to the min.
    assert lrs == pytest.approx([0.01, 0.01, 0.055, 0.1, 0.0775, 0.055, 0.0325, 0.01])
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear'"):
        _settings(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}})
    with pytest.raises(ValueError, match="total_num_steps is not a parameter of WarmupLR"):
        _settings(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 9}}})
