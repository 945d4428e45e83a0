"""Leaf-module targets and the one matcher that finds the modules they select."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

from torch import nn

__all__ = ["LeafTarget", "ModulePath", "check_leaf_targets", "match_leaf_modules"]


@dataclasses.dataclass(frozen=True)
class ModulePath:
    """A leaf target given by where the module sits in the model, not by its class.

    ``path`` is a qualified module name as ``model.named_modules()`` spells it
    (``"layers.0.mlp"``). With ``suffix=True`` every module whose qualified name ends
    with ``path`` is selected (``ModulePath("mlp", suffix=True)`` selects
    ``layers.0.mlp``, ``layers.1.mlp``... and also ``layers.0.shared_mlp``): the plain
    string test DeepSpeed applies to ``leaf_module.name_suffixes``.

    Attributes:
        path: The qualified module name, or the end of one.
        suffix: Match names that end with ``path`` instead of names equal to it.
    """

    path: str
    suffix: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise TypeError(
                f"ModulePath.path must be a non-empty module name like 'layers.0.mlp', "
                f"got {self.path!r}"
            )
        if not isinstance(self.suffix, bool):
            raise TypeError(f"ModulePath.suffix must be a bool, got {self.suffix!r}")

    def selects(self, name: str) -> bool:
        """Whether the module named ``name`` (from ``named_modules()``) is selected."""
        return name.endswith(self.path) if self.suffix else name == self.path


#: What can mark a leaf: a module class (instances and subclasses match), a class name
#: (bare ``"MoEBlock"`` or qualified ``"pkg.mod.MoEBlock"``; the exact class only), or a
#: :class:`~zero3.core.ModulePath` (a place in the model).
LeafTarget = type[nn.Module] | str | ModulePath


def check_leaf_targets(label: str, targets: object) -> tuple[LeafTarget, ...]:
    """Validate leaf targets (one target or a list/tuple of them) and return a tuple.

    Raises:
        TypeError: An entry is neither a module class, a class name nor a ModulePath.
    """
    if isinstance(targets, str | type | ModulePath):
        targets = (targets,)
    if not isinstance(targets, list | tuple):
        raise TypeError(
            f"{label} must be a tuple of nn.Module classes, class names or ModulePath "
            f"targets, got {targets!r}"
        )
    for target in targets:
        ok = (
            (isinstance(target, str) and bool(target))
            or isinstance(target, ModulePath)
            or (isinstance(target, type) and issubclass(target, nn.Module))
        )
        if not ok:
            raise TypeError(
                f"{label} entries must be nn.Module subclasses, class names like "
                "'transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock', or "
                f"ModulePath('layers.0.mlp') module paths, got {target!r}"
            )
    return tuple(targets)


def _class_names(module: nn.Module) -> tuple[str, str]:
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _selects(target: LeafTarget, name: str, module: nn.Module) -> bool:
    if isinstance(target, ModulePath):
        return target.selects(name)
    if isinstance(target, str):
        return target in _class_names(module)
    return isinstance(module, target)


def match_leaf_modules(
    root: nn.Module, targets: Sequence[LeafTarget], *, source: str
) -> list[tuple[str, nn.Module]]:
    """Every module of ``root`` (itself included) that one of ``targets`` selects.

    Args:
        root: The model.
        targets: Leaf targets (classes, class names or :class:`~zero3.core.ModulePath` places).
        source: Who asks, for the error message (``"Zero3Config.leaf_modules"``).

    Returns:
        ``(qualified_name, module)`` pairs in ``root.named_modules()`` order; the root's
        name is ``""``.

    Raises:
        TypeError: A target is not a class, a class name or a ModulePath.
        ValueError: A target selects no module; the message names every such target,
            the model, and the closest names the model has.
    """
    targets = check_leaf_targets(source, targets)
    named = list(root.named_modules())
    chosen: list[tuple[str, nn.Module]] = []
    hit: set[int] = set()
    for name, module in named:
        found = [i for i, t in enumerate(targets) if _selects(t, name, module)]
        hit.update(found)
        if found:
            chosen.append((name, module))
    missing = [t for i, t in enumerate(targets) if i not in hit]
    if missing:
        reasons = "; ".join(_why_unmatched(t, named) for t in missing)
        raise ValueError(
            f"{source}: no module of {type(root).__name__} matches {len(missing)} "
            f"target{'s' if len(missing) > 1 else ''}: {reasons}"
        )
    return chosen


def _why_unmatched(target: LeafTarget, named: list[tuple[str, nn.Module]]) -> str:
    if isinstance(target, ModulePath):
        names = [n for n, _ in named if n]
        kind = "ends with" if target.suffix else "is named"
        what = "suffix" if target.suffix else "path"
        text = f"module {what} {target.path!r} (no submodule's qualified name {kind} it"
        candidates = names
    elif isinstance(target, str):
        text = f"class name {target!r} (no submodule's class is named so, bare or module-qualified"
        candidates = sorted({c for _, m in named for c in _class_names(m)})
    else:
        text = f"class {target.__module__}.{target.__qualname__} (no submodule is an instance of it"
        candidates = []
    close = difflib.get_close_matches(
        target.path if isinstance(target, ModulePath) else str(target), candidates, n=3
    )
    return text + (f"; closest: {', '.join(map(repr, close))})" if close else ")")
