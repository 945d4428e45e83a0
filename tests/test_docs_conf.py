"""docs/conf.py's signature hooks, called as autodoc calls them (no Sphinx build)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _conf():
    spec = importlib.util.spec_from_file_location("zero3_docs_conf", ROOT / "docs" / "conf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_private_parameters_are_left_out_of_signatures():
    hide = _conf()._hide_private_parameters
    sig = "(output_dir: str | None = None, _internal_call: bool = False)"
    assert hide(None, "method", "save_model", None, {}, sig, "None") == (
        "(output_dir: str | None = None)",
        "None",
    )
    sig = "(a: dict[str, int] = {'x, _y': 1}, *, _b=2, c=3)"
    assert hide(None, "function", "f", None, {}, sig, None) == (
        "(a: dict[str, int] = {'x, _y': 1}, *, c=3)",
        None,
    )
    assert hide(None, "method", "f", None, {}, "(x, *, _y=1)", None) == ("(x)", None)
    assert hide(None, "method", "f", None, {}, "(x, y_z=1)", None) is None  # nothing to hide
    assert hide(None, "class", "C", None, {}, "(_x)", None) is None


def test_save_model_is_documented_without_internal_call():
    # Its signature as written (read from the source: importing transformers costs seconds).
    source = ROOT / "packages" / "zero3-hf" / "src" / "zero3" / "hf" / "_trainer.py"
    trainer = next(
        n for n in ast.walk(ast.parse(source.read_text()))
        if isinstance(n, ast.ClassDef) and n.name == "Zero3Trainer"
    )  # fmt: skip
    method = next(n for n in trainer.body if getattr(n, "name", "") == "save_model")
    sig = "(" + ast.unparse(method.args).removeprefix("self, ") + ")"
    assert "_internal_call" in sig  # the Trainer passes it, so the method keeps it
    shown, _ = _conf()._hide_private_parameters(None, "method", "save_model", None, {}, sig, None)
    assert "_internal_call" not in shown and "output_dir" in shown
