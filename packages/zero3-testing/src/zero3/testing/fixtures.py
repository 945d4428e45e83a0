"""pytest fixtures for multi-rank tests (load with ``pytest_plugins``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from zero3.testing._harness import GroupPool

#: Set (CI sets it) to fail, not skip, the device tests where the device cannot be built.
REQUIRE_ZDEV_ENV = "ZERO3_REQUIRE_ZDEV"


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[GroupPool]:
    """Session-wide pool: one live worker group per world size, spawned on first use."""
    pool = GroupPool(pg_timeout_s=30.0)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def zdev_pool() -> Iterator[GroupPool]:
    """Session-wide pool whose workers load the zdev test device (rank r on ``zdev:r``).

    The device library is built here first (in a child process, or found in the cache),
    so that the ranks start at once and this process stays without an accelerator. On a
    machine without a C++ toolchain the device tests are skipped, unless
    ``ZERO3_REQUIRE_ZDEV`` is set (CI), where they fail.
    """
    from zero3.testing._zdev_build import ToolchainMissing, ensure_built

    try:
        ensure_built()
    except ToolchainMissing as exc:
        if os.environ.get(REQUIRE_ZDEV_ENV):
            pytest.fail(f"{exc} ({REQUIRE_ZDEV_ENV} is set: the device tests must run)")
        pytest.skip(str(exc))
    pool = GroupPool(pg_timeout_s=30.0, setup="zero3.testing.device.worker")
    try:
        yield pool
    finally:
        pool.close()
