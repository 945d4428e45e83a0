"""zero3-consolidate: a sharded checkpoint to full weights in the transformers layout.

The output is what ``save_pretrained`` writes (``model.safetensors`` or sharded files with
their index, ``config.json`` when recorded). Memory stays at one tensor however large the
model: each tensor is read alone from the DCP checkpoint, converted and streamed into the
file in the safetensors format (the library's writers hold a whole file in memory), and
each finished file is checked with ``safetensors.safe_open``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from zero3.core import CheckpointError
from zero3.core.engine import CHECKPOINT_LAYOUT, CheckpointReader

__all__ = ["consolidate_checkpoint", "main"]

_L = CHECKPOINT_LAYOUT
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
DEFAULT_MAX_SHARD_SIZE = "5GB"


def parse_size(size: int | str) -> int:
    """Bytes from ``1000``, ``"40KB"``, ``"5GB"`` or ``"2GiB"`` (decimal and binary units)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"max shard size {size!r}: expected bytes, or a number with KB/MB/GB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class _Tensor:
    """One output tensor: where it comes from and what it becomes."""

    def __init__(self, key: str, fqn: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key, self.fqn, self.shape, self.dtype = key, fqn, shape, dtype
        numel = 1
        for n in shape:
            numel *= n
        self.nbytes = numel * torch.empty(0, dtype=dtype).element_size()


def _plan(reader: CheckpointReader, dtype: torch.dtype | None) -> list[_Tensor]:
    out = []
    for key in reader.section_keys(_L.model):
        stored = reader.entry_dtype(_L.fqn(_L.model, key))
        source = reader.source_fqn(key)  # the fp32 master where there is one
        target = dtype if dtype is not None and stored.is_floating_point else stored
        if target not in _ST_DTYPE:
            raise ValueError(f"{key!r}: safetensors has no dtype for {target}")
        shape = tuple(reader.metadata.state_dict_metadata[source].size)  # type: ignore[union-attr]
        out.append(_Tensor(key, source, shape, target))
    return out


def _files(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Consecutive tensors grouped into files of at most ``limit`` bytes (a larger
    tensor gets a file of its own), as ``save_pretrained`` shards.
    """
    files: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def _write_file(path: Path, tensors: list[_Tensor], reader: CheckpointReader) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.key] = {
            "dtype": _ST_DTYPE[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors:
            value = reader.read_tensor(t.fqn).to(t.dtype).reshape(-1)
            f.write(value.view(torch.uint8).numpy().data)  # no copy of the bytes
            del value
        f.flush()
        os.fsync(f.fileno())
    with safe_open(str(partial), framework="pt") as check:
        if set(check.keys()) != {t.key for t in tensors}:
            raise CheckpointError(f"consolidation wrote an inconsistent file {partial}")
    os.replace(partial, path)


def consolidate_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Write a zero3 checkpoint's full weights in the transformers layout, one tensor in
    memory at a time. One process, no torch.distributed.

    Args:
        checkpoint: A directory written by :func:`~zero3.optim.save_checkpoint`.
        out: The output directory (created; existing weight files are replaced).
        dtype: Output dtype of floating-point tensors (``torch.float32`` or
            ``"float32"``, ``"bfloat16"``, ``"float16"``); default: the model's own.
            Values come from the fp32 masters when the checkpoint has them.
        max_shard_size: Bytes per file before the weights are split into several files
            and an index (``"5GB"``, ``"40KB"``, or an int).

    Returns:
        The files written (weights, index, config).

    Raises:
        CheckpointError: The checkpoint is missing, incomplete, corrupted or not zero3's.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    reader = CheckpointReader(checkpoint)
    tensors = _plan(reader, dtype)
    groups = _files(tensors, parse_size(max_shard_size))
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    for name, group in zip(names, groups, strict=True):
        _write_file(target / name, group, reader)
        written.append(target / name)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.key: name for name, g in zip(names, groups, strict=True) for t in g},
        }
        path = target / "model.safetensors.index.json"
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(path)
    config = reader.info.get("hf_config")
    if isinstance(config, str):
        path = target / "config.json"
        path.write_text(config + "\n")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The ``zero3-consolidate`` command."""
    parser = argparse.ArgumentParser(
        prog="zero3-consolidate",
        description=(
            "Write a zero3 checkpoint's full weights as safetensors in the transformers "
            "layout (model.safetensors, or several files and an index), plus config.json "
            "when the model's config is known. Reads one tensor at a time, from the fp32 "
            "masters when the checkpoint has them."
        ),
    )
    parser.add_argument("checkpoint", help="a directory written by zero3.optim.save_checkpoint")
    parser.add_argument("out", help="the output directory")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="dtype of floating-point weights (default: the model's)")  # fmt: skip
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="split into several files past this size (default: 5GB)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        files = consolidate_checkpoint(
            args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size
        )
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"zero3-consolidate: error: {exc}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0
