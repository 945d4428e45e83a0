"""Rank 0's report of each step: a progress bar on a terminal, plain lines in a log."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    """Per-step loss and speed, as a tqdm bar when ``stream`` is a terminal.

    A bar redraws itself with carriage returns; written to a file or a pipe (a redirected
    log, a batch job's output) it becomes one line of thousands of characters. There,
    and with ``bar=False``, it prints a plain line at the first step, every ``every``
    steps and at the last.

    Args:
        total: The run's last step (steps are counted from 1).
        start: Steps already done (a resumed run).
        bar: Whether a terminal gets the bar (``--no-progress`` says no).
        stream: Where to write (``sys.stdout`` as it is now, if None).
        every: The plain lines' period in steps.
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        bar: bool = True,
        stream: TextIO | None = None,
        every: int = 10,
    ) -> None:
        self.total, self.start, self.every = total, start, every
        self.stream = stream if stream is not None else sys.stdout
        self._bar: Any = None
        if bar and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total - start, desc="train", unit="step", dynamic_ncols=True, file=self.stream
            )

    @property
    def is_bar(self) -> bool:
        """Whether steps are drawn as a bar (else as plain lines)."""
        return self._bar is not None

    def step(self, done: int, loss: float, tokens_per_s: float, step_s: float) -> None:
        """Report step ``done`` (1-based): its loss, tokens/s and seconds."""
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", step_s=f"{step_s:.2f}"
            )
            self._bar.update(1)
        elif done == self.start + 1 or done % self.every == 0 or done == self.total:
            print(
                f"step {done}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
                f"{step_s:.3f} s/step",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        """End the bar (a no-op for plain lines)."""
        if self._bar is not None:
            self._bar.close()
