"""Weight sources: the safetensors reader and its layouts (boxes: test_checkpoint_format)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from zero3.core import SafetensorsSource, WeightSource
from zero3.core.engine import open_weight_source


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(6, 5, generator=g),
        "a.bias": torch.randn(6, generator=g),
        "b.weight": torch.randn(3, 4, 2, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(2.5),
    }


def _check_source(source, tensors):
    assert isinstance(source, WeightSource)
    assert source.entries() == {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    for key, value in tensors.items():
        flat = value.reshape(-1)
        n = flat.numel()
        for start, stop in [(0, n), (0, 0), (n // 3, n - 1), (1, 2)]:
            if not start <= stop <= n:
                continue
            got = source.read_flat(key, start, stop)
            assert got.dtype == value.dtype and got.dim() == 1
            assert torch.equal(got, flat[start:stop]), (key, start, stop)
    with pytest.raises(ValueError, match=r"outside tensor 'a\.bias'"):
        source.read_flat("a.bias", 3, 9)


def test_single_file(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "w.safetensors"))
    _check_source(open_weight_source(tmp_path / "w.safetensors"), tensors)


def test_directory_with_model_safetensors(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _check_source(open_weight_source(tmp_path), tensors)


def test_directory_with_an_index_of_several_files(tmp_path):
    tensors = _tensors()
    weight_map = {}
    for i, (key, value) in enumerate(tensors.items()):
        name = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
        save_file({key: value}, str(tmp_path / name))
        weight_map[key] = name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    source = open_weight_source(str(tmp_path))
    assert isinstance(source, SafetensorsSource)
    _check_source(source, tensors)


def test_paths_that_hold_no_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        open_weight_source(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"holds no weights zero3 can read.*model\.safetensors"):
        open_weight_source(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="names files that do not exist"):
        open_weight_source(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        open_weight_source(tmp_path)
