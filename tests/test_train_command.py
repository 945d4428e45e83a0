"""The main job end to end: tools/train.py in every launch mode CI has."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tools" / "train.py"
BIN = Path(sys.executable).parent
TINY = [
    "--steps", "3", "--layers", "1", "--d-model", "64", "--heads", "4", "--seq-len", "32",
    "--batch", "2", "--param-persistence-threshold", "0", "--samples", "1",
    "--sample-length", "12", "--no-progress", "--warmup", "1",
]  # fmt: skip


def _run(cmd: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _check_outputs(result: subprocess.CompletedProcess[str], tmp_path: Path, world: int) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "zero3 summary: world 2" in out
    assert "100.0% of elements sharded" in out
    assert "payload per step" in out and "theory" in out
    assert "--- sample 1 ---" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"]}
    assert pids == set(range(world))  # one track per rank
    cats = {e.get("cat") for e in trace["traceEvents"]}
    assert {"forward", "backward", "reduce", "optimizer"} <= cats
    assert cats & {"gather", "prefetch"}
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


OUTPUTS = ["--trace", "trace.json", "--plot", "loss.png"]
Run = tuple[subprocess.CompletedProcess[str], Path]


# Each launch costs seconds of interpreter starts: a run that several tests check is
# launched once per module (its output directory with it).
@pytest.fixture(scope="module")
def self_launched(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``train.py --nproc 2`` (eager initialisation, seed 0)."""
    cwd = tmp_path_factory.mktemp("self_launched")
    return _run([sys.executable, str(TRAIN), "--nproc", "2", *TINY, *OUTPUTS], cwd), cwd


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``torchrun ... train.py --init empty``: built under empty_init, never whole."""
    cwd = tmp_path_factory.mktemp("under_torchrun")
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(TRAIN), *TINY,
           *OUTPUTS, "--init", "empty"]  # fmt: skip
    return _run(cmd, cwd), cwd


def test_self_launched(self_launched):
    result, cwd = self_launched
    assert "launching 2 local ranks" in result.stdout
    _check_outputs(result, cwd, 2)


def test_under_torchrun(under_torchrun):
    _check_outputs(*under_torchrun, 2)


@pytest.mark.skipif(
    shutil.which("mpiexec", path=str(BIN)) is None, reason="no mpiexec in the environment"
)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_under_mpiexec(tmp_path, backend):
    cmd = [
        str(BIN / "mpiexec"),
        "-n",
        "2",
        sys.executable,
        str(TRAIN),
        "--backend",
        backend,
        *TINY,
        *OUTPUTS,
    ]
    result = _run(cmd, tmp_path)
    _check_outputs(result, tmp_path, 2)
    assert f"zero3: {backend} backend, world 2" in result.stdout


def test_deepspeed_config(tmp_path):
    ds = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 2e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": 0,
            "reduce_bucket_size": 5000,
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    args = [a for a in TINY if a not in ("--batch", "2")]
    result = _run(
        [sys.executable, str(TRAIN), "--nproc", "2", "--deepspeed-config", "ds.json", *args],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "batch 2 x accumulation 2" in result.stdout
    assert "'lr': 0.002" in result.stdout
    assert "theory 2 x (released after forward" in result.stdout  # stage3_max_reuse_distance 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtype", "fp8"], "invalid choice: 'fp8'"),
        (["--d-model", "100"], "--d-model 100 must be divisible by --heads 6"),
        (["--backend", "nccl"], "comm backend 'nccl' is not available here"),
        (["--backend", "glooo"], "unknown comm backend 'glooo'"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--deepspeed-config", "missing.json"], "no such file"),
        (["--save-every", "2"], "--save-every needs --save DIR"),
        (["--resume", "missing-ckpt"], "no checkpoint at missing-ckpt: the path does not exist"),
        (["--from", "nowhere"], "--from nowhere: no such file or directory"),
    ],
)
def test_bad_flags_get_clear_messages(train_launcher, tmp_path, flags, message):
    code, out, err = train_launcher(flags, tmp_path)
    assert code == 2
    assert message in err
    assert "launching" not in out


def _final_loss(result: subprocess.CompletedProcess[str]) -> float:
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("step 6/6 loss "))
    return float(line.split()[3])


def test_save_and_resume_continue_the_loss_curve(tmp_path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from zero3.core.engine import CheckpointReader

    base = [sys.executable, str(TRAIN), *TINY, "--samples", "0", "--steps", "6"]
    straight = _run([*base, "--nproc", "2", "--save", "ck-{step}", "--save-every", "3"], tmp_path)
    assert "checkpoint: saved ck-3 (step 3)" in straight.stdout
    assert "checkpoint: saved ck-6 (step 6)" in straight.stdout
    # Stopped after step 3 and resumed: the same steps 4-6, bit for bit.
    resumed = _run(
        [*base, "--nproc", "2", "--resume", "ck-3", "--save", "again", "--save-async"], tmp_path
    )
    assert "resumed from ck-3 at step 3" in resumed.stdout
    assert _final_loss(resumed) == _final_loss(straight)
    a, b = CheckpointReader(tmp_path / "ck-6"), CheckpointReader(tmp_path / "again")
    tensors = [
        key
        for key, md in a.metadata.state_dict_metadata.items()
        if key.startswith(("model.", "optim.")) and isinstance(md, TensorStorageMetadata)
    ]
    assert len(tensors) > 20  # weights, Adam's moments, steps
    for key in tensors:
        assert torch.equal(a.read_tensor(key), b.read_tensor(key)), key
    # Resumed by one rank with the same global batch (4 sequences): the same curve.
    alone = _run([*base, "--nproc", "1", "--batch", "4", "--resume", "ck-3"], tmp_path)
    assert _final_loss(alone) == pytest.approx(_final_loss(straight), abs=2e-4)


def test_default_model_really_shards():
    from _train.data import CharCorpus
    from _train.model import GPT, GPTConfig
    from _train.settings import parser, settings_from

    settings = settings_from(parser().parse_args([]), world_size=2)
    threshold = settings.config.param_persistence_threshold
    model = GPT(GPTConfig(CharCorpus().vocab_size))
    sizes = [p.numel() for p in model.parameters()]
    assert sum(n for n in sizes if n > threshold) / sum(sizes) >= 0.95


def test_help_gives_every_flag_a_text_and_its_real_default():
    from _train.settings import _HelpFormatter, parser

    p = parser()
    formatter = _HelpFormatter("train.py")
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        text = formatter._get_help_string(action) % {"default": action.default}
        assert "default" in text, (action.option_strings, text)
    assert "(default: None)" not in p.format_help()


def _first_loss(out: str) -> str:
    return next(line.split()[3] for line in out.splitlines() if line.startswith("step 1/"))


def test_init_empty_and_from_weights(tmp_path, self_launched, under_torchrun):
    import torch
    from _train.data import CharCorpus
    from _train.model import GPT, GPTConfig
    from safetensors.torch import save_model

    # The weights of the self-launched run (seed 0's eager initialisation, TINY's shape).
    torch.manual_seed(0)
    model = GPT(GPTConfig(CharCorpus().vocab_size, 1, 64, 4, 32))
    (tmp_path / "weights").mkdir()
    save_model(model, str(tmp_path / "weights" / "model.safetensors"))
    common = [sys.executable, str(TRAIN), "--nproc", "2", *TINY, "--samples", "0"]
    runs = {
        "eager": self_launched[0],
        "from": _run([*common, "--steps", "1", "--from", "weights"], tmp_path),
        "empty": under_torchrun[0],
    }
    for name, result in runs.items():
        assert result.returncode == 0, (name, result.stdout + result.stderr)
        assert "zero3 summary: world 2" in result.stdout
        assert "theory: model state per rank" in result.stdout
    # The same weights (the file holds seed 0's eager initialisation): the same first loss.
    assert _first_loss(runs["from"].stdout) == _first_loss(runs["eager"].stdout)
    # The summary's columns line up: every table row splits at the same offsets.
    table = [
        line
        for line in runs["empty"].stdout.splitlines()
        if line.startswith(("rank |", "0    |", "1    |"))
    ]
    offsets = {tuple(i for i, c in enumerate(line) if c == "|") for line in table}
    assert len(table) == 3 and len(offsets) == 1, table
