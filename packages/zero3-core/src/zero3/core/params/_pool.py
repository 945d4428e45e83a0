"""Reusable communication buffers.

Note:
    Every step gathers and reduces buffers of the same sizes. Allocating them anew each
    time costs page faults, not just malloc: glibc serves large blocks with fresh
    ``mmap`` pages and returns them on free, so a 135 MB gather buffer faults in 33,000
    zeroed pages per use (measured: zero3 took ~160k page faults per step against
    DDP's ~25k on the benchmark GPT before buffers were pooled, ~100k after). The pool
    keeps freed buffers and hands them out again, best fit: a request is served by the
    smallest cached buffer that holds it and is at most twice its size, so the
    gradient bucket of backward reuses the gather buffer of forward instead of adding
    to the peak. What it caches is bounded by ``limit_bytes`` (before the first step the
    state sets it to the model's gathered size, or less where ``max_live_parameters`` and
    the prefetch bucket keep fewer parameters gathered at once) and can be dropped with
    :meth:`clear`. Only CPU buffers are
    kept: device memory already comes from torch's caching allocator, which also knows
    when a stream has finished with a block.

    Parameter data is pooled the same way: releasing a parameter swaps its bytes out
    into a spare storage (``UntypedStorage._swap_data_ptr_``; autograd's saved tensors
    share the parameter's storage object, so they lose the bytes too) and the next
    gather of that size swaps a filled storage back in. The limit follows the engine's
    own peak working set (set at the end of each step), so the pool never keeps more
    than a step needs at once: with per-module release on a large model it caches a
    few modules, not the model.
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Cached byte buffers, handed out best fit.

    Args:
        limit_bytes: Most bytes kept while unused; buffers beyond it are freed.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.cached_bytes = 0
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a handed-out view -> its base
        self._storages: dict[tuple[torch.device, int], list[torch.UntypedStorage]] = {}

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A ``uint8`` buffer of ``nbytes`` (contents undefined).

        Always a normal tensor, even when called under ``torch.inference_mode()``: a
        buffer born there could not be written by a later training step ("Inplace
        update to inference tensor outside InferenceMode is not allowed";
        :ref:`fact-inference-tensors`).
        """
        with torch.inference_mode(False):
            return self._take(nbytes, device)

    def _take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        best = -1
        for i, buf in enumerate(self._free):
            size = buf.numel()
            fits = buf.device == device and nbytes <= size <= 2 * nbytes + 4096
            if fits and (best < 0 or size < self._free[best].numel()):
                best = i
        if best < 0:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        base = self._free.pop(best)
        self.cached_bytes -= base.numel()
        view = base[:nbytes]
        if nbytes:
            self._lent[view.data_ptr()] = base
        return view

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`take` (it must no longer be in use)."""
        base = self._lent.pop(buffer.data_ptr(), None)
        if base is None:
            base = (
                buffer.reshape(-1).view(torch.uint8)
                if buffer.dtype != torch.uint8
                else buffer.reshape(-1)
            )
        if base.device.type != "cpu" or self.cached_bytes + base.numel() > self.limit_bytes:
            return  # dropped: freed once the caller lets go of it
        self._free.append(base)
        self.cached_bytes += base.numel()

    def take_storage(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """An untyped storage of exactly ``nbytes`` (for a parameter's data)."""
        free = self._storages.get((device, nbytes))
        if free:
            self.cached_bytes -= nbytes
            return free.pop()
        with torch.inference_mode(False):
            return torch.UntypedStorage(nbytes, device=device)

    def give_storage(self, storage: torch.UntypedStorage) -> None:
        """Keep a released parameter's bytes for the next gather of that size."""
        nbytes = storage.nbytes()
        if storage.device.type != "cpu" or self.cached_bytes + nbytes > self.limit_bytes:
            return
        self._storages.setdefault((storage.device, nbytes), []).append(storage)
        self.cached_bytes += nbytes

    def cached_data_ptrs(self) -> set[int]:
        """Data pointers of every cached buffer and storage (for memory accounting)."""
        ptrs = {buf.untyped_storage().data_ptr() for buf in self._free}
        ptrs.update(s.data_ptr() for free in self._storages.values() for s in free)
        return ptrs

    def clear(self) -> None:
        """Free every cached buffer."""
        self._free.clear()
        self._storages.clear()
        self.cached_bytes = 0
