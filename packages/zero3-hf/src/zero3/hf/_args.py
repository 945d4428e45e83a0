"""``TrainingArguments(deepspeed=...)`` for Zero3Trainer: the DeepSpeed JSON taken over.

Note (keeping ``deepspeed="ds.json"`` in a DeepSpeed script):
    The most natural port of a DeepSpeed + transformers script keeps its
    ``TrainingArguments(deepspeed="ds.json")`` and swaps the Trainer. With DeepSpeed
    installed, those arguments set up DeepSpeed's state as they are built (transformers'
    ``HfTrainerDeepSpeedConfig``, which also makes ``is_deepspeed_zero3_enabled()`` true
    process-wide, and accelerate's ``DeepSpeedPlugin``); ``Zero3Trainer`` takes the JSON
    from them and works on a copy with that state removed, before the Trainer or
    accelerate see it. Without DeepSpeed installed, building them fails inside
    transformers (``PackageNotFoundError: deepspeed>=0.9.3``) before any zero3 code runs,
    so :class:`Zero3TrainingArguments` is ``TrainingArguments`` that keeps the JSON for
    ``Zero3Trainer`` instead (``HfArgumentParser(Zero3TrainingArguments)`` reads
    ``--deepspeed ds.json`` the same way).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from transformers import TrainingArguments

__all__ = ["Zero3TrainingArguments", "take_deepspeed"]


@dataclasses.dataclass
class Zero3TrainingArguments(TrainingArguments):  # type: ignore[misc]
    """``TrainingArguments`` whose ``deepspeed`` (a DeepSpeed ZeRO-3 JSON path or dict)
    is for :class:`~zero3.hf.Zero3Trainer`, which reads it as ``zero3_config``, instead
    of starting DeepSpeed: a DeepSpeed script keeps its config line and runs without
    DeepSpeed installed. After construction ``deepspeed`` is None (transformers and
    accelerate never see it) and the config is in ``zero3_deepspeed``.
    """

    zero3_deepspeed: dict[str, Any] | str | None = dataclasses.field(
        default=None,
        metadata={"help": "The DeepSpeed ZeRO-3 config Zero3Trainer reads (set by deepspeed=)."},
    )

    def __post_init__(self) -> None:
        given: Any = vars(self).get("deepspeed")
        if given:
            if self.zero3_deepspeed and self.zero3_deepspeed != given:
                raise ValueError(
                    "Zero3TrainingArguments: deepspeed= and zero3_deepspeed= name two "
                    "DeepSpeed configs; keep one"
                )
            self.zero3_deepspeed = given
            object.__setattr__(self, "deepspeed", None)  # transformers never sees it
        super().__post_init__()


def take_deepspeed(args: TrainingArguments) -> tuple[TrainingArguments, Any]:
    """The arguments without DeepSpeed, and the DeepSpeed config they held (or None).

    Raises:
        TypeError: ``args.deepspeed`` is neither a path nor a dict.
    """
    kept = getattr(args, "zero3_deepspeed", None)
    if not args.deepspeed:
        return args, kept or None
    clean = copy.copy(args)  # the caller's arguments keep their deepspeed value
    source, clean.deepspeed = clean.deepspeed, None
    clean.deepspeed_plugin = None
    # The devices were set up (a cached property) with DeepSpeed's process state: set
    # them up again without it at the next args.device.
    vars(clean).pop("_setup_devices", None)
    if vars(clean).pop("hf_deepspeed_config", None) is not None:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        # transformers' is_deepspeed_zero3_enabled() would stay true process-wide.
        unset_hf_deepspeed_config()
    if not isinstance(source, Mapping | str | os.PathLike):
        raise TypeError(
            "Zero3Trainer: TrainingArguments.deepspeed must be a DeepSpeed config path or "
            f"dict, got {type(source).__name__}"
        )
    return clean, source
