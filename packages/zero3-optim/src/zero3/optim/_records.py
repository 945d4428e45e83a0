"""Checkpoints of offloaded optimizer state that never hold it all: records read one at a
time as a save writes them, and filled and written one at a time as a load reads them.

Note (how):
    A save's state dict holds, for each record only in its swap file, placeholders of
    its members' masters and state (``zero3.core.engine.DeferredTensor``); the save
    planner asks :class:`RecordEntry` for the values as DCP writes each item, and
    :class:`RecordReader` keeps the last record read, so a save holds one record and
    one item. A load lays each record out from the checkpoint's entries for its members
    (:class:`RecordLoad`), fills it as the reader delivers them (deferred entries come
    after everything else, record by record), writes it to its file once complete and
    lets it go; members whose master the checkpoint lacks take it from the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from zero3.core.engine import AlignedBuffer, ShardedParam, SwapError, round_up
from zero3.optim._offload import ALIGN, OffloadError, OffloadStore, Segment, Slot, owners_of

if TYPE_CHECKING:
    from zero3.optim._optim_checkpoint import EntryKey, SubGroup

__all__ = ["RecordEntry", "RecordLoad", "RecordReader", "record_loads", "record_reader"]


def record_reader(store: OffloadStore) -> RecordReader:
    """A reader of the records only in swap files now, for a streamed save."""
    store.settle_ahead()
    return RecordReader(store, [s for s in store.slots() if s.on_disk and not s.resident])


def record_loads(
    store: OffloadStore, saved: Mapping[int, Mapping[EntryKey, torch.dtype]]
) -> dict[int, RecordLoad]:
    """For a streamed load: a :class:`RecordLoad` per offloaded sub-group (by ``id``),
    from the checkpoint's entries for its members (``saved``, by ``id`` of the
    sub-group). What the records held is dropped first.
    """
    store.settle_ahead()
    longest: dict[torch.dtype, int] = {}
    for slot in store.slots():
        if slot.resident:  # replaced by the load: nothing to write back
            slot.layout, slot.nbytes = store.layout_of(slot)
            store.release(slot)
        for (_, k, _), dtype in saved.get(id(slot.sg), {}).items():
            n = slot.sg.params[k].local_numel
            longest[dtype] = max(longest.get(dtype, 0), n)
    scratch = {dtype: torch.empty(n, dtype=dtype) for dtype, n in longest.items()}
    return {
        id(slot.sg): RecordLoad(store, slot, saved.get(id(slot.sg), {}), scratch)
        for slot in store.slots()
    }


def _group(slot: Slot) -> str:
    """A record's name as a group of deferred checkpoint entries."""
    return f"record{slot.index:06d}"


@dataclasses.dataclass(frozen=True)
class RecordEntry:
    """One parameter's master or state tensor inside an offloaded record, as a deferred
    checkpoint entry (``zero3.core.engine.DeferredTensor``) for saving: read when the
    save writes it.
    """

    reader: RecordReader
    slot: Slot
    seg: Segment
    start: int
    placeholder: torch.Tensor

    @property
    def group(self) -> str:
        """Its record."""
        return _group(self.slot)

    def target(self) -> torch.Tensor | None:
        """Not for loading."""
        return None

    def read(self) -> torch.Tensor:
        """This parameter's elements, from the record (read if it is not the last)."""
        values = self.reader.segment(self.slot, self.seg)
        return values[self.start : self.start + self.placeholder.numel()]

    def write(self, values: torch.Tensor) -> None:
        """Not for loading (a load fills a :class:`RecordLoad`)."""
        raise NotImplementedError("a record being saved is not loaded")


class RecordReader:
    """The offloaded sub-groups' records a streamed checkpoint save reads: one record in
    memory at a time (the last one asked for), the state left in its files.

    Args:
        store: The optimizer's offload store.
        slots: Its records only on disk now.
    """

    def __init__(self, store: OffloadStore, slots: Sequence[Slot]) -> None:
        self._store = store
        self._slots = {id(slot.sg): slot for slot in slots}
        self._current: tuple[Slot, AlignedBuffer] | None = None
        longest: dict[torch.dtype, int] = {}
        for slot in slots:
            for seg in slot.layout:
                longest[seg.dtype] = max(longest.get(seg.dtype, 0), seg.numel)
        # Placeholders view these (never read or written): DCP plans from their sizes.
        self._scratch = {dtype: torch.empty(n, dtype=dtype) for dtype, n in longest.items()}

    def entries(self, sg: SubGroup) -> dict[tuple[str, int, str], RecordEntry] | None:
        """``sg``'s deferred entries by (``"master"`` or ``"state"``, member, key); None
        where its state is in memory.
        """
        slot = self._slots.get(id(sg))
        if slot is None:
            return None
        out: dict[tuple[str, int, str], RecordEntry] = {}
        for seg in slot.layout:
            members = range(len(sg.params)) if seg.owner < 0 or self._store.flat else [seg.owner]
            for k in members:
                whole_owner = seg.owner >= 0 and not self._store.flat
                start = 0 if whole_owner else sg.offsets[k]
                n = sg.params[k].local_numel
                kind = "master" if seg.owner < 0 else "state"
                holder = self._scratch[seg.dtype][:n]
                out[(kind, k, seg.key)] = RecordEntry(self, slot, seg, start, holder)
        return out

    def segment(self, slot: Slot, seg: Segment) -> torch.Tensor:
        """``seg``'s values in ``slot``'s record, read now unless it was the last."""
        if self._current is None or self._current[0] is not slot:
            self._current = None  # the previous record goes first
            try:
                slot.file.check(slot.nbytes)
                self._current = (slot, self._store.read_record(slot))
            except SwapError as exc:
                raise OffloadError(f"optimizer offload: cannot read a record back: {exc}") from exc
        buf = self._current[1]
        return buf.tensor[seg.offset : seg.offset + seg.numel * seg.dtype.itemsize].view(seg.dtype)


class RecordLoad:
    """One offloaded record loaded from a checkpoint without the others: laid out from
    the checkpoint's entries for its members, filled as DCP reads them, written to its
    file and let go once complete (:meth:`finish`). Members without a saved master take
    it from the model's shard, loaded by then (the model's entries are read first).

    Args:
        store: The optimizer's offload store.
        slot: The record.
        saved: The checkpoint's entries for the slot's members, with their dtypes.
        scratch: Placeholders' storage by dtype (see :class:`RecordReader`).
    """

    def __init__(
        self,
        store: OffloadStore,
        slot: Slot,
        saved: Mapping[EntryKey, torch.dtype],
        scratch: Mapping[torch.dtype, torch.Tensor],
    ) -> None:
        self._store, self._slot = store, slot
        sg, flat = slot.sg, store.flat
        owner_dtypes = [t.dtype for t in owners_of(sg, flat)]
        segs: dict[tuple[int, str], Segment] = {}  # (owner, key) -> its segment
        cursor = 0
        if slot.swap_master:
            segs[(-1, "")] = Segment(-1, "", torch.float32, sg.numel, 0)
            cursor = sg.numel * 4
        for kind, k, key in sorted(saved):
            owner = 0 if flat else k
            if kind != "state" or (owner, key) in segs:
                continue
            dtype = saved[(kind, k, key)]
            if dtype.is_floating_point:  # as the wrapped optimizer's load casts it
                dtype = owner_dtypes[owner]
            numel = sg.numel if flat else sg.params[k].local_numel
            cursor = round_up(cursor, ALIGN)
            segs[(owner, key)] = Segment(owner, key, dtype, numel, cursor)
            cursor += numel * dtype.itemsize
        self._segs = segs
        self.layout, self.nbytes = tuple(segs.values()), round_up(cursor)
        wanted = [e for e in saved if e[0] == "state" or slot.swap_master]
        self._left = set(wanted)
        #: The deferred checkpoint entries that fill it.
        self.entries = {
            e: _RecordPut(self, e, scratch[saved[e]][: sg.params[e[1]].local_numel]) for e in wanted
        }
        self._buf: AlignedBuffer | None = None
        self.done = False

    def place(self, entry: EntryKey) -> torch.Tensor:
        """Where ``entry``'s values go in the record (in the record's dtype)."""
        kind, k, key = entry
        flat = self._store.flat
        seg = self._segs[(-1, "") if kind == "master" else (0 if flat else k, key)]
        start = self._slot.sg.offsets[k] if seg.owner < 0 or flat else 0
        return self._view(seg)[start : start + self._slot.sg.params[k].local_numel]

    def put(self, entry: EntryKey, values: torch.Tensor) -> None:
        """One member's loaded values into the record (unless loaded in place); the
        last one writes it.
        """
        place = self.place(entry)
        if values.data_ptr() != place.data_ptr():
            place.copy_(values)
        self._left.discard(entry)
        if not self._left:
            self.finish()

    def _view(self, seg: Segment) -> torch.Tensor:
        if self._buf is None:
            self._buf = AlignedBuffer(self.nbytes)  # zero-filled: gaps and padding
        region = self._buf.tensor[seg.offset : seg.offset + seg.numel * seg.dtype.itemsize]
        return region.view(seg.dtype)

    def finish(self) -> None:
        """Masters the checkpoint lacks from the model's shards; write; let go. A record
        of which nothing was saved (and no master to keep) holds no state.
        """
        if self.done:
            return
        self.done = True
        slot = self._slot
        # Until the new record is on disk the slot holds nothing usable (a failed load
        # fails every rank; nothing steps from a half-written record).
        slot.layout, slot.nbytes, slot.on_disk = (), 0, False
        slot.resident, slot.buffer = False, None
        if not self.layout:
            return  # nothing saved, no master kept: the wrapped optimizer starts afresh
        if slot.swap_master:
            master = self._view(self._segs[(-1, "")])
            for k, sp in enumerate(slot.sg.params):
                if ("master", k, "") not in self.entries and sp.local_numel:
                    start = slot.sg.offsets[k]
                    master[start : start + sp.local_numel].copy_(_loaded_values(sp))
        buf = self._buf if self._buf is not None else AlignedBuffer(self.nbytes)
        self._buf = None
        slot.layout, slot.nbytes = self.layout, self.nbytes
        try:
            self._store.write_record(slot, buf)
        except BaseException:
            slot.layout, slot.nbytes = (), 0
            raise
        slot.on_disk = True


def _loaded_values(sp: ShardedParam) -> torch.Tensor:
    """This rank's real elements of ``sp`` as a checkpoint just loaded them: a persistent
    parameter's whole tensor is loaded in place (its shard follows later), a partitioned
    one's shard (read back from its swap file for this copy only).
    """
    start, stop = sp.valid_range(sp.rank)
    if sp.persistent or sp.aliases_param:
        return sp.param.detach().reshape(-1)[start:stop]
    values = sp.shard[: sp.local_numel]
    if sp.home is not None:
        sp.home.drop(sp)
    return values


@dataclasses.dataclass(frozen=True)
class _RecordPut:
    """A deferred checkpoint entry for loading one member's master or state into a
    :class:`RecordLoad` (``zero3.core.engine.DeferredTensor``).
    """

    record: RecordLoad
    key: EntryKey
    placeholder: torch.Tensor

    @property
    def group(self) -> str:
        return _group(self.record._slot)

    def target(self) -> torch.Tensor | None:
        """The record's place for the values when the dtypes agree (read in place)."""
        place = self.record.place(self.key)
        return place if place.dtype == self.placeholder.dtype else None

    def read(self) -> torch.Tensor:
        raise NotImplementedError("a record being loaded is not saved")

    def write(self, values: torch.Tensor) -> None:
        self.record.put(self.key, values)
