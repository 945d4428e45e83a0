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
import torch.distributed as dist

from zero3.comm import _builtin
from zero3.comm._backend import CommBackend
from zero3.comm._launch import default_device_type, launched_by_mpi
from zero3.comm._plugins import ENTRY_POINT_GROUP, PROJECT, BackendRegistry, Specs
from zero3.comm._types import BackendUnavailableError

__all__ = ["available_backends", "backend_class", "create_backend", "registered_backends"]

_DEFAULT_BY_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


class _State:
    lock = threading.Lock()
    manager: pluggy.PluginManager | None = None
    registry: BackendRegistry | None = None


def _load() -> tuple[pluggy.PluginManager, BackendRegistry]:
    with _State.lock:
        if _State.manager is None or _State.registry is None:
            manager = pluggy.PluginManager(PROJECT)
            manager.add_hookspecs(Specs)
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
