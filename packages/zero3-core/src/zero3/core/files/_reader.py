"""Reading a zero3 checkpoint in one process: whole tensors, flat ranges, plain values."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zero3.core.files._boxes import flat_boxes
from zero3.core.files._format import (
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_LAYOUT,
    CheckpointStorageReader,
    CheckpointVersionError,
    CorruptCheckpointError,
    _narrow,
    check_checkpoint_dir,
)

__all__ = ["CheckpointReader"]

_L = CHECKPOINT_LAYOUT


class _DirectReads(LoadPlanner):
    """A load planner for reads zero3 plans itself: destinations by (key, box)."""

    def __init__(self) -> None:
        self.targets: dict[tuple[str, int], torch.Tensor] = {}
        self.values: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        """Unused: the reads are planned directly."""

    def create_local_plan(self) -> LoadPlan:
        """Unused: the reads are planned directly."""
        return LoadPlan([])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """Unused: the reads are planned directly."""
        return global_plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """Unused: the reads are planned directly."""
        return new_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Keep a plain value (plain data only)."""
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination box of a read."""
        target = self.targets[(read_item.dest_index.fqn, read_item.dest_index.index or 0)]
        return _narrow(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: the data is in place."""


def _byte_read(fqn: str) -> ReadItem:
    index = MetadataIndex(fqn)
    zero = torch.Size([0])
    return ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)


class CheckpointReader:
    """A zero3 checkpoint directory, read in this process only (no collective).

    Opening it checks that the save finished and the format version; every read is
    checked against the writers' CRC-32 records and unpickles no code. It serves
    construct-time loading (the ``WeightSource`` interface: :meth:`describe`,
    :meth:`entries`, :meth:`read_flat`, :meth:`close`) and consolidation.

    Args:
        path: The checkpoint directory (or a link to one).

    Raises:
        CheckpointNotFoundError: Nothing at ``path``.
        IncompleteCheckpointError: A save that did not finish.
        CorruptCheckpointError: An unreadable index or item.
        CheckpointVersionError: Not a zero3 checkpoint, or another format version.

    Attributes:
        path: The checkpoint directory.
        storage: Its :class:`CheckpointStorageReader` (index read once), for ``dcp.load``.
        metadata: DCP's index of the checkpoint.
        info: zero3's record: ``world_size``, ``model_class``, ``hf_config`` (the model's
            transformers config as JSON, or None), ``aliases`` (``[key, parameter name]``
            pairs of tied names), ``optimizer`` (the wrapped optimizer's class or None).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path: Path = check_checkpoint_dir(path)
        self.storage = CheckpointStorageReader(self.path)
        self.metadata = self.storage.read_metadata()
        self.storage.set_up_storage_reader(self.metadata, True)
        mapping = self.metadata.planner_data
        paths: dict[str, tuple[Any, ...]] = {}
        if isinstance(mapping, Mapping):
            paths = {str(k): tuple(v) for k, v in mapping.items()}
        self.paths = paths
        version_fqn = _L.fqn(_L.info, "format_version")
        if version_fqn not in self.metadata.state_dict_metadata:
            raise CheckpointVersionError(
                f"not a zero3 checkpoint: {self.path} is a torch.distributed.checkpoint "
                "directory without zero3's format_version entry (written by another tool). "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save opens it."
            )
        version = self.read_values([version_fqn])[version_fqn]
        if version != CHECKPOINT_FORMAT_VERSION:
            raise CheckpointVersionError(
                f"incompatible checkpoint {self.path}: written in zero3 checkpoint format "
                f"{version!r}, and this zero3 reads format {CHECKPOINT_FORMAT_VERSION} only. "
                "Load it with the zero3 release that wrote it, or convert it with "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save."
            )
        info = self.read_section(_L.info).get("info", {})
        self.info: dict[str, Any] = dict(info) if isinstance(info, Mapping) else {}
        self._aliases = {str(a): str(b) for a, b in self.info.get("aliases", [])}

    # -- WeightSource ---------------------------------------------------------------------

    def describe(self) -> str:
        """The checkpoint's path, for messages."""
        return str(self.path)

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Unsharded ``state_dict()`` key -> (full shape, dtype :meth:`read_flat` returns).

        The dtype is the fp32 master's where the checkpoint has one for the key.
        """
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for key in self.section_keys(_L.model):
            md = self._tensor_md(self.source_fqn(key))
            out[key] = (tuple(md.size), md.properties.dtype)
        return out

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the row-major flattened tensor of ``key``.

        Reads only the saved chunks that overlap the range (each chunk whole, as DCP
        stores them), from the fp32 master when the checkpoint has one.
        """
        fqn = self.source_fqn(key)
        md = self._tensor_md(fqn)
        shape = tuple(md.size)
        numel = math.prod(shape)
        if not 0 <= start <= stop <= numel:
            raise ValueError(
                f"read_flat({key!r}, {start}, {stop}): the tensor has {numel} elements "
                f"(checkpoint {self.path})"
            )
        out = torch.empty(stop - start, dtype=md.properties.dtype)
        self._read_boxes(fqn, md, out, flat_boxes(start, stop, shape))
        return out

    def close(self) -> None:
        """Nothing stays open between reads; kept for the ``WeightSource`` interface."""

    # -- tensors and values ---------------------------------------------------------------

    def source_fqn(self, key: str) -> str:
        """The checkpoint key :meth:`read_flat` reads for a model key (the master's if any)."""
        name = self._aliases.get(key, key)
        master = _L.fqn(_L.optim, "master", name)
        if master in self.metadata.state_dict_metadata:
            return master
        return _L.fqn(_L.model, key)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        """A whole tensor by its flattened checkpoint key (``model.lm_head.weight``)."""
        md = self._tensor_md(fqn)
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        self._read_boxes(fqn, md, out.view(-1), flat_boxes(0, out.numel(), tuple(md.size)))
        return out

    def read_values(self, fqns: Iterable[str]) -> dict[str, Any]:
        """Plain (non-tensor) values by flattened checkpoint key."""
        planner = _DirectReads()
        items = []
        for fqn in fqns:
            if not isinstance(self.metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):
                raise KeyError(f"{fqn!r} is not a plain value in checkpoint {self.path}")
            items.append(_byte_read(fqn))
        self.storage.read_data(LoadPlan(items), planner).wait()
        return planner.values

    def section_keys(self, *prefix: str) -> list[str]:
        """Keys one level below ``prefix`` (``section_keys("model")``: the model's keys)."""
        n = len(prefix)
        seen: dict[str, None] = {}
        for path in self.paths.values():
            if len(path) > n and path[:n] == prefix:
                seen.setdefault(str(path[n]), None)
        return list(seen)

    def read_section(self, *prefix: str) -> Any:
        """Everything below ``prefix`` as nested dicts/lists of whole tensors and values
        (``{}`` when nothing is saved there).
        """
        n = len(prefix)
        chosen = {
            fqn: path[n:]
            for fqn, path in self.paths.items()
            if len(path) > n and path[:n] == prefix
        }
        plain = [
            f
            for f in chosen
            if isinstance(self.metadata.state_dict_metadata.get(f), BytesStorageMetadata)
        ]
        values = self.read_values(plain)
        for fqn in chosen:
            if fqn not in values:
                values[fqn] = self.read_tensor(fqn)
        return nest({chosen[fqn]: value for fqn, value in values.items()})

    def template(self, *prefix: str) -> Any:
        """Destinations for ``dcp.load`` of everything below ``prefix``: nested dicts and
        lists as saved, an empty whole tensor per tensor, None per plain value (DCP's
        planner fills those in place). ``{}`` when nothing is saved there.
        """
        n = len(prefix)
        flat: dict[tuple[Any, ...], Any] = {}
        for fqn, path in self.paths.items():
            if len(path) > n and path[:n] == prefix:
                md = self.metadata.state_dict_metadata.get(fqn)
                if isinstance(md, TensorStorageMetadata):
                    flat[path[n:]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                else:
                    flat[path[n:]] = None
        return nest(flat)

    def entry_dtype(self, fqn: str) -> torch.dtype:
        """The stored dtype of a tensor by its flattened checkpoint key."""
        return self._tensor_md(fqn).properties.dtype

    # -- internals ------------------------------------------------------------------------

    def _tensor_md(self, fqn: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{fqn!r} is not a tensor in checkpoint {self.path}")
        return md

    def _read_boxes(
        self,
        fqn: str,
        md: TensorStorageMetadata,
        flat: torch.Tensor,
        boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        planner = _DirectReads()
        chunks, pos = [], 0
        for index, (offsets, sizes) in enumerate(boxes):
            n = math.prod(sizes)
            planner.targets[(fqn, index)] = flat[pos : pos + n].view(sizes)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            pos += n
        items = create_read_items_for_chunk_list(fqn, md, chunks)
        covered = sum(math.prod(item.lengths) for item in items)
        if covered != flat.numel():
            raise CorruptCheckpointError(
                f"corrupted checkpoint {self.path}: the index's chunks of {fqn!r} cover "
                f"{covered} of the {flat.numel()} elements asked for"
            )
        self.storage.read_data(LoadPlan(items), planner).wait()


def nest(flat: Mapping[tuple[Any, ...], Any]) -> Any:
    """Nested dicts (string keys) and lists (integer keys) from ``{path: value}``; a list
    at the top when every top-level key is an index.
    """
    root: dict[Any, Any] = {}
    for path, value in flat.items():
        node: Any = root
        for key in path[:-1]:
            child = node.get(key) if isinstance(node, dict) else None
            if child is None:
                child = {}
                node[key] = child
            node = child
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts whose keys are exactly 0..n-1 (DCP's list indices) become lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out
