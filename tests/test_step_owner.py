"""The training step has one owner, and one training step walks the documented files.

``TrainingStep`` (``zero3.core.model._step``) owns the step's state: no other module of
zero3 writes its fields. docs/architecture.rst lists, file by file, where one training
step goes; a recorded step at world 2 must enter exactly those files.
"""

from __future__ import annotations

import ast
import collections
import re
import sys
from pathlib import Path

import pytest
import torch

from zero3.comm import GlooBackend
from zero3.core import Zero3Config
from zero3.core.engine import TrainingStep, sharded_state
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import TinyGPT

ROOT = Path(__file__).resolve().parent.parent
STEP_MODULE = ROOT / "packages/zero3-core/src/zero3/core/model/_step.py"
WALK_SECTION = "One training step, file by file"


def _step_fields() -> set[str]:
    """The attributes ``TrainingStep.__init__`` sets on ``self``."""
    tree = ast.parse(STEP_MODULE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainingStep")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {attr for _, obj, attr in _written_attributes(init) if obj == "self"}


def _written_attributes(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, object, attribute) for every attribute assigned, augmented or deleted."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute):
                    found.append((t.lineno, ast.unparse(t.value), t.attr))
    return found


def test_only_the_step_module_writes_the_steps_fields():
    fields = _step_fields()
    public = {name for name, v in vars(TrainingStep).items() if isinstance(v, property)}
    assert {"_open", "_number", "_micro_steps", "_pending", "_passes", "_tasks"} <= fields
    offenders = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        if path == STEP_MODULE:
            continue
        tree = ast.parse(path.read_text())
        for line, obj, attr in _written_attributes(tree):
            if attr in public or (attr in fields and obj != "self"):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {obj}.{attr}")
        # A private field reached through a step reference (step._pending[...] = ...).
        text = path.read_text()
        for match in re.finditer(r"\bstep\.(_\w+)", text):
            if match.group(1) in fields:
                offenders.append(f"{path.relative_to(ROOT)}: step.{match.group(1)}")
    assert not offenders, "only zero3.core.model._step may change the step's state:\n" + "\n".join(
        offenders
    )


def test_the_steps_public_face_is_read_only():
    read_only = [n for n, v in vars(TrainingStep).items() if isinstance(v, property)]
    assert {"number", "is_open", "micro_steps", "busy", "pending_backwards"} <= set(read_only)
    assert all(vars(TrainingStep)[n].fset is None for n in read_only)


def _documented_walk() -> set[str]:
    """The modules the architecture page's walk table names (``core/model/_step.py``...)."""
    text = (ROOT / "docs/architecture.rst").read_text()
    start = text.index(WALK_SECTION)
    end = text.index("\n----", text.index("\n", start + len(WALK_SECTION) * 2))
    section = text[start:end]
    paths = re.findall(r"^   \* - ``([a-z]+/[\w/]+\.py)``", section, flags=re.M)
    assert paths, "the walk table lists no files"
    return {"zero3." + p[:-3].replace("/", ".") for p in paths}


def _walk_one_step() -> dict[str, object]:
    comm = GlooBackend(timeout_s=30)
    torch.manual_seed(0)
    model = shard_module(TinyGPT(), Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(comm.rank))

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # the first step records the module order; the walk is of a later one
    step()
    entered: dict[str, set[str]] = collections.defaultdict(set)

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("zero3.") and not name.startswith("zero3.testing"):
                entered[name].add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    last = stats(model)
    return {
        "modules": sorted(entered),
        "gathers": last.gathers,
        "reductions": last.reduce_collectives,
        "open": sharded_state(model).step.is_open,
    }


@pytest.mark.multirank
def test_one_training_step_walks_the_documented_files(worker_pool):
    documented = _documented_walk()
    for result in worker_pool(2).run(_walk_one_step):
        assert result["gathers"] > 0 and result["reductions"] > 0  # really sharded
        assert not result["open"]
        entered = set(result["modules"])
        assert entered == documented, (
            f"entered but not documented: {sorted(entered - documented)}; "
            f"documented but not entered: {sorted(documented - entered)}"
        )
