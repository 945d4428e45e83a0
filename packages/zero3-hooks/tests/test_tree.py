import collections
import dataclasses

import torch

from zero3.hooks._tree import iter_tensors, map_tensors


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor


Pair = collections.namedtuple("Pair", "a b")


def test_iter_and_map_nested_containers():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    obj = {"x": [a, (b, Pair(c, 7))], "y": Out(d, (a,)), "z": Frozen(b), "s": "text"}
    assert [float(t) for t in iter_tensors(obj)] == [0, 1, 2, 3, 0, 1]
    mapped = map_tensors(obj, lambda t: t + 10)
    assert [float(t) for t in iter_tensors(mapped)] == [10, 11, 12, 13, 10, 11]
    assert isinstance(mapped["x"][1][1], Pair) and mapped["x"][1][1].b == 7
    assert mapped["y"] is obj["y"]  # mutable dataclasses are updated in place
    assert isinstance(mapped["z"], Frozen) and mapped["z"] is not obj["z"]
    assert mapped["s"] == "text"


def test_model_output_is_updated_in_place():
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class MyOutput(ModelOutput):
        logits: torch.Tensor | None = None
        hidden: tuple | None = None

    out = MyOutput(logits=torch.ones(2), hidden=(torch.zeros(1),))
    mapped = map_tensors(out, lambda t: t * 3)
    assert mapped is out
    assert out.logits.tolist() == [3.0, 3.0] and out["logits"].tolist() == [3.0, 3.0]
    assert out.hidden[0].tolist() == [0.0]
    assert len(list(iter_tensors(out))) == 2
