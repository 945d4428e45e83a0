"""Swap files: direct I/O out of the page cache, whole-or-error reads, own directories."""

from __future__ import annotations

import functools
import os
import resource
import socket
import threading
import time
import weakref

import pytest
import torch

from zero3.core.engine import (
    AlignedBuffer,
    IOPool,
    SwapError,
    SwapFile,
    check_free_space,
    make_swap_dir,
    resident_pages,
)


def _filled(nbytes: int, value: int) -> AlignedBuffer:
    buf = AlignedBuffer(nbytes)
    buf.tensor.fill_(value)
    return buf


def test_buffers_are_page_aligned_and_whole_pages():
    buf = AlignedBuffer(10_000)
    assert buf.nbytes == 12_288 and buf.tensor.numel() == 12_288
    assert buf.tensor.data_ptr() % 4096 == 0


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_buffers_count_against_the_data_limit_like_the_memory_they_replace():
    """RLIMIT_DATA (the cap demos' limit) counts private writable mappings only: a
    shared anonymous buffer would let offload's I/O buffers escape a cap that the
    in-memory state it replaces is held to."""
    before = _vm_data()
    buf = AlignedBuffer(64 << 20)
    assert _vm_data() - before >= 64 << 20
    del buf


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_buffer_beyond_the_data_limit_is_a_memory_error_naming_its_size():
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + (8 << 20), hard))
    try:
        with pytest.raises(MemoryError, match=r"256\.0 MiB host buffer.*RLIMIT_DATA.*buffer_count"):
            AlignedBuffer(256 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def test_a_written_file_reads_back_and_is_not_in_the_page_cache(tmp_path):
    f = SwapFile(tmp_path / "a.swp", block_size=8192)
    f.reserve(20_000)
    f.write(_filled(20_000, 7), 20_000)
    resident, pages = resident_pages(tmp_path / "a.swp")
    assert pages == 5
    if f.direct:  # ext4/xfs: O_DIRECT; elsewhere the pages are dropped after the write
        assert resident == 0
    out = AlignedBuffer(20_000)
    f.check(20_000)
    f.read(out, 20_000)
    assert bool((out.tensor == 7).all())
    f.close()
    assert not (tmp_path / "a.swp").exists()


def test_buffered_writes_stay_in_the_cache_which_is_why_swap_files_use_direct_io(tmp_path):
    (tmp_path / "b.bin").write_bytes(b"x" * 40_960)
    resident, pages = resident_pages(tmp_path / "b.bin")
    assert pages == 10 and resident > 0


@pytest.mark.parametrize("damage", ["truncated", "removed", "replaced"])
def test_a_damaged_file_is_an_error_naming_it(tmp_path, damage):
    path = tmp_path / "s.swp"
    f = SwapFile(path)
    f.write(_filled(16_384, 1), 16_384)
    if damage == "truncated":
        os.truncate(path, 4096)
        match = "s.swp is truncated: 4,096 bytes, 16,384 expected"
    elif damage == "removed":
        path.unlink()
        match = "s.swp is gone"
    else:
        path.unlink()
        path.write_bytes(b"\0" * 16_384)
        match = "s.swp was replaced"
    with pytest.raises(SwapError, match=match):
        f.check(16_384)
    f.close()


def test_a_short_read_is_an_error_never_zeros(tmp_path):
    path = tmp_path / "s.swp"
    f = SwapFile(path)
    f.write(_filled(16_384, 3), 16_384)
    os.truncate(path, 8192)  # after any check: the read itself finds the end
    with pytest.raises(SwapError, match=r"s\.swp failed: short read: end of file at 8,192"):
        f.read(AlignedBuffer(16_384), 16_384)
    f.close()


def test_an_existing_file_is_never_taken_over(tmp_path):
    (tmp_path / "s.swp").write_bytes(b"someone else's")
    with pytest.raises(SwapError, match=r"cannot create swap file .*s\.swp"):
        SwapFile(tmp_path / "s.swp")


def test_io_threads_return_results_and_errors_and_leave_the_stack_default_alone():
    pool = IOPool(2)
    sizes = []

    def probe() -> int:
        sizes.append(threading.current_thread().name)
        return 5

    assert pool.submit(probe).result(timeout=10) == 5
    boom = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.result(timeout=10)
    assert sizes[0].startswith("zero3-io")
    assert threading.stack_size() == 0  # the process default is left alone
    pool.close()


def test_a_finished_io_job_does_not_keep_its_buffers_alive():
    """A write's source and a read's result go once their caller drops them: an I/O
    thread that kept its last job until its next one held a step's last buffers (48 MiB
    on the benchmark model) through the next forward and backward."""
    pool = IOPool(1)
    source = AlignedBuffer(4096)
    source_gone = weakref.ref(source)
    pool.submit(functools.partial(lambda buf: None, source)).result(timeout=10)
    read = pool.submit(lambda: AlignedBuffer(4096))
    result_gone = weakref.ref(read.result(timeout=10))
    del source, read
    deadline = time.monotonic() + 10  # the thread drops its job just after the result
    while (source_gone() or result_gone()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source_gone() is None, "the I/O thread still holds the written buffer"
    assert result_gone() is None, "the I/O thread still holds the buffer it read"
    pool.close()


def test_swap_directories_are_per_rank_and_per_run_and_stale_ones_are_found(tmp_path):
    mine, stale = make_swap_dir(tmp_path, "optim", 0)
    other, _ = make_swap_dir(tmp_path, "param", 0)
    assert mine != other and mine.is_dir() and stale == []
    host = socket.gethostname().replace("-", "_")
    dead = tmp_path / f"zero3-optim-{host}-999999999-rank1"  # no such process
    dead.mkdir()
    _, stale = make_swap_dir(tmp_path, "optim", 1)
    assert stale == [dead]


def test_an_uncreatable_root_and_a_full_disk_are_errors_naming_path_and_bytes(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SwapError, match=f"cannot create the swap directory under {blocker}"):
        make_swap_dir(blocker / "sub", "optim", 0)
    with pytest.raises(SwapError, match=rf"under {tmp_path}: [\d,]+ bytes needed, [\d,]+ free"):
        check_free_space(tmp_path, 1 << 62, "a test")


def test_pinned_buffers_need_an_accelerator():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with pytest.raises(RuntimeError, match="pin_memory"):
        AlignedBuffer(4096, pin=True)
