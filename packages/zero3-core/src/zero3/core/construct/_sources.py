"""Weight sources: where ``shard_module(checkpoint=...)`` reads each rank's slices from.

Note (reading one rank's slice, not the tensor):
    A rank owns the flat element range ``[start, stop)`` of every parameter (the
    row-major flattening, split into N equal parts). In an N-d tensor that range is not
    a box, but it is a few of them: a partial first row, a block of whole rows, a partial
    last row, each partial row again split the same way one dimension down
    (:func:`flat_boxes`; at most ``2·ndim - 1`` boxes, the same boxes zero3's DCP
    checkpoints describe). safetensors' ``get_slice`` reads
    a box straight from the memory-mapped file, so a rank touches only the pages of its
    own elements: never a whole tensor it does not own, never a whole file. The mapped
    pages count in the process's resident set while a tensor refers to them, so the
    reader hands back a 1-D tensor the caller copies into its shard and drops at once.

Formats are opened by :func:`open_weight_source`, which tries the entries of
:data:`WEIGHT_FORMATS` in order: add one there to teach ``checkpoint=`` a new layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from zero3.core.files._boxes import flat_boxes
from zero3.core.files._reader import CheckpointReader

__all__ = [
    "WEIGHT_FORMATS",
    "SafetensorsSource",
    "WeightFormat",
    "WeightSource",
    "open_weight_source",
]


@runtime_checkable
class WeightSource(Protocol):
    """What ``shard_module(checkpoint=...)`` reads weights from.

    Keys are the unsharded model's ``state_dict()`` keys. Implementations: the
    safetensors reader (:class:`SafetensorsSource`) and zero3's own sharded
    checkpoints; any object with these four methods works.
    """

    def describe(self) -> str:
        """Where the weights come from (a path), for messages."""
        ...

    def entries(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every stored tensor: ``state_dict`` key -> (full shape, stored dtype)."""
        ...

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the row-major flattened tensor ``key``.

        A 1-D tensor in the stored dtype, read without reading the rest of the tensor.
        """
        ...

    def close(self) -> None:
        """Release what the source holds open."""
        ...


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class SafetensorsSource:
    """safetensors weights: one file, or the transformers layout (``model.safetensors``,
    or ``model.safetensors.index.json`` naming several files).

    Opening reads only the files' headers. :meth:`read_flat` opens the file holding the
    key and reads the boxes of the range with ``get_slice`` (see the module Note).

    Args:
        path: A ``.safetensors`` file, or a directory in the transformers layout.

    Raises:
        FileNotFoundError: A file the index names is missing.
        ValueError: The index is malformed, or a tensor has a dtype torch cannot hold.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._entries: dict[str, _Entry] = {}
        for file in self._files():
            self._read_header(file)

    def _files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{index}: not a safetensors index (expected a JSON object with a "
                    f"'weight_map' of key -> file): {exc}"
                ) from exc
            files = sorted({self.path / name for name in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names files that do not exist: {missing}")
            return files
        return [self.path / SINGLE_FILE]

    def _read_header(self, file: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                view = handle.get_slice(key)
                stored = view.get_dtype()
                dtype = _SAFETENSORS_DTYPES.get(stored)
                if dtype is None:
                    raise ValueError(
                        f"{file}: tensor {key!r} has safetensors dtype {stored}, which torch "
                        f"cannot hold here (known: {sorted(_SAFETENSORS_DTYPES)})"
                    )
                if key in self._entries:
                    raise ValueError(
                        f"{self.path}: tensor {key!r} is stored twice "
                        f"({self._entries[key].file.name} and {file.name})"
                    )
                self._entries[key] = _Entry(file, tuple(view.get_shape()), dtype)

    def describe(self) -> str:
        """The path this source reads."""
        return str(self.path)

    def entries(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every stored tensor: key -> (shape, stored dtype)."""
        return {key: (e.shape, e.dtype) for key, e in self._entries.items()}

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``key``, flattened row-major (stored dtype)."""
        from safetensors import safe_open

        entry = self._entries[key]
        numel = math.prod(entry.shape)
        if not 0 <= start <= stop <= numel:
            raise ValueError(
                f"{self.path}: range [{start}, {stop}) is outside tensor {key!r} of "
                f"{numel} elements"
            )
        if start == stop:
            return torch.empty(0, dtype=entry.dtype)
        with safe_open(str(entry.file), framework="pt") as handle:
            if not entry.shape:
                scalar: torch.Tensor = handle.get_tensor(key)
                return scalar.reshape(-1)
            view = handle.get_slice(key)
            pieces = [
                view[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))].reshape(
                    -1
                )
                for offsets, sizes in flat_boxes(start, stop, entry.shape)
            ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def close(self) -> None:
        """Nothing stays open between reads."""


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """One layout ``checkpoint=`` understands.

    Attributes:
        name: What the layout is called in messages.
        detect: Whether a path holds this layout (cheap: looks at names only).
        open: Opens such a path as a :class:`~zero3.core.WeightSource`.
        expects: What a path of this layout looks like (for the error message).
    """

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], WeightSource]
    expects: str


def _is_safetensors(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()


def _is_zero3_checkpoint(path: Path) -> bool:
    # A finished save has DCP's .metadata; one with only data files is an unfinished
    # save, which the reader refuses with a message saying so.
    return path.is_dir() and ((path / ".metadata").is_file() or any(path.glob("*.distcp")))


def _open_zero3_checkpoint(path: Path) -> WeightSource:
    return CheckpointReader(path)


#: The layouts :func:`open_weight_source` tries, in order.
WEIGHT_FORMATS: list[WeightFormat] = [
    WeightFormat(
        name="safetensors",
        detect=_is_safetensors,
        open=SafetensorsSource,
        expects=(
            f"a .safetensors file, or a directory holding {SINGLE_FILE} or {INDEX_FILE} "
            "with its files (what transformers' save_pretrained writes)"
        ),
    ),
    WeightFormat(
        name="zero3 checkpoint",
        detect=_is_zero3_checkpoint,
        open=_open_zero3_checkpoint,
        expects=(
            "a directory written by zero3.optim.save_checkpoint (any world size; the "
            "fp32 masters are read where it has them)"
        ),
    ),
]


def open_weight_source(path: str | os.PathLike[str]) -> WeightSource:
    """Open a ``checkpoint=`` path as a :class:`~zero3.core.WeightSource` (format by what it holds).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` holds none of the known layouts.
    """
    where = Path(path)
    if not where.exists():
        raise FileNotFoundError(f"checkpoint={str(path)!r}: no such file or directory")
    for fmt in WEIGHT_FORMATS:
        if fmt.detect(where):
            return fmt.open(where)
    kinds = "; ".join(f"{fmt.name}: {fmt.expects}" for fmt in WEIGHT_FORMATS)
    raise ValueError(f"checkpoint={str(path)!r} holds no weights zero3 can read. Expected {kinds}")
