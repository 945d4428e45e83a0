"""One rank's failure raised on every rank: checkpoint operations end alike everywhere."""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from zero3.core.files._format import CheckpointError

__all__ = ["raise_on_every_rank"]


def raise_on_every_rank(group: dist.ProcessGroup | None, error: BaseException | None) -> None:
    """Turn one rank's failure into the same error on every rank (a collective).

    Each rank passes its own error or None. If any rank failed, every rank raises:
    a failed rank its own exception, the others the first failure (same class where
    it can be rebuilt, else :class:`~zero3.core.CheckpointError`), marked with the rank it came
    from. A rank that died meanwhile shows up as a :class:`~zero3.core.CheckpointError`.
    """
    if group is None:
        if error is not None:
            raise error
        return
    payload: Any = None
    if error is not None:
        try:
            payload = pickle.dumps(error)
        except Exception:
            payload = pickle.dumps(CheckpointError(str(error)))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, payload, group=group)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"a rank left during a checkpoint operation ({first})"
            + (f"; this rank had failed too: {error}" if error is not None else "")
        ) from error
    if error is not None:
        raise error
    for rank, item in enumerate(gathered):
        if item is not None:
            remote = pickle.loads(item)
            try:
                copy = type(remote)(f"{remote} (raised on rank {rank})")
            except Exception:
                copy = CheckpointError(f"{remote} (raised on rank {rank})")
            raise copy
