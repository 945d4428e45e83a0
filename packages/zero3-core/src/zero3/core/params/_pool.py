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
    to the peak. What it caches is bounded by ``limit_bytes``: at most the window's
    :attr:`~zero3.core.engine.GatherWindow.pool_bytes` (the gathered bytes of two prefetch
    windows with their send buffers, never more than the parameter and gradient shards
    this rank holds), and after each step at most what that step had gathered at once
    (twice, with the send buffers). Only CPU buffers are
    kept: device memory already comes from torch's caching allocator, which also knows
    when a stream has finished with a block.

    The page-fault saving comes from reusing these storages, not from allocator
    tuning: ``mallopt`` and the ``MALLOC_*`` variables are process-wide, so they are the
    user's choice, never zero3's.

    Parameter data is pooled the same way: releasing a parameter swaps its bytes out
    into a spare storage (``UntypedStorage._swap_data_ptr_``; autograd's saved tensors
    share the parameter's storage object, so they lose the bytes too) and the next
    gather of that size swaps a filled storage back in. The limit follows the engine's
    own peak working set (set at the end of each step), so the pool never keeps more
    than a step needs at once: with per-module release on a large model it caches a
    few modules, not the model.

Note (the turn):
    The peak of a training step is where forward turns into backward: every
    activation is alive. What the pool caches there is forward's (released storages,
    gather buffers) and would add to that peak, so the pool is emptied when backward
    begins (``ParamCoordinator.begin_backward``): backward's first gathers allocate
    afresh, while autograd frees activations, and their buffers are cached again for
    the rest of backward and the next forward.
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Cached byte buffers, handed out best fit.

    Args:
        limit_bytes: Most bytes kept while unused; buffers beyond it are freed.

    Attributes:
        limit_bytes: Most bytes kept while unused.
        cached_bytes: Bytes kept now, unused.
        in_use_bytes: Bytes handed out now and not given back (gather and bucket
            buffers, gathered parameters' storages), whether fresh or reused.
        peak_bytes: Most ``in_use_bytes + cached_bytes`` at once since
            :meth:`reset_peaks`: what the engine's transient memory reached, counted by
            the engine itself (independent of the allocator's slack).
        peak_cached_bytes: Most ``cached_bytes`` at once since :meth:`reset_peaks`.
        peak_kind_bytes: Per kind of buffer handed out (``"gather"``, ``"bucket"``,
            ``"param"`` for parameter storages), the most in use at once since
            :meth:`reset_peaks`.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.cached_bytes = 0
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.peak_cached_bytes = 0
        self.peak_kind_bytes: dict[str, int] = {}
        self._kind_bytes: dict[str, int] = {}
        # data_ptr of a handed-out buffer/storage -> (bytes, kind)
        self._sizes: dict[int, tuple[int, str]] = {}
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a handed-out view -> its base
        self._storages: dict[tuple[torch.device, int], list[torch.UntypedStorage]] = {}

    def take(self, nbytes: int, device: torch.device, kind: str = "gather") -> torch.Tensor:
        """A ``uint8`` buffer of ``nbytes`` (contents undefined); ``kind`` names what it
        is for in :attr:`peak_kind_bytes`.

        Always a normal tensor, even when called under ``torch.inference_mode()``: a
        buffer born there could not be written by a later training step ("Inplace
        update to inference tensor outside InferenceMode is not allowed";
        :ref:`fact-inference-tensors`).
        """
        with torch.inference_mode(False):
            return self._take(nbytes, device, kind)

    def _take(self, nbytes: int, device: torch.device, kind: str) -> torch.Tensor:
        best = -1
        for i, buf in enumerate(self._free):
            size = buf.numel()
            fits = buf.device == device and nbytes <= size <= 2 * nbytes + 4096
            if fits and (best < 0 or size < self._free[best].numel()):
                best = i
        if best < 0:
            fresh = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._lend(fresh.data_ptr(), nbytes, kind)
            return fresh
        base = self._free.pop(best)
        self.cached_bytes -= base.numel()
        view = base[:nbytes]
        if nbytes:
            self._lent[view.data_ptr()] = base
            self._lend(view.data_ptr(), base.numel(), kind)
        return view

    def _lend(self, data_ptr: int, nbytes: int, kind: str) -> None:
        if not nbytes:
            return
        self._sizes[data_ptr] = (nbytes, kind)
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes + self.cached_bytes)
        now = self._kind_bytes.get(kind, 0) + nbytes
        self._kind_bytes[kind] = now
        self.peak_kind_bytes[kind] = max(self.peak_kind_bytes.get(kind, 0), now)

    def _returned(self, data_ptr: int) -> None:
        nbytes, kind = self._sizes.pop(data_ptr, (0, ""))
        if nbytes:
            self.in_use_bytes -= nbytes
            self._kind_bytes[kind] -= nbytes

    def _cache(self, nbytes: int) -> None:
        self.cached_bytes += nbytes
        self.peak_cached_bytes = max(self.peak_cached_bytes, self.cached_bytes)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`take` (it must no longer be in use)."""
        self._returned(buffer.data_ptr())
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
        self._cache(base.numel())

    def take_storage(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """An untyped storage of exactly ``nbytes`` (for a parameter's data)."""
        free = self._storages.get((device, nbytes))
        if free:
            self.cached_bytes -= nbytes
            storage = free.pop()
        else:
            with torch.inference_mode(False):
                storage = torch.UntypedStorage(nbytes, device=device)
        self._lend(storage.data_ptr(), nbytes, "param")
        return storage

    def give_storage(self, storage: torch.UntypedStorage) -> None:
        """Keep a released parameter's bytes for the next gather of that size."""
        nbytes = storage.nbytes()
        self._returned(storage.data_ptr())  # the same bytes take_storage lent (swapped back)
        if storage.device.type != "cpu" or self.cached_bytes + nbytes > self.limit_bytes:
            return
        self._storages.setdefault((storage.device, nbytes), []).append(storage)
        self._cache(nbytes)

    def cached_data_ptrs(self) -> set[int]:
        """Data pointers of every cached buffer and storage (for memory accounting)."""
        ptrs = {buf.untyped_storage().data_ptr() for buf in self._free}
        ptrs.update(s.data_ptr() for free in self._storages.values() for s in free)
        return ptrs

    def clear(self) -> None:
        """Free every cached buffer (those handed out stay theirs)."""
        self._free.clear()
        self._storages.clear()
        self.cached_bytes = 0

    def reset_peaks(self) -> None:
        """Start :attr:`peak_bytes` and :attr:`peak_cached_bytes` again from now."""
        self.peak_bytes = self.in_use_bytes + self.cached_bytes
        self.peak_cached_bytes = self.cached_bytes
        self.peak_kind_bytes = dict(self._kind_bytes)
