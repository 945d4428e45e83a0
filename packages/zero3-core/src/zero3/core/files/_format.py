"""The zero3 checkpoint: a torch.distributed.checkpoint directory, checked on the way in.

Note (what a zero3 checkpoint is):
    A plain DCP (torch.distributed.checkpoint) directory: one ``__<rank>_0.distcp``
    data file per writing rank (one per item, ``__<rank>_<n>.distcp``, for state kept in
    offload's swap files) and the ``.metadata`` index, which DCP writes last, once
    every rank's data is on disk. Torch's own tools open it
    (``dcp_to_torch_save``, ``dcp.load``). The saved state dict is nested under four
    top-level keys (:class:`CheckpointLayout`): ``zero3`` (format version, model class,
    the model's config, tied names), ``model`` (the unsharded ``state_dict()`` keys),
    ``optim`` (masters and optimizer state by parameter name) and ``extra`` (the user's
    tensors and plain values); DCP flattens them into ``model.<key>`` and so on. Only
    tensors and plain values (numbers, strings, lists, dicts) are saved, so
    ``torch.load(..., weights_only=True)`` opens anything derived from it.

Note (checked on the way in):
    DCP reads ``.metadata`` with ``pickle.load`` and every non-tensor value with
    ``torch.load(weights_only=False)``: unpickling a malicious file runs its code. zero3
    reads ``.metadata`` with an unpickler that accepts only DCP's metadata classes, and
    non-tensor values with ``weights_only=True`` (:class:`CheckpointStorageReader`,
    :class:`CheckpointLoadPlanner`). DCP's data files carry no checksum (a flipped
    byte inside a tensor loads silently), so each writing rank records a CRC-32 of
    every item it wrote in a small JSON file beside its data
    (``__<rank>_zero3-checksums.json``), written before DCP's ``.metadata``; the
    reader checks an item's length and CRC before ``torch.load`` sees it. Torch's tools
    ignore those files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pickle
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zero3.core.files._boxes import join_flat

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "CHECKPOINT_LAYOUT",
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointLoadPlanner",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSavePlanner",
    "CheckpointStorageReader",
    "CheckpointStorageWriter",
    "CheckpointVersionError",
    "CorruptCheckpointError",
    "DeferredTensor",
    "IncompleteCheckpointError",
    "check_checkpoint_dir",
    "clone_state_dict",
    "quiet_dcp_warnings",
]

#: The checkpoint format this zero3 writes and reads. Loading refuses any other.
CHECKPOINT_FORMAT_VERSION = 1

_METADATA_FILE = ".metadata"  # DCP's index, written last
_CHECKSUM_SUFFIX = "zero3-checksums.json"
_BLOCK = 1 << 20  # bytes read at a time while checksumming
#: Test-only pause point: a directory. A rank whose environment sets it writes
#: ``rank<r>.pid`` there after writing its data and before finishing, then sleeps, so a
#: test can kill it in the middle of a save.
TEST_PAUSE_ENV = "ZERO3_TEST_PAUSE_SAVE"


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """Top-level keys of a zero3 checkpoint (DCP flattens them to ``<key>.<rest>``).

    Attributes:
        info: zero3's own entries: ``format_version`` and the ``info`` dict.
        model: The model's state, under the unsharded ``state_dict()`` keys.
        optim: The optimizer: ``master.<param name>``, ``state.<param name>.<key>``,
            ``param_groups``, ``scaler``.
        extra: The user's ``extra`` dict.
    """

    info: str = "zero3"
    model: str = "model"
    optim: str = "optim"
    extra: str = "extra"

    def fqn(self, *path: str | int) -> str:
        """The flattened DCP key of a path (``fqn("model", "lm_head.weight")``)."""
        return ".".join(str(p) for p in path)


#: The layout every zero3 checkpoint uses.
CHECKPOINT_LAYOUT = CheckpointLayout()


class CheckpointError(Exception):
    """A checkpoint cannot be saved or loaded. The message starts with what is wrong
    and names the path; multi-rank calls raise it on every rank.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint directory at the path."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint whose save did not finish (no ``.metadata``)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated, altered or unreadable."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint of another zero3 format version, or not a zero3 checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another model or optimizer (keys, shapes, groups)."""


def check_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory holding a finished DCP checkpoint.

    Raises:
        CheckpointNotFoundError: Nothing at ``path``, or not a directory.
        IncompleteCheckpointError: No ``.metadata``: the save that wrote it never
            finished.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {p}: the path does not exist")
    if not p.is_dir():
        raise CheckpointNotFoundError(
            f"no checkpoint at {p}: it is a file, not a checkpoint directory"
        )
    if not (p / _METADATA_FILE).is_file():
        raise IncompleteCheckpointError(
            f"incomplete checkpoint {p}: it has no {_METADATA_FILE} file, which "
            "torch.distributed.checkpoint writes last, so the save that wrote it did not "
            "finish (a crashed or killed run). Load the checkpoint it was replacing."
        )
    return p


@contextlib.contextmanager
def quiet_dcp_warnings() -> Iterator[None]:
    """Silence two DCP warnings that zero3's own use triggers by design.

    * torch's ``ShardedTensor`` deprecation ``FutureWarning``: zero3 describes flat
      shards to DCP as ShardedTensors (see ``sharded_like``; the migration path if
      torch drops them is in that module's note), and DCP's load planner warns once
      per tensor.
    * "torch.distributed is disabled ... assuming the intent is to save/load in a
      single process": in a world of one zero3 passes ``no_dist=True`` on purpose.

    Only those messages are filtered; every other warning passes.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="Please use DTensor instead and we are deprecating ShardedTensor",
            category=FutureWarning,
        )
        warnings.filterwarnings(
            "ignore",
            message="torch.distributed is disabled, unavailable or uninitialized, assuming",
            category=UserWarning,
        )
        yield


# -- metadata: a restricted unpickler -------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"), ("builtins", "frozenset"),
    }
)  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: no class or function outside
    the index's own dataclasses (and torch dtypes, sizes, paths) can be named.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a checkpoint index; refusing to unpickle it"
        )


def _read_index(path: Path) -> Metadata:
    try:
        with open(path / _METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"corrupted checkpoint {path}: its {_METADATA_FILE} index cannot be read ({exc})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(
            f"corrupted checkpoint {path}: {_METADATA_FILE} holds a "
            f"{type(metadata).__name__}, not a checkpoint index"
        )
    return metadata


# -- writing ----------------------------------------------------------------------------------


def _crc32(f: IO[bytes], offset: int, length: int) -> int:
    f.seek(offset)
    crc, left = 0, length
    while left > 0:
        block = f.read(min(_BLOCK, left))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


class CheckpointStorageWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank unless asked, fsynced) that records a
    CRC-32 of every item it writes (see the module note). zero3's async saves stage
    their copy themselves (:func:`clone_state_dict`) and write it with ``dcp.save`` on a
    thread of their own.

    Args:
        path: The directory to write.
        file_per_item: One file per item instead of one per rank. DCP's writer keeps
            every tensor of a file alive until the file is done, so a state dict with
            deferred entries (:class:`DeferredTensor`) is written an item per file: then
            each value read for it is let go once written.
    """

    def __init__(self, path: str | os.PathLike[str], *, file_per_item: bool = False) -> None:
        super().__init__(
            path, single_file_per_rank=not file_per_item, sync_files=True, overwrite=False
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items, then their checksums (before DCP's index)."""
        future = super().write_data(plan, planner)
        results = future.wait()  # FileSystemWriter writes before returning
        _test_pause_point(self.rank)
        prefix = getattr(plan.storage_data, "prefix", f"__{self.rank}_")
        files: dict[str, list[list[int]]] = {}
        root = Path(self.path)
        for result in results:
            info = result.storage_data
            files.setdefault(info.relative_path, []).append([info.offset, info.length])
        for name, items in files.items():
            with open(root / name, "rb") as f:
                for item in items:
                    item.append(_crc32(f, item[0], item[1]))
        target = root / f"{prefix}{_CHECKSUM_SUFFIX}"
        with open(target, "w") as f:
            json.dump({"format": CHECKPOINT_FORMAT_VERSION, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        return future


def _test_pause_point(rank: int | None) -> None:
    where = os.environ.get(TEST_PAUSE_ENV)
    if not where:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    (Path(where) / f"rank{rank}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:  # the test kills this process meanwhile
        time.sleep(0.05)


# -- reading -------------------------------------------------------------------------------------


class _FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable stream."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])  # type: ignore[attr-defined]
        self._pos += got or 0
        return got or 0


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class CheckpointStorageReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that never unpickles code and checks every item.

    ``.metadata`` goes through an unpickler that knows only DCP's index classes; every
    item's length and CRC-32 are checked against the writer's record before
    ``torch.load(weights_only=True)`` reads it (non-tensor values included, whatever
    the planner). A problem raises :class:`~zero3.core.CorruptCheckpointError` naming the file.
    The index is read once and kept.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._root = Path(path)
        self._index: Metadata | None = None
        self._checksums: dict[tuple[str, int], tuple[int, int]] | None = None
        self._verified: set[tuple[str, int]] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's index (restricted unpickling), read once."""
        if kwargs.get("rank") is not None:
            raise CorruptCheckpointError(
                f"corrupted checkpoint {self._root}: no {_METADATA_FILE} index"
            )
        if self._index is None:
            check_checkpoint_dir(self._root)
            self._index = _read_index(self._root)
        return self._index

    def _load_checksums(self) -> dict[tuple[str, int], tuple[int, int]]:
        if self._checksums is None:
            table: dict[tuple[str, int], tuple[int, int]] = {}
            for record in sorted(self._root.glob(f"*{_CHECKSUM_SUFFIX}")):
                try:
                    files = json.loads(record.read_text())["files"]
                    for name, items in files.items():
                        for offset, length, crc in items:
                            table[(str(name), int(offset))] = (int(length), int(crc))
                except (ValueError, KeyError, TypeError) as exc:
                    raise CorruptCheckpointError(
                        f"corrupted checkpoint {self._root}: checksum record {record.name} "
                        f"cannot be read ({exc})"
                    ) from None
            self._checksums = table
        return self._checksums

    def _open_item(self, f: IO[bytes], info: Any) -> _FileSlice:
        """Check one item's bounds and CRC; return it as a stream."""
        name, offset, length = info.relative_path, info.offset, info.length
        if info.transform_descriptors:
            raise CorruptCheckpointError(
                f"unsupported checkpoint {self._root}: {name} was written with DCP stream "
                f"transforms {list(info.transform_descriptors)}, which zero3 does not read"
            )
        key = (name, offset)
        if key not in self._verified:
            size = os.fstat(f.fileno()).st_size
            if offset + length > size:
                raise CorruptCheckpointError(
                    f"corrupted checkpoint {self._root}: {name} is truncated ({size} bytes, "
                    f"the index needs {offset + length})"
                )
            record = self._load_checksums().get(key)
            if record is None:
                raise CorruptCheckpointError(
                    f"corrupted checkpoint {self._root}: no checksum recorded for bytes "
                    f"{offset}..{offset + length} of {name} (its rank's "
                    f"*{_CHECKSUM_SUFFIX} file is missing or stale)"
                )
            crc = _crc32(f, offset, length)
            if record != (length, crc):
                raise CorruptCheckpointError(
                    f"corrupted checkpoint {self._root}: bytes {offset}..{offset + length} of "
                    f"{name} fail their CRC-32 check (recorded {record[1]:#010x} for "
                    f"{record[0]} bytes, read {crc:#010x})"
                )
            self._verified.add(key)
        return _FileSlice(f, offset, length)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items, checked, into the planner's tensors and values."""
        # In key order (deferred entries last, by group), whatever file each chunk is in:
        # a tensor's chunks come one after another, so a deferred entry (or group) is
        # whole, written and let go before the next.
        order = (
            planner.read_order
            if isinstance(planner, CheckpointLoadPlanner)
            else lambda item: _deferred_last(None, item.dest_index.fqn)
        )
        items = sorted(plan.items, key=order)
        names = [self.storage_data[item.storage_index].relative_path for item in items]
        last = {name: i for i, name in enumerate(names)}  # closed after its last item
        opened: dict[str, IO[bytes]] = {}
        try:
            for i, (item, name) in enumerate(zip(items, names, strict=True)):
                if name not in opened:
                    try:
                        opened[name] = open(self._root / name, "rb")  # noqa: SIM115
                    except FileNotFoundError:
                        raise CorruptCheckpointError(
                            f"corrupted checkpoint {self._root}: data file {name} is missing"
                        ) from None
                self._read_item(opened[name], item, planner)
                if last[name] == i:
                    opened.pop(name).close()
        finally:
            for f in opened.values():
                f.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, f: IO[bytes], item: ReadItem, planner: LoadPlanner) -> None:
        stream = self._open_item(f, self.storage_data[item.storage_index])
        try:
            if item.type == LoadItemType.BYTE_IO:
                data = stream.read()
                torch.load(io.BytesIO(data), weights_only=True)  # refuse code before anyone
                planner.load_bytes(item, io.BytesIO(data))
                return
            buffered = io.BufferedReader(stream, buffer_size=1 << 20)
            tensor = torch.load(buffered, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CorruptCheckpointError(
                f"unsafe or corrupted checkpoint {self._root}: an item of "
                f"{item.storage_index.fqn!r} does not load as plain data "
                f"({str(exc).splitlines()[0]})"
            ) from None
        except RuntimeError as exc:
            raise CorruptCheckpointError(
                f"corrupted checkpoint {self._root}: {item.storage_index.fqn!r} cannot be "
                f"read ({str(exc).splitlines()[0]})"
            ) from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(
                f"corrupted checkpoint {self._root}: {item.storage_index.fqn!r} holds a "
                f"{type(tensor).__name__}, not a tensor"
            )
        tensor = _narrow(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.shape != tensor.shape:
            raise CorruptCheckpointError(
                f"corrupted checkpoint {self._root}: {item.storage_index.fqn!r} has a chunk "
                f"of shape {tuple(tensor.shape)} where the index says {tuple(target.shape)}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


class DeferredTensor(Protocol):
    """A flat tensor of a state dict whose values a checkpoint moves only when it reaches
    them (parameter offload's shards: read from, and written to, their swap file one at
    a time rather than all held in memory at once).

    The state dict holds views of :attr:`placeholder`, a tensor of the right size,
    dtype and device with no bytes: a planner given the deferred entry reads
    :meth:`read` where a save needs the values, and hands :meth:`write` the values a
    load filled in.
    """

    @property
    def placeholder(self) -> torch.Tensor:
        """The flat tensor (no bytes) the state dict's entry views."""
        ...

    @property
    def group(self) -> str:
        """The name of the entries a load reads together. A load reads every entry that
        is not deferred first, then the deferred ones group by group, so that a group
        (an offloaded record) is filled, written and let go before the next.
        """
        ...

    def target(self) -> torch.Tensor | None:
        """Where a load may put the values in place (flat, the placeholder's size and
        dtype), or None for a buffer of the planner's.
        """
        ...

    def read(self) -> torch.Tensor:
        """The flat values, read now."""
        ...

    def write(self, values: torch.Tensor) -> None:
        """Store the flat values a load filled in."""
        ...


#: Deferred entries by their key path in the state dict (("model", "lm_head.weight")).
Deferred = Mapping[tuple[str, ...], DeferredTensor]


def _find_deferred(
    deferred: Deferred, mappings: Mapping[str, Any] | None, fqn: str
) -> DeferredTensor | None:
    """The deferred entry DCP's flattened key ``fqn`` names (None: not deferred)."""
    if not deferred or not mappings:
        return None
    return deferred.get(tuple(str(p) for p in mappings.get(fqn, ())))


def _deferred_last(entry: DeferredTensor | None, fqn: str) -> tuple[str, str]:
    """The order both planners move items in: what is not deferred first, then the
    deferred entries group by group, each in key order.
    """
    return ("" if entry is None else "\x01" + entry.group, fqn)


def _as_view_of(view: torch.Tensor, base: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` viewed as ``view`` views ``base`` (same sizes, strides, offset)."""
    offset = view.storage_offset() - base.storage_offset()
    return values.as_strided(view.size(), view.stride(), values.storage_offset() + offset)


class CheckpointSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that reads a deferred entry's values only when its
    items are written. DCP's file writer resolves the items of a CPU save one by one,
    in the plan's order; the plan puts the deferred items last, group by group (an
    offloaded record is read once), and the last entry's values are kept for its other
    items (a shard's boxes).

    Args:
        deferred: The deferred entries of the state dict to save (see
            :class:`DeferredTensor`).
    """

    def __init__(self, deferred: Deferred) -> None:
        super().__init__()
        self._deferred = deferred
        self._last: tuple[DeferredTensor, torch.Tensor] | None = None

    def _entry(self, fqn: str) -> DeferredTensor | None:
        return _find_deferred(self._deferred, self.mappings, fqn)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DCP's, with the deferred items last and grouped (see the class)."""
        plan = super().finish_plan(new_plan)

        def order(item: WriteItem) -> tuple[str, str]:
            return _deferred_last(self._entry(item.index.fqn), item.index.fqn)

        return dataclasses.replace(plan, items=sorted(plan.items, key=order))

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The item's tensor; for a deferred entry, a view of values read now."""
        found = super().lookup_object(index)
        entry = self._entry(index.fqn)
        if entry is None or not isinstance(found, torch.Tensor):
            return found
        if self._last is None or self._last[0] is not entry:
            self._last = None  # the previous entry's values go first
            self._last = (entry, entry.read())
        return _as_view_of(found, entry.placeholder, self._last[1])


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with three changes for zero3's state dicts.

    * Non-tensor values load with ``weights_only=True`` (DCP's own uses
      ``weights_only=False``, which runs whatever the pickle names).
    * ShardedTensors this rank holds nothing of (a parameter smaller than the world)
      stay in the plan: DCP's ``flatten_sharded_tensors`` step, meant for FSDP's
      nested ShardedTensors, drops them.
    * The plan is made from the keys as given. When some key of the checkpoint is not
      asked for, DCP's planner guesses the state dict came from torch < 2.4 and
      re-flattens it the old way, turning a dict of plain values into one key; zero3
      never loads every key (its own ``zero3`` entries, an unused ``optim``).

    Deferred entries (``deferred``, see :class:`DeferredTensor`) are filled in a buffer
    of their own, handed to their ``write`` once every element has been read, and let
    go: with the reader's items in key order, one entry's values at a time.
    """

    def __init__(self, deferred: Deferred | None = None) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self._deferred = deferred or {}
        self._filling: dict[str, tuple[DeferredTensor, torch.Tensor, list[int]]] = {}
        self._filled: set[str] = set()

    def unfilled(self) -> list[str]:
        """Keys of deferred entries the load did not fill whole (after ``dcp.load``:
        a checkpoint that does not cover them).
        """
        if not self._deferred:
            return []
        wanted = [fqn for fqn in self.mappings if self._entry(fqn) is not None]
        return sorted(fqn for fqn in wanted if fqn not in self._filled)

    def _entry(self, fqn: str) -> DeferredTensor | None:
        return _find_deferred(self._deferred, self.mappings, fqn)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Where the item's elements go; for a deferred entry, into its buffer."""
        fqn = read_item.dest_index.fqn
        entry = self._entry(fqn)
        if entry is None:
            tensor: torch.Tensor = super().resolve_tensor(read_item)
            return tensor
        if fqn in self._filled:
            raise CorruptCheckpointError(
                f"corrupted checkpoint: {fqn!r} has more chunks than elements (its index "
                "lists overlapping pieces)"
            )
        if fqn not in self._filling:
            values = entry.target()
            if values is None:
                values = torch.empty(entry.placeholder.shape, dtype=entry.placeholder.dtype)
            self._filling[fqn] = (entry, values, [0])
        entry, values, _ = self._filling[fqn]
        view = _as_view_of(self.lookup_tensor(read_item.dest_index), entry.placeholder, values)
        narrowed: torch.Tensor = self.transform_tensor(read_item, view)
        return narrowed

    def read_order(self, read_item: ReadItem) -> tuple[str, str]:
        """Where the reader takes ``read_item`` (see :attr:`DeferredTensor.group`): what
        is not deferred first, then deferred entries by group, each in key order.
        """
        fqn = read_item.dest_index.fqn
        return _deferred_last(self._entry(fqn), fqn)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Count a deferred entry's elements; once all are in, write them and let go."""
        fqn = read_item.dest_index.fqn
        if self._entry(fqn) is None:
            return
        entry, values, filled = self._filling[fqn]
        filled[0] += math.prod(read_item.lengths)
        if filled[0] >= values.numel():
            del self._filling[fqn]
            self._filled.add(fqn)
            entry.write(values)

    def create_local_plan(self) -> LoadPlan:
        """One read per saved chunk overlapping each requested box or tensor."""
        if self.metadata is None:
            raise ValueError("CheckpointLoadPlanner: set_up_planner was not called")
        return create_default_local_load_plan(self.state_dict, self.metadata, True)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load a non-tensor value as plain data only, into the state dict's place."""
        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        *parents, last = self.mappings[fqn]
        container: Any = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = loaded


def clone_state_dict(state_dict: Any, keep: frozenset[int] = frozenset()) -> Any:
    """A CPU copy of a state dict of ShardedTensors, tensors and plain values, holding
    each tensor's data once.

    A ShardedTensor's local shards are copied into one new flat buffer and described by
    the same boxes, now on the CPU; tensors are cloned; dicts, lists and tuples are
    rebuilt; other values are kept as they are. zero3's async saves stage with it
    (DCP's ``FileSystemWriter`` stager deep-copies a ShardedTensor's whole storage and
    then copies it again: twice the rank's state).

    Args:
        state_dict: What to copy.
        keep: ``data_ptr`` of storages whose views are kept as they are, not copied:
            the placeholders of deferred entries (:class:`DeferredTensor`).
    """

    def kept(tensor: torch.Tensor) -> bool:
        return bool(keep) and tensor.untyped_storage().data_ptr() in keep

    if isinstance(state_dict, ShardedTensor):
        if any(kept(s.tensor) for s in state_dict.local_shards()):
            return state_dict
        return _clone_sharded(state_dict)
    if isinstance(state_dict, torch.Tensor):
        return state_dict if kept(state_dict) else state_dict.detach().to("cpu", copy=True)
    if isinstance(state_dict, Mapping):
        return {k: clone_state_dict(v, keep) for k, v in state_dict.items()}
    if isinstance(state_dict, list):
        return [clone_state_dict(v, keep) for v in state_dict]
    if isinstance(state_dict, tuple):
        return tuple(clone_state_dict(v, keep) for v in state_dict)
    return state_dict


def _clone_sharded(value: ShardedTensor) -> ShardedTensor:
    metadata = value.metadata()
    shards = value.local_shards()
    flat = join_flat(s.tensor for s in shards).to("cpu", copy=True)
    me = dist.get_rank()
    shards_md: list[ShardMetadata] = []
    local: list[Shard] = []
    pos = 0
    for md in metadata.shards_metadata:
        assert md.placement is not None
        rank = md.placement.rank()
        cpu_md = ShardMetadata(list(md.shard_offsets), list(md.shard_sizes), f"rank:{rank}/cpu")
        shards_md.append(cpu_md)
        if rank == me:
            n = math.prod(md.shard_sizes)
            local.append(Shard(flat[pos : pos + n].view(md.shard_sizes), cpu_md))
            pos += n
    properties = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False)
    cpu = ShardedTensorMetadata(shards_md, metadata.size, properties)
    out: ShardedTensor = ShardedTensor._init_from_local_shards_and_global_metadata(local, cpu)
    return out
