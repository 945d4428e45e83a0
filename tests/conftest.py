from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

pytest_plugins = ["zero3.testing.fixtures"]

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _train_tool() -> ModuleType:
    # tools/train.py is a script, not a module of a package: load it from its file (its
    # helpers, the _train package, are installed with zero3-tools).
    spec = importlib.util.spec_from_file_location("zero3_train_tool", ROOT / "tools" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def train_launcher(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[[list[str], Path], tuple[int, str, str]]:
    """Run tools/train.py's launcher in this process: ``(exit code, stdout, stderr)``.

    The launcher checks flags and configs before it starts any rank, so a bad one
    returns at once: testing those messages needs no new interpreter (seconds each).
    A good command would go on to launch its ranks as usual.
    """

    def run(args: list[str], cwd: Path) -> tuple[int, str, str]:
        monkeypatch.chdir(cwd)
        for key in list(os.environ):
            if key.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_")):
                monkeypatch.delenv(key)
        try:
            code = _train_tool().main(args)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
