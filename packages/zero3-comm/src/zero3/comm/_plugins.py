"""The plugin side of backend discovery: pluggy's markers, the hook specifications and
the name → class table the hooks fill.
"""

from __future__ import annotations

import pluggy

from zero3.comm._backend import CommBackend
from zero3.comm._types import UnknownBackendError

__all__ = ["ENTRY_POINT_GROUP", "PROJECT", "BackendRegistry", "Specs", "hookimpl", "hookspec"]

PROJECT = "zero3.comm"
ENTRY_POINT_GROUP = "zero3.comm"

#: Marker for plugin hook implementations (``@zero3.comm.hookimpl``).
hookimpl = pluggy.HookimplMarker(PROJECT)
hookspec = pluggy.HookspecMarker(PROJECT)


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


class Specs:
    """The hook specifications plugins implement."""

    @hookspec
    def zero3_comm_register_backends(self, registry: BackendRegistry) -> None:
        """Register backend classes with ``registry.register(name, cls, override=False)``."""

    @hookspec(firstresult=True)
    def zero3_comm_default_backend(self, device_type: str) -> str | None:
        """Return the backend name ``"auto"`` should mean on ``device_type``, or None."""
