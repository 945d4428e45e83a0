"""What zero3 undoes in torch.distributed at interpreter exit, while Python is still whole.

Note:
    Why a finished gloo job could end in SIGABRT. gloo runs every collective on a worker
    thread of its process group; once the collective has finished, the waiter is
    released first, and only then does the worker thread drop its reference to the work
    object, which holds the collective's tensors. In torch 2.13 dropping a reference to
    a tensor that has a Python object takes the GIL. A thread that asks for the GIL
    after the interpreter has started to finalize is ended with ``pthread_exit``, whose
    unwinding through the work's ``noexcept`` destructor calls ``std::terminate``:
    "terminate called without an active exception", exit -6, and torchrun reports a
    finished job as failed (seen with gdb: ``runLoop`` -> ``~AsyncWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). It happens
    whenever a worker thread still has a work in hand at finalization: a collective
    issued and never waited for, or one whose waiter ran to the end of the script within
    the few microseconds the worker needs to let go.

    The cure is to end the worker threads before finalization. A process group's C++
    destructor waits for its queue to drain and joins its workers (it releases the GIL
    while it waits, so a worker can still drop its tensors), and it runs when the group
    has been destroyed and the last Python reference to it is gone. So at exit, from an
    ``atexit`` handler (atexit handlers run before finalization starts), zero3:

    1. waits, boundedly, for the collectives its backends issued and nobody waited for;
    2. destroys the groups it created (its duplicates, and the default group when a zero3
       backend initialized it), newest first;
    3. closes its backends, which drops their references to every group, so that a
       destroyed group's destructor runs now, not during finalization.

    Groups the user created are left alone: an ``atexit`` handler the user registered
    before importing zero3 runs after this one and may still use them, and destroying
    them is the owner's call. zero3 only drops its own references, so a group the user
    destroyed really goes away then (otherwise zero3's backends would keep it alive into
    finalization). Plain torch.distributed code should call ``destroy_process_group()``
    when it is done, for the same reason.

    Never a hang: a collective still running when the wait ends (a peer that never
    issued it) leaves its group, and the default group above it, undestroyed and
    referenced, exactly as without this handler, because the destructor would otherwise
    block until the transport's timeout. After an uncaught exception (``sys.last_value``
    is set) there is no wait at all: the ranks are out of step and a failing run should
    end at once.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
from typing import Protocol

import torch.distributed as dist

__all__ = ["EXIT_WAIT_S", "ExitParticipant", "release_at_exit", "zero3_groups"]

_log = logging.getLogger(__name__)

#: How long the exit handler waits, in all, for collectives nobody waited for.
EXIT_WAIT_S = 10.0


class ExitParticipant(Protocol):
    """A backend the exit handler settles and closes (``TorchDistBackend``)."""

    def settle(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for this backend's outstanding
        collectives; return True when none is still running (failed ones count as done).
        """

    def release(self) -> None:
        """Close the backend: forget its outstanding works and its group reference."""

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the backend works on, or None once closed."""


class _Created:
    """The process groups zero3 created, and the backends that hold group references."""

    lock = threading.Lock()
    #: The default group, when a zero3 backend called ``init_process_group``.
    default: dist.ProcessGroup | None = None
    #: Groups zero3 created with ``new_group`` (its duplicates), oldest first.
    groups: list[dist.ProcessGroup] = []
    #: Open backends (weakly: one the program dropped holds nothing any more).
    backends: weakref.WeakSet[ExitParticipant] = weakref.WeakSet()


def created_default(group: dist.ProcessGroup) -> None:
    """Record that zero3 initialized the default group ``group``."""
    with _Created.lock:
        _Created.default = group


def created_group(group: dist.ProcessGroup) -> None:
    """Record a group zero3 created with ``new_group``."""
    with _Created.lock:
        _Created.groups.append(group)


def forget_group(group: dist.ProcessGroup) -> None:
    """A group zero3 created was destroyed by its backend's ``close()``."""
    with _Created.lock:
        if _Created.default is group:
            _Created.default = None
        _Created.groups = [g for g in _Created.groups if g is not group]


def track(backend: ExitParticipant) -> None:
    """Settle and close ``backend`` at exit if it is still open then."""
    with _Created.lock:
        _Created.backends.add(backend)


def untrack(backend: ExitParticipant) -> None:
    """``backend`` was closed."""
    with _Created.lock:
        _Created.backends.discard(backend)


def zero3_groups() -> list[dist.ProcessGroup]:
    """The groups zero3 created and has not destroyed yet (the default group first)."""
    with _Created.lock:
        first = [_Created.default] if _Created.default is not None else []
        return first + list(_Created.groups)


def _destroy(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group`` (None: the default group, and with it every group)."""
    if group is None and not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": destroyed already
        pass
    except Exception as exc:  # one group that fails to go must not keep the others
        _log.warning("zero3.comm: destroying a process group at exit failed: %r", exc)


def release_at_exit(wait_s: float | None = None) -> None:
    """Settle and close zero3's backends and destroy the groups zero3 created.

    Registered with ``atexit``; safe to call earlier (then every zero3 backend is
    closed). See the module note.

    Args:
        wait_s: How long to wait, in all, for outstanding collectives (default
            :data:`EXIT_WAIT_S`, or 0 after an uncaught exception).
    """
    if wait_s is None:
        wait_s = 0.0 if getattr(sys, "last_value", None) is not None else EXIT_WAIT_S
    deadline = time.monotonic() + wait_s
    with _Created.lock:
        backends = list(_Created.backends)
        default, groups = _Created.default, list(_Created.groups)
    stuck: list[dist.ProcessGroup] = []
    for backend in backends:
        group = backend.process_group
        if group is not None and not backend.settle(deadline):
            stuck.append(group)
    if stuck:
        _log.warning(
            "zero3.comm: %d process group(s) still have collectives running at exit; "
            "leaving them (and the default group) undestroyed",
            len(stuck),
        )

    def is_stuck(group: dist.ProcessGroup) -> bool:
        return any(group is s for s in stuck)

    for group in reversed(groups):
        if not is_stuck(group):
            _destroy(group)
    # Destroying the default group destroys every group, so not while one is stuck.
    if default is not None and not stuck and dist.group.WORLD is default:
        _destroy(None)
    for backend in backends:
        group = backend.process_group
        if group is None or not is_stuck(group):
            backend.release()
    with _Created.lock:  # keep references only to what was left running
        if _Created.default is default and not stuck:
            _Created.default = None
        _Created.groups = [g for g in _Created.groups if is_stuck(g)]


@atexit.register
def _at_exit() -> None:
    try:
        release_at_exit()
    except Exception as exc:  # an exit handler must not turn a finished run into a failure
        _log.warning("zero3.comm: releasing process groups at exit failed: %r", exc)
