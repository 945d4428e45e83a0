"""What Zero3Trainer keeps in a checkpoint beside the model and optimizer.

Note:
    One DCP checkpoint (``zero3.optim.save_checkpoint``) in the Trainer's
    ``checkpoint-{step}/zero3``: it reshards on load, so a run resumes at any world size.
    The scheduler's state goes in as JSON text (a checkpoint keeps leaves: a ``LambdaLR``
    state's empty dicts would not come back), each rank's RNG states under its own key
    (:ref:`hf-checkpoints`).
"""

from __future__ import annotations

import json
import logging
import os
import random
from typing import Any

import numpy as np
import torch

__all__ = ["ZERO3_DIR", "restore_rng", "rng_key", "rng_state", "scheduler_text", "zero3_dir"]

_log = logging.getLogger("zero3.hf")

#: The DCP checkpoint's directory inside a Trainer checkpoint folder.
ZERO3_DIR = "zero3"


def zero3_dir(checkpoint: str | os.PathLike[str]) -> str:
    """The zero3 checkpoint inside a Trainer checkpoint folder."""
    return os.path.join(checkpoint, ZERO3_DIR)


def scheduler_text(scheduler: Any) -> str:
    """A learning-rate scheduler's ``state_dict()`` as JSON text.

    Raises:
        TypeError: The state holds something JSON cannot write (a tensor, an object).
    """
    try:
        return json.dumps(scheduler.state_dict())
    except TypeError as exc:
        raise TypeError(
            f"Zero3Trainer saves the learning-rate scheduler's state_dict() as JSON, and "
            f"{type(scheduler).__name__}'s holds something else ({exc})"
        ) from exc


def rng_key(rank: int) -> str:
    """The ``extra`` key of one rank's RNG states."""
    return f"rng_rank{rank}"


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (python, numpy, torch CPU,
    and the current accelerator device's, where there is one).
    """
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(words), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNGs from :func:`rng_state`'s result."""
    python = state["python"]
    words = tuple(int(w) for w in python["state"].tolist())
    random.setstate((int(python["version"]), words, python["gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            str(numpy_state["kind"]),
            numpy_state["keys"].numpy().astype(np.uint32),
            int(numpy_state["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
    )
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
