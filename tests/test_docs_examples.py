"""The documentation's code runs: every examples/*.py, launched as the docs say.

The pages include these scripts with ``literalinclude``, so a snippet that stops working
fails here. Each example runs in a fresh process group (torchrun with 2 local ranks,
mpiexec, or one plain process where a world of one rank is the point), with a timeout,
and must exit 0 and print its key lines.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from zero3.testing import run_in_session

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
TIMEOUT_S = 180

TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
MPIEXEC = [str(BIN / "mpiexec"), "-n", "2", sys.executable]
PYTHON = [sys.executable]

# (example, launcher, lines the output must contain)
CASES = [
    (
        "quickstart.py",
        TORCHRUN,
        ["step 30: loss", "rank 0: holds 512 of 1024", "rank 1: holds 512 of 1024"],
    ),
    ("quickstart.py", PYTHON, ["step 30: loss", "rank 0: holds 1024 of 1024"]),
    ("quickstart.py", MPIEXEC, ["step 30: loss", "rank 1: holds 512 of 1024"]),
    (
        "comm_only.py",
        TORCHRUN,
        [
            "rank 1: all_gather -> [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]",
            "rank 1: reduce_scatter(SUM) -> [6.0, 9.0]",
            "all_gather_coalesced -> [[1.0, 1.0, 2.0, 2.0], [10.0, 10.0, 10.0, 11.0, 11.0, 11.0]]",
            "refused: gloo.all_reduce: the 'gloo' backend cannot reduce torch.bool",
        ],
    ),
    (
        "inference.py",
        TORCHRUN,
        [
            "max |sharded - unsharded| = 0.0e+00",
            "last forward: 1 gather(s), 1 of them prefetched",
            "inside gathered_parameters: 0 gathers",
        ],
    ),
    (
        "optimizers.py",
        TORCHRUN,
        [
            "rank 0: Lion sees [(256,), (16,), (16,), (16,), (16,), (1,)], all torch.float32",
            "rank 1: Lion sees [(256,), (16,), (16,), (16,), (16,), (0,)]",
            "rank 0: with flat=True: [(321,)]",
            "lr after 3 steps:",
            "torch.nn.utils.clip_grad_norm_: parameter '0.weight' of a sharded model has no "
            ".grad; opt.clip_grad_norm_ saw",
            "Zero3Config(gradient_clipping=1.0): clipped a norm of",
            "fp16: loss scale 256, 0 step(s) skipped, masters torch.float32",
        ],
    ),
    (
        "checkpoints.py",
        TORCHRUN,
        [
            "model.state_dict(): ['Tensor']",
            "resumed losses equal the uninterrupted run: True",
            "async save published ckpt",
            "consolidated: ['model.safetensors']",
            "dcp_to_torch_save: ['extra', 'model', 'optim', 'zero3'], model keys ['0.bias', "
            "'0.weight', '2.bias', '2.weight']",
            "rank 1: bias after the edit [0.0]",
        ],
    ),
    (
        "troubleshooting.py",
        TORCHRUN,
        [
            "trace_invalidations per step: [0, 0, 1, 0]",
            "warning: zero3: the module order changed",
            "weight.grad: parameter 'weight' of a sharded model has no .grad",
            "local_grad: (16,), full_grad: (4, 8)",
            "weight: shape (4, 8), 0 bytes",
            "weight.sum(): zero3: parameter 'weight' is partitioned across ranks",
            "zero3: ranks are about to issue different collectives:",
            "rank 0: gathered a module's parameters for module '0.experts.0'",
            "rank 1: gathered a module's parameters for module '0.experts.1'",
            "with TopOneMoE as a leaf: trained",
        ],
    ),
    (
        "big_models.py",
        TORCHRUN,
        [
            "rank 0: estimate per rank 723,456 bytes of 1,446,912 unsharded",
            "rank 1: max |sharded - from_pretrained| = 0.0e+00",
            "rank 0: holds 723,604 of 1,447,080 model-state bytes (0.50x), estimate 723,456",
        ],
    ),
    (
        "plugin_loopback.py",
        PYTHON,
        ["'loopback']", "LoopbackBackend: rank 0 of 1", "all_gather -> [1.0, 2.0, 3.0]"],
    ),
    (
        "deepspeed_config.py",
        PYTHON,
        [
            "prefetch_bucket_size=20,000,000",
            "param_persistence_threshold=100,000",
            "max_reuse_distance=0, param_dtype=torch.bfloat16",
            "gradient_clipping=1.0, backend='gloo'",
            "refused: zero_optimization.stage is 2: zero3 implements ZeRO stage 3 only",
            "refused: zero_optimization.stage3_prefetch_bucket is not a DeepSpeed setting",
        ],
    ),
]


def _env() -> dict[str, str]:
    # A clean launch: no rendezvous variables inherited from a launcher running pytest.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "OMPI_", "PMI_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    # Let the example processes cache bytecode. Where PYTHONDONTWRITEBYTECODE is set and
    # the environment holds no .pyc files, every process compiles torch from source
    # (seconds for `import torch`, more for torch._dynamo on the first optimizer step).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(cmd: list[str], cwd: Path) -> tuple[int, str, str]:
    # A session of its own, so a timeout stops the launcher and every rank it started.
    return run_in_session(cmd, timeout_s=TIMEOUT_S, env=_env(), cwd=cwd)


def _launcher_name(launcher: list[str]) -> str:
    return {id(TORCHRUN): "torchrun", id(MPIEXEC): "mpiexec", id(PYTHON): "python"}[id(launcher)]


@pytest.mark.parametrize(
    ("example", "launcher", "expected"),
    CASES,
    ids=[f"{example}-{_launcher_name(launcher)}" for example, launcher, _ in CASES],
)
def test_example_runs(example: str, launcher: list[str], expected: list[str], tmp_path: Path):
    if launcher is MPIEXEC and shutil.which("mpiexec", path=str(BIN)) is None:
        pytest.skip("no mpiexec in the environment")
    code, out, err = _run([*launcher, str(EXAMPLES / example)], tmp_path)
    assert code == 0, f"exit code {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    for line in expected:
        assert line in out, (
            f"{line!r} missing from the output\n--- stdout\n{out}\n--- stderr\n{err}"
        )
    assert "Traceback" not in err, err


#: Examples another test runs, with its own checks (each names the example's path).
RUN_ELSEWHERE = {"hf_train.py": ROOT / "tests" / "test_hf_trainer.py"}
#: Examples that only define what another example imports (and so runs).
IMPORTED_BY = {"lion.py": "optimizers.py"}


def test_every_example_is_run_and_shown():
    """Each example has a case above (or a test of its own) and is included by a page (no
    orphans either way)."""
    examples = {p.name for p in EXAMPLES.glob("*.py")}
    cases = {example for example, _, _ in CASES}
    assert examples == cases | set(RUN_ELSEWHERE) | set(IMPORTED_BY)
    for example, test in RUN_ELSEWHERE.items():
        assert f'"examples" / "{example}"' in test.read_text(), (example, test)
    for example, importer in IMPORTED_BY.items():
        assert importer in cases, importer
        module = example.removesuffix(".py")
        assert f"from {module} import" in (EXAMPLES / importer).read_text(), (example, importer)
    included = set()
    for page in DOCS.rglob("*.rst"):
        included.update(
            re.findall(r"literalinclude:: +(?:\.\./)*examples/(\w+\.py)", page.read_text())
        )
    assert examples <= included, f"examples no page includes: {sorted(examples - included)}"
