"""Code cites docs sections by label (``:ref:`fact-mmap-threshold```, or a fact test's
``fact-...`` name): every label cited from the sources, tests and tools exists in docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r":ref:`(?:[^`<]*<)?([a-z0-9][a-z0-9-]*)>?`|\b(fact-[a-z0-9-]*[a-z0-9])\b")
DEFINED = re.compile(r"^\.\. _([a-z0-9][a-z0-9-]*):\s*$", re.M)


def _python_files() -> list[Path]:
    roots = [*ROOT.glob("packages/*/src"), ROOT / "tests", ROOT / "tools", ROOT / "examples"]
    return [f for root in roots for f in sorted(root.rglob("*.py"))]


def cited_labels(text: str) -> set[str]:
    """The labels a text cites."""
    return {a or b for a, b in CITED.findall(text)}


def test_every_cited_label_exists():
    defined = {m for page in ROOT.glob("docs/**/*.rst") for m in DEFINED.findall(page.read_text())}
    missing = [
        f"{path.relative_to(ROOT)}: {label}"
        for path in _python_files()
        if path != Path(__file__)
        for label in sorted(cited_labels(path.read_text()) - defined)
    ]
    assert not missing, "labels cited but not defined in docs/:\n" + "\n".join(missing)


def test_the_check_sees_both_forms():
    text = "see :ref:`fact-mmap-threshold` and :ref:`the pool <testing-pool>`; fact-data-swap:"
    assert cited_labels(text) == {"fact-mmap-threshold", "testing-pool", "fact-data-swap"}
