"""The Trainer's optimizer as a PartitionedOptimizer, as accelerate sees it."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_optimizer import is_optimizer_factory

from zero3.optim import PartitionedOptimizer

__all__ = ["Zero3AcceleratedOptimizer", "build_partitioned", "scale_loss_gradient"]

#: Keys of ``get_optimizer_cls_and_kwargs`` that replace the parameter groups with the
#: model or a dict of per-parameter optimizers (GaLore, LOMO, layer-wise optimizers).
_WHOLE_MODEL_KEYS = ("params", "model", "optimizer_dict")


def build_partitioned(
    model: nn.Module,
    args: TrainingArguments,
    decay_names: list[str],
    optimizer_cls: Any,
    optimizer_kwargs: dict[str, Any],
) -> PartitionedOptimizer:
    """The optimizer ``Trainer.create_optimizer`` builds, stepping this rank's shards:
    the same class and keyword arguments, the same two groups (weight decay on
    ``decay_names``, none on the rest), over the sharded model's parameters.

    Raises:
        ValueError: The optimizer is a factory over the whole model or replaces the
            parameter groups (GaLore, LOMO, Muon/Dion factories, layer-wise).
    """
    whole = [key for key in _WHOLE_MODEL_KEYS if key in optimizer_kwargs]
    if is_optimizer_factory(optimizer_cls) or whole:
        raise ValueError(
            f"Zero3Trainer: optim={getattr(args.optim, 'value', args.optim)!r} builds its "
            "optimizer from the whole model or replaces the parameter groups; zero3 steps "
            "each rank's 1/N shard of every parameter, so it takes optimizers built from "
            "parameter groups (torch.optim and the like). Pick another optim, or pass "
            "optimizer_cls_and_kwargs"
        )
    decay = set(decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return PartitionedOptimizer(model, optimizer_cls, groups, **optimizer_kwargs)


class Zero3AcceleratedOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """accelerate's optimizer wrapper around a :class:`PartitionedOptimizer`.

    Built without device placement: accelerate's placement round-trips the wrapped
    optimizer's ``state_dict()`` through ``load_state_dict()``, which for a
    PartitionedOptimizer rewrites every shard and regathers the model for nothing. It
    reports an fp16 overflow step as skipped, so the Trainer does not step the learning
    rate scheduler for it (as with DeepSpeed).
    """

    def __init__(self, optimizer: PartitionedOptimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._skipped = False
        self._is_accelerate_prepared = True  # accelerate registers it as it is

    @property
    def partitioned(self) -> PartitionedOptimizer:
        """The PartitionedOptimizer inside."""
        inner = self.optimizer
        assert isinstance(inner, PartitionedOptimizer)
        return inner

    def step(self, closure: Any = None) -> None:
        """Step the PartitionedOptimizer (when accelerate says gradients are synced)."""
        before = self.partitioned.scaler.skipped_steps
        super().step(closure)
        self._skipped = self.partitioned.scaler.skipped_steps != before

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped for an fp16 overflow."""
        return self._skipped


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by the loss scale."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_loss_gradient(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``loss`` with the same value whose backward is scaled by ``scale``.

    Note:
        fp16 training scales the loss before backward so small gradients survive in
        fp16; the PartitionedOptimizer unscales, checks for overflow and clips. The
        Trainer logs the value its ``compute_loss`` returns and calls
        ``accelerator.backward`` on it: scaling only the gradient leaves the logged
        loss right, with no change to the Trainer's loop (accelerate's own GradScaler
        is off because zero3 casts the parameters itself, as DeepSpeed does).
    """
    result: torch.Tensor = _ScaleGradient.apply(loss, scale)  # type: ignore[no-untyped-call]
    return result
