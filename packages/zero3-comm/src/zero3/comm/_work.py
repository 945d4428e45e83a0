"""Handles for collectives in flight."""

from __future__ import annotations

import abc
from collections.abc import Callable

from zero3.comm._stream import Stream

__all__ = ["CompletedWork", "ThenWork", "Work"]


class Work(abc.ABC):
    """A collective in flight.

    Outputs are valid only after :meth:`wait`. ``wait(stream)`` makes ``stream`` (the
    consumer) wait for the collective: on devices this queues a dependency without
    blocking the host; on CPU it blocks the host until the data has arrived. ``wait``
    may be called more than once; later calls return at once.
    """

    @abc.abstractmethod
    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for this collective.

        Raises:
            CommTimeoutError: The collective did not finish within the backend's timeout.
            CommError: The collective failed (for example, a peer died).
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Return True once the collective has finished (never blocks)."""


class CompletedWork(Work):
    """A collective that finished synchronously (or had nothing to do)."""

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class ThenWork(Work):
    """Run ``then`` once, on the consumer stream, after ``inner`` completes.

    The base class's coalesced collectives use it to unpack a flat buffer into the
    caller's list of outputs.
    """

    def __init__(self, inner: Work, then: Callable[[], None]) -> None:
        self._inner = inner
        self._then: Callable[[], None] | None = then

    def wait(self, stream: Stream | None = None) -> None:
        self._inner.wait(stream)
        if self._then is not None:
            then, self._then = self._then, None
            if stream is None:
                then()
            else:
                with stream.use():
                    then()

    def is_completed(self) -> bool:
        return self._inner.is_completed()
