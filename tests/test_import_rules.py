"""Import rules beyond import-linter's layer contracts (those run in ``./dev lint``).

Each distribution talks to the others through their public names only, and imports
no distribution its own ``pyproject.toml`` does not declare (dependencies or extras):
a user who installs ``zero3-comm`` alone, or comm+core+hooks for inference, must get a
package that imports. import-linter checks layers but reads no package metadata, and
its wildcards cannot say "any module whose name starts with an underscore", so these
two rules read the imports here.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").glob("zero3-*") if (p / "src").is_dir())
#: Modules of optional accelerator stacks that are never installed here, and the
#: distribution that provides each (as the extras name it).
NOT_INSTALLED = {"torch_npu": "torch-npu", "cupy": "cupy-cuda12x"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, imported names) for every absolute import in a file."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def _own_package(path: Path) -> str | None:
    """``"core"`` for a file of packages/zero3-core/src, None for tools/."""
    for package in PACKAGES:
        if package / "src" in path.parents:
            return package.name.removeprefix("zero3-")
    return None


def _private_reach(module: str, names: list[str], own: str | None) -> str | None:
    parts = module.split(".")
    if parts[0] != "zero3" or len(parts) < 2 or parts[1] == own:
        return None
    if any(part.startswith("_") for part in parts[2:]):
        return module
    private = [name for name in names if name.startswith("_")]
    return f"{module}.{private[0]}" if private else None


def _sources() -> list[Path]:
    files = [f for p in PACKAGES for f in sorted((p / "src").rglob("*.py"))]
    return files + sorted((ROOT / "tools").rglob("*.py"))


def test_no_distribution_reaches_into_another_ones_private_modules() -> None:
    found = []
    for path in _sources():
        own = _own_package(path)
        for line, module, names in _imports(path):
            reach = _private_reach(module, names, own)
            if reach is not None:
                found.append(f"{path.relative_to(ROOT)}:{line}: {reach}")
    assert not found, "imports of another distribution's private names:\n" + "\n".join(found)


def _declared(package: Path) -> set[str]:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    names = {_normalize(re.match(r"[A-Za-z0-9_.-]+", spec).group(0)) for spec in specs}  # type: ignore[union-attr]
    return names | {_normalize(project["name"])}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def _workspace_tops() -> dict[str, str]:
    """The top-level packages of the workspace's distributions outside the ``zero3``
    namespace (tools/, tests/plugin/), by their pyproject: editable installs record no
    package files, so ``packages_distributions`` cannot name them."""
    tops = {}
    for pyproject in [
        ROOT / "tools" / "pyproject.toml",
        *ROOT.glob("tests/plugin/*/pyproject.toml"),
    ]:
        config = tomllib.loads(pyproject.read_text())
        for package in config["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]:
            tops[Path(package).name] = _normalize(config["project"]["name"])
    return tops


def _distributions(top: str) -> set[str]:
    if top in NOT_INSTALLED:
        return {NOT_INSTALLED[top]}
    if top in _workspace_tops():
        return {_workspace_tops()[top]}
    return {_normalize(d) for d in _installed().get(top, [])}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_import_is_a_declared_dependency(package: Path) -> None:
    declared = _declared(package)
    missing = []
    for path in sorted((package / "src").rglob("*.py")):
        for line, module, _ in _imports(path):
            parts = module.split(".")
            if parts[0] in sys.stdlib_module_names or parts[0] == "__future__":
                continue
            if parts[0] == "zero3":
                needed = {_normalize(f"zero3-{parts[1]}")} if len(parts) > 1 else set()
            else:
                needed = _distributions(parts[0])
                assert needed, f"{path}:{line}: no installed distribution provides {module!r}"
            if needed and not needed & declared:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {module} ({sorted(needed)})")
    assert not missing, (
        f"{package.name} imports distributions its pyproject.toml does not declare:\n"
        + "\n".join(missing)
    )


def test_the_rules_catch_what_they_are_for(tmp_path: Path) -> None:
    """The checks above are not vacuous: a planted violation of each is found."""
    assert _private_reach("zero3.core.model._state", [], "hooks") == "zero3.core.model._state"
    assert _private_reach("zero3.core", ["_matches"], "hooks") == "zero3.core._matches"
    assert _private_reach("zero3.core.model._state", [], "core") is None
    assert _private_reach("zero3.core", ["Zero3Config"], None) is None
    comm = next(p for p in PACKAGES if p.name == "zero3-comm")
    assert "transformers" not in _declared(comm)
    assert _distributions("transformers") == {"transformers"}
    assert _distributions("_train") == {"zero3-tools"}
