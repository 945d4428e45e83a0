"""fp16 loss scaling with DeepSpeed's knobs and semantics."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["LossScaler"]


@dataclasses.dataclass
class LossScaler:
    """Static or dynamic loss scale.

    Dynamic scaling (``loss_scale == 0``) starts at ``2**initial_scale_power``; an
    overflow on any rank skips the step everywhere and, once ``hysteresis`` overflows
    have been tolerated, halves the scale (never below ``min_loss_scale``); after
    ``loss_scale_window`` clean steps the scale doubles.

    Attributes:
        scale: The current scale.
        dynamic: Whether the scale adapts.
        window: Steps without overflow before a dynamic scale doubles.
        hysteresis: Overflows tolerated before a dynamic scale halves.
        min_scale: The dynamic scale never drops below this.
        good_steps: Steps without overflow since the last overflow or doubling.
        overflows: Overflows counted towards ``hysteresis`` since the last halving.
        skipped_steps: Steps skipped because of an overflow, in total.
    """

    scale: float
    dynamic: bool
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    overflows: int = 0
    skipped_steps: int = 0

    @classmethod
    def from_config(
        cls,
        loss_scale: float,
        initial_scale_power: int,
        loss_scale_window: int,
        hysteresis: int,
        min_loss_scale: float,
    ) -> LossScaler:
        """Build from Zero3Config's fields (``loss_scale`` 0 means dynamic)."""
        if loss_scale > 0:
            return cls(scale=float(loss_scale), dynamic=False)
        return cls(
            scale=float(2**initial_scale_power),
            dynamic=True,
            window=loss_scale_window,
            hysteresis=hysteresis,
            min_scale=min_loss_scale,
        )

    def update(self, overflow: bool) -> None:
        """Record the outcome of a step (call once per step, on every rank)."""
        if not self.dynamic:
            if overflow:
                self.skipped_steps += 1
            return
        if overflow:
            self.skipped_steps += 1
            self.overflows += 1
            self.good_steps = 0
            if self.overflows >= self.hysteresis:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self.overflows = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        for key, value in state.items():
            setattr(self, key, value)
