"""``zero3_trainer``: the zero3 version of a Trainer subclass (TRL's trainers among them).

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``...) subclass the
transformers ``Trainer``; ``zero3_trainer(cls)`` puts :class:`~zero3.hf.Zero3Trainer` in
front of one, so the policy is sharded, never wrapped in DDP and stepped by a
PartitionedOptimizer exactly as for the Trainer. What TRL adds on top is handled here:
its reference model (``self.ref_model``, built from the policy's path) is sharded with
the policy's configuration as it is assigned, and its rollouts go through the sharded
model's own ``generate`` (synced, inside ``zero3.hooks.unsharded``).
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from transformers import Trainer

from zero3.core.engine import try_sharded_state
from zero3.hf._trainer import Zero3Trainer
from zero3.hooks import shard_module

__all__ = ["zero3_trainer"]

#: Trainer attributes holding models that run beside the policy (TRL's reference model).
SIDE_MODELS = ("ref_model",)

_MADE: dict[type, type] = {}


class _SideModels:
    """Shards the models a trainer subclass keeps beside the policy, as it stores them."""

    zero3_config: Any
    args: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args")
        _refuse_unsupported(training_args)
        super().__init__(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name in SIDE_MODELS
            and isinstance(value, nn.Module)
            and try_sharded_state(value) is None
            and getattr(self, "zero3_config", None) is not None
        ):
            # Every rank builds it the same way at the same point (from the policy's
            # path), so sharding it here is a collective all ranks join.
            value = shard_module(value.to(self.args.device), self.zero3_config)
        super().__setattr__(name, value)


def _refuse_unsupported(args: Any) -> None:
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append(
            "use_vllm=True: generation runs through the sharded model's generate (vLLM's "
            "weights could be streamed with zero3.hooks.iter_full_parameters, not done here)"
        )
    if getattr(args, "sync_ref_model", False):
        problems.append(
            "sync_ref_model=True: TRL mixes the policy into the reference model through "
            "param.data, which a sharded model does not hold"
        )
    if problems:
        raise ValueError("zero3_trainer: " + "; ".join(problems))


def zero3_trainer(cls: type[Trainer]) -> type[Zero3Trainer]:
    """The zero3 version of a ``Trainer`` subclass: ``cls`` with
    :class:`~zero3.hf.Zero3Trainer` in front of it.

    ``zero3_trainer(trl.DPOTrainer)(model=model, args=DPOConfig(...), train_dataset=...,
    zero3_config=...)`` takes ``cls``'s arguments (by keyword) plus ``zero3_config``:
    the policy is sharded and stepped as by ``Zero3Trainer``, a reference model the
    trainer builds or is given (``ref_model``) is sharded with the same configuration,
    and generation goes through the sharded model's ``generate``. The model must be an
    ``nn.Module`` (load a path with ``from_pretrained`` or
    :func:`~zero3.hf.sharded_from_pretrained` first). vLLM generation
    (``use_vllm``) and ``sync_ref_model`` are refused.

    Args:
        cls: ``transformers.Trainer`` or a subclass of it.

    Returns:
        The zero3 class (made once per ``cls``), named ``Zero3`` + ``cls.__name__``.

    Raises:
        TypeError: ``cls`` is not a Trainer subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"zero3_trainer expects a transformers.Trainer subclass, got {cls!r}")
    if issubclass(cls, Zero3Trainer):
        return cls
    made = _MADE.get(cls)
    if made is None:
        made = type(
            f"Zero3{cls.__name__}",
            (_SideModels, Zero3Trainer, cls),
            {"__module__": __name__, "__doc__": f"{cls.__name__} on zero3 (zero3_trainer)."},
        )
        _MADE[cls] = made
    return cast(type[Zero3Trainer], made)
