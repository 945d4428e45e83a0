"""The zdev build cache: a build killed half-way does not block the next one."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from zero3.testing import _zdev_build


def test_a_killed_builds_lock_file_does_not_block_the_next_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_zdev_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_zdev_build, "missing_toolchain", lambda: None)
    directory = tmp_path / _zdev_build.source_key()
    directory.mkdir()
    (directory / "lock").touch()  # cpp_extension's baton, left by a killed build
    seen: list[bool] = []

    def fake_build(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append((directory / "lock").exists())
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(_zdev_build.subprocess, "run", fake_build)
    info = _zdev_build.ensure_built()
    assert seen == [False]  # the compile started without the stale baton
    assert info.built_now and info.library.parent == directory
