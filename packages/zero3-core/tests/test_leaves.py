"""The one leaf matcher: classes, class names and module paths, and its errors."""

import pytest
from torch import nn

from zero3.core import ModulePath
from zero3.core.engine import match_leaf_modules


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Expert()
        self.shared_mlp = Expert()


class SubExpert(Expert):
    pass


def _model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    model.extra = SubExpert()
    return model


def _names(targets) -> list[str]:
    return [name for name, _ in match_leaf_modules(_model(), targets, source="t")]


def test_classes_match_instances_and_subclasses():
    assert _names([Expert]) == [
        "layers.0.mlp", "layers.0.shared_mlp", "layers.1.mlp", "layers.1.shared_mlp", "extra",
    ]  # fmt: skip


def test_class_names_match_the_exact_class_bare_or_qualified():
    assert _names(["SubExpert"]) == ["extra"]
    assert _names([f"{__name__}.SubExpert"]) == ["extra"]
    assert _names(["Module"]) == [""]  # the root itself


def test_module_paths_exact_and_suffix():
    assert _names([ModulePath("layers.1.mlp")]) == ["layers.1.mlp"]
    # DeepSpeed's name_suffixes test: a plain string suffix.
    assert _names([ModulePath("mlp", suffix=True)]) == [
        "layers.0.mlp", "layers.0.shared_mlp", "layers.1.mlp", "layers.1.shared_mlp",
    ]  # fmt: skip
    assert _names([ModulePath(".mlp", suffix=True)]) == ["layers.0.mlp", "layers.1.mlp"]


def test_each_module_is_listed_once_in_model_order():
    assert _names([ModulePath("extra"), Expert, "SubExpert"])[-1] == "extra"
    assert len(_names([ModulePath("extra"), Expert, "SubExpert"])) == 5


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (nn.Conv2d, r"class torch\.nn\.modules\.conv\.Conv2d \(no submodule is an instance"),
        ("Exprt", r"class name 'Exprt' \(no submodule's class is named so.*closest: 'Expert'"),
        (ModulePath("layers.2.mlp"), r"module path 'layers.2.mlp'.*closest: 'layers.\d.mlp'"),
        (ModulePath("moe", suffix=True), r"module suffix 'moe' \(no submodule's qualified name"),
    ],
)
def test_unmatched_targets_are_named_with_the_model(target, match):
    with pytest.raises(ValueError, match=r"^src: no module of Module matches 1 target: " + match):
        match_leaf_modules(_model(), [Expert, target], source="src")


def test_bad_targets_are_type_errors():
    with pytest.raises(TypeError, match=r"src entries must be nn\.Module subclasses"):
        match_leaf_modules(_model(), [3], source="src")  # type: ignore[list-item]
