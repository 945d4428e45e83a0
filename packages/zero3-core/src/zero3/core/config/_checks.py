"""Value checks shared by :class:`~zero3.core.Zero3Config` and the DeepSpeed mapping.

``label`` is what an error names: ``"Zero3Config.timeout_s"`` for a field, the DeepSpeed
key (``"zero_optimization.reduce_bucket_size"``) when a DeepSpeed config is read, so
both paths apply one rule and each error names what the user wrote.
"""

from __future__ import annotations

import datetime
import math

__all__ = ["check_bool", "check_clipping", "check_float", "check_int", "check_timeout"]

# The longest timeout a backend can turn into a datetime.timedelta (about 2.7 million
# years); anything larger fails there with an OverflowError that names nothing.
_MAX_TIMEOUT_S = datetime.timedelta.max.total_seconds()


def check_int(label: str, value: object, *, minimum: int) -> int:
    """A whole number >= ``minimum`` (a whole float such as JSON's ``1e9`` is accepted)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{label} must be an integer, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{label} must be a finite integer, got {value}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{label} must be a whole number, got {value}")
    if value < minimum:
        raise ValueError(f"{label} must be >= {minimum}, got {value}")
    return int(value)


def check_float(
    label: str, value: object, *, minimum: float | None = None, positive: bool = False
) -> float:
    """A finite number, ``> 0`` with ``positive``, ``>= minimum`` if given."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{label} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{label} must be a finite number, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{label} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{label} must be >= {minimum}, got {value}")
    return float(value)


def check_bool(label: str, value: object) -> bool:
    """A real boolean: the string ``"false"`` or the number 0 is an error, not a flag."""
    if not isinstance(value, bool):
        raise TypeError(f"{label} must be true or false, got {value!r}")
    return value


def check_clipping(label: str, value: object) -> float | None:
    """A gradient-clipping norm: None or 0 turn clipping off (0 is DeepSpeed's spelling)."""
    if value is None:
        return None
    clip = check_float(label, value, minimum=0.0)
    return clip if clip > 0 else None


def check_timeout(label: str, value: object) -> float:
    """Seconds a collective may take: finite, > 0 and small enough for a timedelta."""
    timeout = check_float(label, value, positive=True)
    if timeout > _MAX_TIMEOUT_S:
        raise ValueError(f"{label} must be at most {_MAX_TIMEOUT_S:.3g} seconds, got {timeout}")
    return timeout
