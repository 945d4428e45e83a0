"""zero3-hf is the one distribution that needs transformers and accelerate.

Installing the engine (comm, core, hooks, optim) must not pull either: only zero3-hf
declares them as dependencies, and only its sources import accelerate. (zero3-testing
offers transformers as an optional extra for the tests that build its models.)
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").glob("zero3-*") if (p / "pyproject.toml").exists())
HEAVY = {"transformers", "accelerate"}


def _requires(package: Path) -> set[str]:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    return {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower() for spec in project["dependencies"]}  # type: ignore[union-attr]


def _imports(package: Path) -> set[str]:
    found = set()
    for path in (package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_only_zero3_hf_requires_transformers_and_accelerate():
    requiring = {p.name: _requires(p) & HEAVY for p in PACKAGES}
    assert requiring.pop("zero3-hf") == HEAVY
    assert all(not heavy for heavy in requiring.values()), requiring


def test_only_zero3_hf_imports_accelerate():
    importing = [p.name for p in PACKAGES if "accelerate" in _imports(p)]
    assert importing == ["zero3-hf"]
