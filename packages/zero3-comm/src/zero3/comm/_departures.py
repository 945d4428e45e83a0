"""Which peer left: notices in the job's rendezvous store, read when a peer's connection
closes.

Note (naming the peer that left):
    When a rank's process ends while its peers still expect it (it saved on rank 0
    only and exited, it had one batch fewer, it called ``sys.exit``), the peers' next
    gloo collective fails with "Connection closed by peer [address]:port, typically
    caused by a remote worker crashing": no rank, no reason. So each process leaves two
    entries in the job's rendezvous store (the store every process of a
    ``torch.distributed`` job shares; torchrun's agent keeps it for the job):

    * when it first makes a zero3 backend, ``zero3/pid/<restart>/<rank>`` = its host and
      process id;
    * at interpreter exit (zero3's exit handler), ``zero3/left/<restart>/<rank>`` = how
      it ended: normally (the script returned or called ``sys.exit``), or with an
      uncaught exception (its type and message).

    A collective that fails because a peer's connection closed reads them
    (:func:`describe_gone`): a peer with a notice left as it says; one without a notice
    whose process id on this host no longer runs crashed or was killed (its own output
    says why). ``<restart>`` is torchrun's restart count, so an elastic restart does not
    read the previous attempt's notices. Every store access is bounded (2 s) and any
    failure of it is silent: the notices only add words to an error that is raised
    anyway. A process killed outright (SIGKILL, the OOM killer) leaves no notice, and a
    store served by the rank that left (a ``tcp://`` rendezvous on rank 0 outside
    torchrun) is gone with it; the error then says what it can.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["announce_departure", "describe_gone", "looks_like_peer_gone", "note_arrival"]

_T = TypeVar("_T")

#: Bound on every store access, in seconds.
STORE_WAIT_S = 2.0
#: Fragments of the transport's error when a peer's connection went away.
_GONE = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "ECONNRESET")

#: The store this process left its arrival in (a new default group has a new store).
_arrived: Any = None


def looks_like_peer_gone(message: str) -> bool:
    """Whether a collective's error says that a peer's connection went away."""
    lowered = message.lower()
    return any(fragment.lower() in lowered for fragment in _GONE)


def _key(kind: str, rank: int) -> str:
    return f"zero3/{kind}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _bounded(fn: Callable[[], _T]) -> _T | None:
    """``fn()`` in a daemon thread, waited for at most :data:`STORE_WAIT_S`; None if it
    failed or is still running (a store whose server is gone can block).
    """
    box: list[Any] = []

    def run() -> None:
        # The notices are a courtesy: never an error of their own.
        with contextlib.suppress(Exception):
            box.append(fn())

    thread = threading.Thread(target=run, name="zero3-store", daemon=True)
    thread.start()
    thread.join(STORE_WAIT_S)
    return box[0] if box else None


def _store() -> Any:
    """The default group's store, or None (torch keeps it privately; no group yet)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None or not dist.is_initialized():
        return None
    try:
        return get()
    except (RuntimeError, ValueError):
        return None


def note_arrival() -> None:
    """Leave this process's host and id in the store (once per process)."""
    global _arrived
    store = _store()
    if store is None or store is _arrived:
        return
    _arrived = store
    rank = dist.get_rank()
    _bounded(lambda: store.set(_key("pid", rank), f"{socket.gethostname()} {os.getpid()}"))


def announce_departure(how: str) -> None:
    """Leave in the store how this process ends (zero3's exit handler calls it)."""
    store = _store()
    if store is None or store is not _arrived:
        return  # no zero3 backend on this group: nobody expects this process
    rank = dist.get_rank()
    _bounded(lambda: store.set(_key("left", rank), how))


def _read(store: Any, key: str) -> str | None:
    def get() -> str | None:
        if not store.check([key]):
            return None
        value = store.get(key)
        return value.decode() if isinstance(value, bytes) else str(value)

    return _bounded(get)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (an exited one not yet reaped by
    its parent, a zombie, does not).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _why(store: Any, rank: int, host: str) -> str | None:
    """How global rank ``rank`` is gone, or None if nothing says it is."""
    left = _read(store, _key("left", rank))
    if left is not None:
        return f"left the job ({left})"
    arrival = _read(store, _key("pid", rank))
    if arrival is None:
        return None
    where, _, pid = arrival.partition(" ")
    if where == host and pid.isdigit() and not _alive(int(pid)):
        return (
            f"is gone: its process (pid {pid} on this host) ended without zero3's exit "
            "handler running, so it crashed or was killed (its own output says why)"
        )
    return None


def describe_gone(group: dist.ProcessGroup | None) -> tuple[dict[int, str], bool]:
    """What is known about peers of ``group`` that are gone: ``{group rank: how}``, and
    whether the store could be read at all.
    """
    store = _store()
    if store is None or group is None or not dist.is_initialized():
        return {}, False
    if _bounded(lambda: store.check([_key("pid", dist.get_rank())])) is None:
        return {}, False  # the store is unreachable (its server left?)
    host = socket.gethostname()
    gone: dict[int, str] = {}
    for group_rank, rank in enumerate(dist.get_process_group_ranks(group)):
        if rank == dist.get_rank():
            continue
        why = _why(store, rank, host)
        if why is not None:
            gone[group_rank] = why
    return gone, True
