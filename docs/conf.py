"""Sphinx configuration of the zero3 documentation site.

Built by ``./dev docs`` (``sphinx -W --keep-going -n``): every warning is an error and
every cross-reference must resolve. The packages are imported from the workspace's
editable installs, so the API reference is always the code's own docstrings.
"""

from __future__ import annotations

project = "zero3"
author = "the zero3 authors"
copyright = "the zero3 authors"

extensions = [
    "sphinx.ext.autodoc",  # API reference from the docstrings
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.viewcode",  # "[source]" links: the code next to its documentation
]

exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "zero3"
html_static_path = ["_static"]
# Tables fit the content column (docs/_static/zero3.css says how).
html_css_files = ["zero3.css"]
pygments_style = "sphinx"
pygments_dark_style = "monokai"

# -- autodoc / napoleon ----------------------------------------------------------------

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Optional libraries are imported lazily by the backends that need them; mocking them
# keeps the build independent of what happens to be installed (autodoc imports every
# module it documents, and a module importing a missing library would fail the build).
autodoc_mock_imports = ["torch_npu", "mpi4py", "cupy"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Napoleon would copy each dataclass field's annotation into the "Attributes" entries;
# it splits types like ``tuple[type[Module] | str, ...]`` at the comma and produces
# dangling references. The class signature already shows every field's type.
napoleon_attr_annotations = False
python_use_unqualified_type_names = True
add_module_names = False

# -- cross-references --------------------------------------------------------------------

nitpicky = True
# There is no internet access where the docs are built, so intersphinx cannot fetch
# the inventories of Python, torch or pluggy. References to their types therefore
# cannot resolve; each ignore below is limited to one such external namespace.
nitpick_ignore_regex = [
    # Private type variables of generic helpers (``_T``) have no page of their own.
    (r"py:class", r"zero3\..+\._T"),
    # PartitionedOptimizer.offload's store is made by the optimizer, not by users; its
    # stats, files and close() are described on the property and on the Offload page.
    (r"py:class", r"zero3\.optim\._offload\.OffloadStore"),
    # torch: tensors, dtypes, devices, nn.Module, optimizers, process groups. Type hints
    # render under torch's real module paths (torch.nn.modules.module.Module...).
    (r"py:(class|obj|exc)", r"torch(\..+)?"),
    # Annotations autodoc cannot evaluate (names imported only under TYPE_CHECKING, or
    # torch aliases in string annotations) stay as written in the source: these are
    # torch's nn.Parameter, torch.distributed.ProcessGroup and torch.distributed.Store.
    (r"py:class", r"nn\.Parameter|dist\.ProcessGroup|Store"),
    # transformers and accelerate (zero3-hf's bases: Trainer, TrainingArguments).
    (r"py:(class|obj|exc)", r"(transformers|accelerate)(\..+)?"),
    # pluggy: hookimpl is a pluggy.HookimplMarker; the registry is used through it.
    (r"py:(class|obj)", r"pluggy(\..+)?"),
    # The Python standard library (no intersphinx: see above). Only the names the
    # annotations use.
    (
        r"py:(class|obj|exc)",
        r"collections\.abc\.(Callable|Collection|Iterable|Iterator|Mapping|Sequence)"
        r"|abc\.ABC|enum\.(Int)?Enum|os\.PathLike|threading\.Thread|types\.ModuleType"
        r"|io\.BytesIO|pathlib\.Path|concurrent\.futures\._base\.Future",
    ),
]


# -- dataclass signatures ----------------------------------------------------------------


def _factory_defaults(app, what, name, obj, options, signature, return_annotation):
    """Show a dataclass field's ``default_factory`` result instead of ``<factory>``.

    ``<factory>`` is not a Python expression, so Sphinx cannot parse such a signature
    and falls back to splitting it at every comma, which breaks the cross-references
    of annotations like ``Mapping[str, Any]``. The factory's value (``{}``, ``[]``...)
    is what a caller who omits the field gets.
    """
    import dataclasses

    if what != "class" or not signature or "<factory>" not in signature:
        return None
    if not dataclasses.is_dataclass(obj):
        return None
    for field in dataclasses.fields(obj):
        if field.init and field.default_factory is not dataclasses.MISSING:
            signature = signature.replace("<factory>", repr(field.default_factory()), 1)
    return signature, return_annotation


# -- private parameters ---------------------------------------------------------------------


def _split_top_level(text):
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _hide_private_parameters(app, what, name, obj, options, signature, return_annotation):
    """Leave parameters whose name starts with ``_`` out of a documented signature.

    They are not part of the API: ``Zero3Trainer.save_model`` keeps transformers'
    ``_internal_call`` only because the ``Trainer`` calls it with that keyword.
    """
    if what not in ("method", "function") or not signature or "_" not in signature:
        return None
    inner = signature.strip()[1:-1]
    kept = [p for p in _split_top_level(inner) if not p.strip().lstrip("*").startswith("_")]
    if len(kept) == len(_split_top_level(inner)):
        return None
    if kept and kept[-1].strip() == "*":
        kept.pop()  # no keyword-only parameter left
    return "(" + ", ".join(p.strip() for p in kept) + ")", return_annotation


# -- re-exported constants ------------------------------------------------------------------


def _reexported_data_doc(app, what, name, obj, options, lines):
    """Document a re-exported constant with the ``#:`` comment where it is defined.

    ``zero3.comm.DEFAULT_TIMEOUT_S`` and ``zero3.comm.hookimpl`` are defined (and
    commented) in private modules and imported by the package's ``__init__``; autodoc
    only reads ``#:`` comments of the module it documents, and would otherwise show the
    docstring of the value's type (``float``, ``pluggy.HookimplMarker``).
    """
    import importlib
    import pkgutil

    from sphinx.pycode import ModuleAnalyzer

    if what != "data":
        return
    package_name, _, attr = name.rpartition(".")
    package = importlib.import_module(package_name)
    if not hasattr(package, "__path__"):
        return  # a plain module: autodoc found its own ``#:`` comment
    for info in pkgutil.iter_modules(package.__path__, package_name + "."):
        module = importlib.import_module(info.name)
        if getattr(module, attr, None) is not obj:
            continue
        docs = ModuleAnalyzer.for_module(info.name).find_attr_docs().get(("", attr))
        if docs:
            lines[:] = list(docs)
            return


def setup(app):
    app.connect("autodoc-process-signature", _factory_defaults)
    app.connect("autodoc-process-signature", _hide_private_parameters)
    app.connect("autodoc-process-docstring", _reexported_data_doc)
