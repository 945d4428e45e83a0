"""What zero3 undoes in torch.distributed: at interpreter exit, while Python is still whole,
and earlier, when the program asks (:func:`release_groups`).

Note:
    A gloo worker thread that still holds a finished work when the interpreter finalizes
    aborts the process (:ref:`fact-gloo-teardown`). So an ``atexit`` handler, while Python
    is whole, (1) waits boundedly for the collectives zero3 issued and nobody waited for,
    (2) destroys the groups zero3 created, newest first, and (3) closes its backends, so
    that each destroyed group's destructor joins its threads now. Groups the user created
    are left to the user; a collective that cannot finish leaves its group undestroyed
    rather than hang. :func:`release_groups` does the same mid-run, minus the default group
    and groups torch named after their ranks: docs/troubleshooting.rst,
    :ref:`exit-abort` and :ref:`release-groups`.
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

from zero3.comm._departures import announce_departure

__all__ = [
    "EXIT_WAIT_S",
    "ExitParticipant",
    "release_at_exit",
    "release_groups",
    "zero3_groups",
]

_log = logging.getLogger(__name__)

#: How long the exit handler (and, by default, :func:`release_groups`) waits, in all, for
#: collectives nobody waited for.
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
    #: Those of ``groups`` that torch named after their ranks (local synchronization).
    rank_named: list[dist.ProcessGroup] = []
    #: Open backends (weakly: one the program dropped holds nothing any more) ...
    backends: weakref.WeakSet[ExitParticipant] = weakref.WeakSet()
    #: ... except those on a group in ``groups``, held until it is released (the group
    #: is held anyway; :ref:`release-groups`).
    held: list[ExitParticipant] = []


def _among(group: dist.ProcessGroup | None, groups: list[dist.ProcessGroup]) -> bool:
    """Whether ``group`` is one of ``groups`` (by identity: groups compare by identity
    anyway, and this never calls into torch).
    """
    return group is not None and any(group is g for g in groups)


def created_default(group: dist.ProcessGroup) -> None:
    """Record that zero3 initialized the default group ``group``."""
    with _Created.lock:
        _Created.default = group


def created_group(group: dist.ProcessGroup, *, rank_named: bool = False) -> None:
    """Record a group zero3 created with ``new_group``; ``rank_named``: torch named it
    after its ranks (``use_local_synchronization=True``).
    """
    with _Created.lock:
        _Created.groups.append(group)
        if rank_named:
            _Created.rank_named.append(group)


def forget_group(group: dist.ProcessGroup) -> None:
    """A group zero3 created was destroyed by its backend's ``close()``."""
    with _Created.lock:
        if _Created.default is group:
            _Created.default = None
        _Created.groups = [g for g in _Created.groups if g is not group]
        _Created.rank_named = [g for g in _Created.rank_named if g is not group]
        # Other backends on it are held no more: held, they would keep it alive.
        _Created.held = [b for b in _Created.held if b.process_group is not group]


def track(backend: ExitParticipant) -> None:
    """Settle and close ``backend`` at exit (or when its group is released) if it is
    still open then.
    """
    with _Created.lock:
        _Created.backends.add(backend)
        if _among(backend.process_group, _Created.groups):
            _Created.held.append(backend)


def untrack(backend: ExitParticipant) -> None:
    """``backend`` was closed."""
    with _Created.lock:
        _Created.backends.discard(backend)
        _Created.held = [b for b in _Created.held if b is not backend]


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
        _log.warning("zero3.comm: destroying a process group failed: %r", exc)


def release_groups(wait_s: float = EXIT_WAIT_S) -> int:
    """Release the process groups zero3 has created so far, now.

    Destroys the groups zero3 created (its duplicates and host channels: the groups of
    :meth:`CommBackend.duplicate <zero3.comm.CommBackend.duplicate>` and
    :meth:`CommBackend.host_channel <zero3.comm.CommBackend.host_channel>`), newest
    first, after waiting for the collectives issued on them that nobody waited for, and
    closes the zero3 backends on them: such a backend raises
    :class:`~zero3.comm.CommError` from then on. Their gloo threads end, so an idle
    process stops spending CPU on them. The default group and groups zero3 did not create
    are left alone, and so are the backends on them. It is what zero3 does at interpreter
    exit, minus the default group.

    Call it on every rank at the same point, once every rank is done with zero3's
    groups (models sharded before it cannot run collectives after it), and let every rank
    return from it before any rank creates groups again (a rank still connecting to a
    group, or one whose new group gets a destroyed group's name, would otherwise meet a
    peer's half-gone group). It exchanges no messages itself, so ranks that drifted out
    of step do not make it hang.

    Some groups stay (and count in the result): one still running a collective after
    the wait (its backends stay open; a later call tries again), and one torch named
    after its ranks (a duplicate of a subgroup), with every zero3 group older than it,
    until exit; see ``zero3.comm._teardown`` for why.

    Args:
        wait_s: How long to wait, in all, for collectives on zero3's groups that nobody
            waited for. A collective still running then (a peer never issued it) keeps
            its group: the call never waits longer than this for one it can see.

    Returns:
        int: How many of the groups zero3 created are still alive (zero when all were
        released), not counting the default group.

    Note:
        A collective issued on a zero3 group directly through ``torch.distributed`` is
        invisible to the wait: if it cannot finish, destroying its group blocks until the
        group's timeout (the zero3 backend's ``timeout_s``).
    """
    return _release(wait_s, at_exit=False)


def release_at_exit(wait_s: float | None = None) -> None:
    """Settle and close zero3's backends and destroy the groups zero3 created.

    Registered with ``atexit``; safe to call earlier (then every zero3 backend is
    closed, and the default group is destroyed if zero3 created it). See the module note;
    :func:`release_groups` is the variant for a program that goes on.

    Args:
        wait_s: How long to wait, in all, for outstanding collectives (default
            :data:`EXIT_WAIT_S`, or 0 after an uncaught exception).
    """
    if wait_s is None:
        wait_s = 0.0 if getattr(sys, "last_value", None) is not None else EXIT_WAIT_S
    _release(wait_s, at_exit=True)


def _release(wait_s: float, *, at_exit: bool) -> int:
    """The steps of the module note, shared by the exit handler and :func:`release_groups`.

    Returns the number of groups zero3 created that are still alive afterwards (the
    default group not counted).
    """
    deadline = time.monotonic() + wait_s
    with _Created.lock:
        backends = list(_Created.backends)
        default, groups = _Created.default, list(_Created.groups)
        rank_named = list(_Created.rank_named)
    # Which groups may go: at exit all of them; otherwise not a rank-named group, nor,
    # once one is met (newest first), any older group (see the module note).
    doomed: list[dist.ProcessGroup] = []
    for candidate in reversed(groups):
        if not at_exit and _among(candidate, rank_named):
            break
        doomed.append(candidate)  # newest first
    # The backends to settle and close: at exit every one, otherwise those on a zero3
    # group (a group kept for its name included: no backend on a zero3 group outlives
    # the call on one rank but not on another).
    closing = [b for b in backends if at_exit or _among(b.process_group, groups)]
    stuck: list[dist.ProcessGroup] = []
    for backend in closing:
        group = backend.process_group
        if group is not None and not backend.settle(deadline):
            stuck.append(group)
    if stuck:
        _log.warning(
            "zero3.comm: %d process group(s) still have collectives running%s; leaving "
            "them undestroyed",
            len(stuck),
            " at exit (and the default group)" if at_exit else "",
        )

    destroyed = [g for g in doomed if not _among(g, stuck)]
    for group in destroyed:  # newest first
        _destroy(group)
    # Destroying the default group destroys every group, so not while one is stuck.
    drop_default = at_exit and default is not None and not stuck
    if drop_default and dist.group.WORLD is default:
        _destroy(None)
    for backend in closing:
        if not _among(backend.process_group, stuck):
            backend.release()
    with _Created.lock:  # keep references only to what is left
        if drop_default and _Created.default is default:
            _Created.default = None
        _Created.groups = [g for g in _Created.groups if not _among(g, destroyed)]
        _Created.rank_named = [g for g in _Created.rank_named if not _among(g, destroyed)]
        return len(_Created.groups)


def _how_this_process_ends() -> str:
    """For the departure notice: a normal end, or the uncaught exception."""
    error = getattr(sys, "last_value", None)
    if error is None:
        return "its process exited normally: the script ended or called sys.exit"
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return f"its process ended with an uncaught {type(error).__name__}: {text}"


@atexit.register
def _at_exit() -> None:
    try:
        # First, while the groups still stand: a peer that finds this process gone
        # then reads how it ended (zero3.comm._departures).
        announce_departure(_how_this_process_ends())
        release_at_exit()
    except Exception as exc:  # an exit handler must not turn a finished run into a failure
        _log.warning("zero3.comm: releasing process groups at exit failed: %r", exc)
