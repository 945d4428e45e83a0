"""The values of deferred checkpoint entries as they are now, copied to a file.

An async save returns while training goes on, so it writes a copy of the state taken
when it was called. What is in memory is copied to memory (``clone_state_dict``); what
offload keeps only in swap files would have to be read back whole for that, more memory
than the run has set aside. A :class:`DiskSnapshot` copies it to a file of its own
instead, one entry (one offloaded record or shard) in memory at a time, and the save
reads it from there in the background. docs/checkpoints.rst, "Async saves".
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from zero3.core.files._format import DeferredTensor

__all__ = ["DiskSnapshot", "SnapshotEntry"]


@dataclasses.dataclass(frozen=True)
class SnapshotEntry:
    """A deferred entry's values in a :class:`DiskSnapshot` (``DeferredTensor`` for a
    save: read when the save writes it).
    """

    snapshot: DiskSnapshot
    offset: int
    placeholder: torch.Tensor
    group: str

    def target(self) -> torch.Tensor | None:
        """Not for loading."""
        return None

    def read(self) -> torch.Tensor:
        """The values, read back from the snapshot file."""
        return self.snapshot.read(self.offset, self.placeholder.numel(), self.placeholder.dtype)

    def write(self, values: torch.Tensor) -> None:
        """Not for loading."""
        raise NotImplementedError("a snapshot is only read")


class DiskSnapshot:
    """One file under ``directory`` (created, parents too; removed with it by
    :meth:`close`) holding
    the values of deferred entries at the time :meth:`take` copied them.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "values.bin"
        self.nbytes = 0
        directory.mkdir(parents=True)  # the checkpoint's parent may not exist yet
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def take(
        self, deferred: Mapping[tuple[str, ...], DeferredTensor]
    ) -> dict[tuple[str, ...], SnapshotEntry]:
        """Copy each entry's values (read one at a time, group after group, so a
        record read back serves all of its entries) and return entries reading them
        from the file.

        Raises:
            OSError: The file could not be written (a full disk: ``ENOSPC``).
        """
        taken: dict[tuple[str, ...], SnapshotEntry] = {}
        for key, entry in sorted(deferred.items(), key=lambda item: item[1].group):
            values = entry.read().detach().to("cpu").contiguous()
            offset = self.nbytes
            self._write(values.view(torch.uint8).numpy().data, offset)
            self.nbytes += values.numel() * values.element_size()
            taken[key] = SnapshotEntry(self, offset, entry.placeholder, entry.group)
        os.fsync(self._fd)  # a full disk shows here at the latest, before the save returns
        return taken

    def _write(self, data: memoryview, offset: int) -> None:
        view = data.cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def read(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` values of ``dtype`` from ``offset``.

        Raises:
            OSError: The file is shorter than that (removed or cut meanwhile).
        """
        out = torch.empty(numel, dtype=dtype)
        view = out.view(torch.uint8).numpy().data.cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(
                    f"short read of {self.path}: {done} of {len(view)} bytes at offset "
                    f"{offset} (the async save's snapshot was cut or removed)"
                )
            done += got
        return out

    def close(self) -> None:
        """Close and remove the file and its directory."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        shutil.rmtree(self.directory, ignore_errors=True)
