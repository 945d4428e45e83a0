"""Backend discovery through pluggy, used only at setup time.

Note:
    pluggy finds backend *classes* (built-ins first, then plugins from the
    ``zero3.comm`` entry-point group); once :func:`create_backend` has returned an
    instance, collectives are plain method calls. Nothing on the hot path goes through
    pluggy, the same split tox uses for its backend registration.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from typing import Any

import pluggy
import torch
import torch.distributed as dist

from zero3.comm._backend import CommBackend
from zero3.comm._launch import launched_by_mpi
from zero3.comm._types import BackendUnavailableError, UnknownBackendError

__all__ = [
    "BackendRegistry",
    "available_backends",
    "create_backend",
    "default_device_type",
    "hookimpl",
    "hookspec",
    "local_device_index",
    "local_rank",
    "registered_backends",
]

PROJECT = "zero3.comm"
ENTRY_POINT_GROUP = "zero3.comm"

#: Marker for plugin hook implementations (``@zero3.comm.hookimpl``).
hookimpl = pluggy.HookimplMarker(PROJECT)
hookspec = pluggy.HookspecMarker(PROJECT)

_DEFAULT_BY_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
#: Where launchers put a process's rank *on its node*, most specific first: torchrun (and
#: zero3's own launchers), Open MPI, MPICH's hydra, Slurm's srun.
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


class BackendRegistry:
    """Name → backend class table filled by ``zero3_comm_register_backends`` hooks."""

    def __init__(self) -> None:
        self._classes: dict[str, type[CommBackend]] = {}
        #: Plugins (entry-point name -> error) that failed to load.
        self.broken: dict[str, str] = {}

    def register(
        self, name: str, backend_cls: type[CommBackend], *, override: bool = False
    ) -> None:
        """Register ``backend_cls`` under ``name``.

        Args:
            name: The name users pass to :func:`create_backend`.
            backend_cls: A :class:`~zero3.comm.CommBackend` subclass.
            override: Replace an existing registration of the same name. Without it a
                duplicate name is an error, so two plugins never silently shadow each other.

        Raises:
            TypeError: ``backend_cls`` is not a CommBackend subclass.
            ValueError: ``name`` is already registered and ``override`` is False.
        """
        if not (isinstance(backend_cls, type) and issubclass(backend_cls, CommBackend)):
            raise TypeError(
                f"backend {name!r}: {backend_cls!r} is not a subclass of zero3.comm.CommBackend"
            )
        if not name or not isinstance(name, str):
            raise ValueError(f"backend name must be a non-empty string, got {name!r}")
        existing = self._classes.get(name)
        if existing is not None and existing is not backend_cls and not override:
            raise ValueError(
                f"comm backend {name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; pass override=True to "
                f"registry.register() to replace it with {backend_cls.__qualname__}"
            )
        self._classes[name] = backend_cls

    def get(self, name: str) -> type[CommBackend]:
        """Return the class registered under ``name``.

        Raises:
            UnknownBackendError: Nothing is registered under ``name``.
        """
        try:
            return self._classes[name]
        except KeyError:
            known = ", ".join(sorted(self._classes)) or "(none)"
            broken = "".join(f"; plugin {k!r} failed to load: {v}" for k, v in self.broken.items())
            raise UnknownBackendError(
                f"unknown comm backend {name!r}; registered backends: {known}. "
                f"Plugins register more through the 'zero3.comm' entry-point group{broken}"
            ) from None

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._classes)


class _Specs:
    @hookspec
    def zero3_comm_register_backends(self, registry: BackendRegistry) -> None:
        """Register backend classes with ``registry.register(name, cls, override=False)``."""

    @hookspec(firstresult=True)
    def zero3_comm_default_backend(self, device_type: str) -> str | None:
        """Return the backend name ``"auto"`` should mean on ``device_type``, or None."""


class _State:
    lock = threading.Lock()
    manager: pluggy.PluginManager | None = None
    registry: BackendRegistry | None = None


def _load() -> tuple[pluggy.PluginManager, BackendRegistry]:
    with _State.lock:
        if _State.manager is None or _State.registry is None:
            from zero3.comm import _builtin

            manager = pluggy.PluginManager(PROJECT)
            manager.add_hookspecs(_Specs)
            manager.register(_builtin, name="zero3.comm.builtin")
            registry = BackendRegistry()
            registry.broken = _load_plugins(manager)
            manager.hook.zero3_comm_register_backends(registry=registry)
            _State.manager, _State.registry = manager, registry
        return _State.manager, _State.registry


def _load_plugins(manager: pluggy.PluginManager) -> dict[str, str]:
    """Register each entry-point plugin; one that fails to import is reported, not fatal.

    pluggy's ``load_setuptools_entrypoints`` stops at the first broken plugin, which would
    take the built-in backends down with it; here each plugin stands alone.
    """
    broken: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if manager.get_plugin(ep.name) is not None or manager.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
            manager.register(plugin, name=ep.name)
        except Exception as exc:
            broken[ep.name] = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"zero3.comm: the plugin {ep.name!r} ({ep.value}) failed to load and is "
                f"skipped: {broken[ep.name]}",
                stacklevel=3,
            )
    return broken


def _reset_registry() -> None:
    """Forget the loaded registry (tests that install plugins at run time use this)."""
    with _State.lock:
        _State.manager = None
        _State.registry = None


def registered_backends() -> list[str]:
    """Names of every registered backend, built-ins first, usable here or not."""
    return _load()[1].names()


def available_backends() -> list[str]:
    """Names of the registered backends that can run on this machine."""
    registry = _load()[1]
    return [name for name in registry.names() if registry.get(name).is_available()]


def default_device_type() -> str:
    """The accelerator this process would use: ``"cuda"``, ``"npu"`` or ``"cpu"``."""
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)  # present only when torch_npu is loaded
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def local_rank() -> tuple[int, str] | None:
    """This process's rank on its node, and the variable it was read from; None if no
    launcher said (a single process, or a launcher that sets none of them).

    Note:
        Device choice and anything kept per node must use this, never the global
        ``RANK``: on the second node of two with 8 GPUs each, global ranks 8-15 are
        local ranks 0-7.
    """
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value), var
    return None


def local_device_index(device_count: int, backend: str) -> int | None:
    """The accelerator index this process should use, from its local rank.

    Args:
        device_count: Devices visible to this process.
        backend: The backend asking (for the error message).

    Returns:
        The local rank when it names a visible device; 0 when the process sees a single
        device (a launcher gave each rank its own, e.g. ``CUDA_VISIBLE_DEVICES`` per rank);
        None when no launcher set a local rank (the caller keeps the current device).

    Raises:
        ValueError: The local rank has no device of its own: more ranks were started on
            this node than it has visible devices (two ranks on one device would fail
            later inside NCCL/HCCL, or silently share it).
    """
    found = local_rank()
    if found is None:
        return None
    rank, var = found
    if device_count == 1:
        return 0
    if 0 <= rank < device_count:
        return rank
    raise ValueError(
        f"zero3.comm {backend}: this process is local rank {rank} ({var}={rank}) but only "
        f"{device_count} devices are visible on its node; start at most {device_count} "
        f"ranks per node (torchrun --nproc-per-node {device_count}), or give each rank "
        "its own device (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES)"
    )


def _auto_name(manager: pluggy.PluginManager, registry: BackendRegistry) -> str:
    device_type = default_device_type()
    chosen = manager.hook.zero3_comm_default_backend(device_type=device_type)
    if chosen:
        return str(chosen)
    if device_type == "cpu" and not dist.is_initialized():
        # Under mpiexec with no torch launcher variables, MPI is the only rendezvous.
        under_mpi = launched_by_mpi()
        has_torch_env = all(v in os.environ for v in ("MASTER_ADDR", "MASTER_PORT"))
        mpi_ok = "mpi" in registry.names() and registry.get("mpi").is_available()
        if under_mpi and not has_torch_env and mpi_ok:
            return "mpi"
    return _DEFAULT_BY_DEVICE.get(device_type, "gloo")


def backend_class(name: str = "auto") -> type[CommBackend]:
    """The backend class ``name`` resolves to, checked to be usable here.

    Args:
        name: A registered name (:func:`registered_backends`) or ``"auto"``: a plugin's
            ``zero3_comm_default_backend`` answer if any, else ``nccl`` on CUDA, ``hccl``
            on Ascend NPU, ``gloo`` on CPU (``mpi`` when launched by ``mpiexec`` alone).

    Raises:
        UnknownBackendError: ``name`` is not registered (the message lists those that are).
        BackendUnavailableError: The backend cannot run here (the message says why).
    """
    manager, registry = _load()
    resolved = _auto_name(manager, registry) if name == "auto" else name
    cls = registry.get(resolved)
    reason = cls.unavailable_reason()
    if reason is not None:
        available = ", ".join(available_backends()) or "(none)"
        raise BackendUnavailableError(
            f"comm backend {resolved!r} is not available here: {reason}. "
            f"Available backends: {available}"
        )
    return cls


def create_backend(name: str = "auto", **options: Any) -> CommBackend:
    """Build a ready backend instance from a registered name.

    Args:
        name: As for :func:`backend_class`.
        **options: Passed to the backend's constructor, e.g. ``timeout_s=60``.

    Raises:
        UnknownBackendError: ``name`` is not registered (the message lists those that are).
        BackendUnavailableError: The backend cannot run here (the message says why).
    """
    return backend_class(name)(**options)
