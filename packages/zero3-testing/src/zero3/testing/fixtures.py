"""pytest fixtures for multi-rank tests (load with ``pytest_plugins``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from zero3.testing._harness import GroupPool


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[GroupPool]:
    """Session-wide pool: one live worker group per world size, spawned on first use."""
    pool = GroupPool(pg_timeout_s=30.0)
    try:
        yield pool
    finally:
        pool.close()
