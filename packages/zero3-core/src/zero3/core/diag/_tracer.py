"""Chrome/Perfetto trace events: what overlaps and what waits, per rank.

Note:
    The engine calls a tracer only when one is attached (``state.tracer``), so tracing
    costs one attribute check per event site otherwise. Timestamps are wall-clock
    microseconds, so the tracks of ranks on one machine line up in the viewer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["LANES", "Tracer"]

#: Thread lanes of a rank's track: compute, parameter gathers, gradient reductions.
LANES = {"compute": 0, "gather": 1, "reduce": 2}


class Tracer:
    """Collects trace events of one rank in the Chrome trace-event format.

    Args:
        rank: The rank; it becomes the event ``pid`` so each rank gets its own track.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []

    @staticmethod
    def now_us() -> float:
        """Current wall-clock time in microseconds."""
        return time.time_ns() / 1000.0

    def complete(
        self,
        name: str,
        cat: str,
        start_us: float,
        end_us: float,
        lane: str = "compute",
        **args: Any,
    ) -> None:
        """Record a finished interval (a Chrome ``X`` event)."""
        event: dict[str, Any] = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": start_us,
            "dur": max(0.0, end_us - start_us),
            "pid": self.rank,
            "tid": LANES.get(lane, 0),
        }
        if args:
            event["args"] = args
        self.events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, cat: str, lane: str = "compute", **args: Any) -> Iterator[None]:
        """Record the duration of the ``with`` block."""
        start = self.now_us()
        try:
            yield
        finally:
            self.complete(name, cat, start, self.now_us(), lane, **args)

    def chrome_events(self) -> list[dict[str, Any]]:
        """The events plus metadata naming this rank's track and lanes."""
        meta: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank}"},
            },
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": self.rank,
                "args": {"sort_index": self.rank},
            },
        ]
        for lane, tid in LANES.items():
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self.rank,
                    "tid": tid,
                    "args": {"name": lane},
                }
            )
        return meta + self.events
