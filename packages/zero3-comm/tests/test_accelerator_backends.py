"""Accelerator backends (nccl, hccl, cupy-nccl): registration and messages everywhere,
real collectives where the hardware exists (skipped, never faked, elsewhere)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zero3.comm import (
    BackendUnavailableError,
    CommBackend,
    CommTimeoutError,
    CupyNCCLBackend,
    HCCLBackend,
    NCCLBackend,
    ReduceOp,
    TorchDeviceStream,
    _cupy,
    available_backends,
    create_backend,
    registered_backends,
)

pytestmark = pytest.mark.timeout(120)

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
HAS_NPU = getattr(torch, "npu", None) is not None and torch.npu.is_available()


# -- registration and availability (every machine) ------------------------------------


def test_accelerator_backends_are_registered() -> None:
    names = registered_backends()
    assert {"gloo", "nccl", "hccl", "mpi", "cupy-nccl"} <= set(names)
    assert names[:5] == ["gloo", "nccl", "hccl", "mpi", "cupy-nccl"]  # built-ins first


def test_device_types() -> None:
    assert NCCLBackend.device_type == "cuda"
    assert CupyNCCLBackend.device_type == "cuda"
    assert HCCLBackend.device_type == "npu"
    assert CupyNCCLBackend.name == "cupy-nccl"


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_nccl_unavailable_without_cuda() -> None:
    reason = NCCLBackend.unavailable_reason()
    assert reason is not None and "CUDA" in reason
    assert "nccl" not in available_backends()
    assert "gloo" in available_backends()
    with pytest.raises(BackendUnavailableError) as info:
        create_backend("nccl")
    message = str(info.value)
    assert "'nccl' is not available here" in message and reason in message
    assert "Available backends:" in message and "gloo" in message
    assert "nccl," not in message.split("Available backends:")[1]


@pytest.mark.skipif(HAS_NPU, reason="this machine has an Ascend NPU")
def test_hccl_unavailable_here() -> None:
    reason = HCCLBackend.unavailable_reason()
    assert reason is not None
    if importlib.util.find_spec("torch_npu") is None:
        assert "torch_npu, which is not installed" in reason
        assert "zero3-comm[npu]" in reason
    assert "hccl" not in available_backends()


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here")
def test_cupy_nccl_unavailable_here_without_cupy() -> None:
    reason = CupyNCCLBackend.unavailable_reason()
    assert reason is not None
    assert "needs cupy, which is not installed" in reason
    assert "pip install 'zero3-comm[cupy]'" in reason
    assert "cupy-nccl" not in available_backends()


def test_hccl_torch_npu_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ModuleNotFoundError
    reason = HCCLBackend.unavailable_reason()
    assert reason is not None and "not installed" in reason and "zero3-comm[npu]" in reason


def test_hccl_torch_npu_present_but_broken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # What an installed torch_npu does without the Ascend toolkit: importing raises.
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise RuntimeError('libhccl.so: cannot open shared object file: No such file')\n"
    )
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("torch_npu") is not None  # looks installed ...
    reason = HCCLBackend.unavailable_reason()  # ... but is not usable
    assert reason is not None
    assert "installed but failed to import" in reason and "libhccl.so" in reason
    assert "CANN" in reason
    assert "torch_npu" not in sys.modules


def _fake_cupy(
    monkeypatch: pytest.MonkeyPatch, *, gpu: bool, nccl: bool | None
) -> types.ModuleType:
    """Install a fake ``cupy`` (and ``cupy.cuda.nccl`` unless ``nccl`` is None)."""
    cupy = types.ModuleType("cupy")
    cupy.is_available = lambda: gpu  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    if nccl is None:
        monkeypatch.setitem(sys.modules, "cupy.cuda", None)
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)
        return cupy
    cuda = types.ModuleType("cupy.cuda")
    nccl_module = types.ModuleType("cupy.cuda.nccl")
    nccl_module.available = nccl  # type: ignore[attr-defined]
    cuda.nccl = nccl_module  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl_module)
    return cupy


def test_cupy_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    reason = CupyNCCLBackend.unavailable_reason()
    assert reason is not None and "pip install 'zero3-comm[cupy]'" in reason


def test_cupy_present_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cupy(monkeypatch, gpu=False, nccl=False)
    reason = CupyNCCLBackend.unavailable_reason()
    assert reason is not None
    assert "cupy is installed but finds no usable CUDA GPU" in reason
    assert "cupy.is_available() is False" in reason
    with pytest.raises(BackendUnavailableError, match="no usable CUDA GPU"):
        create_backend("cupy-nccl")
    with pytest.raises(BackendUnavailableError, match="no usable CUDA GPU"):
        CupyNCCLBackend()


def test_cupy_gpu_but_nccl_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cupy(monkeypatch, gpu=True, nccl=None)
    reason = CupyNCCLBackend.unavailable_reason()
    assert reason is not None and "cupy.cuda.nccl failed to import" in reason
    assert "nvidia-nccl-cu12" in reason


def test_cupy_gpu_but_nccl_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cupy(monkeypatch, gpu=True, nccl=False)
    reason = CupyNCCLBackend.unavailable_reason()
    assert reason is not None and "cupy.cuda.nccl.available is False" in reason
    assert "nvidia-nccl-cu12" in reason


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_cupy_ready_but_torch_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cupy(monkeypatch, gpu=True, nccl=True)
    reason = CupyNCCLBackend.unavailable_reason()
    assert reason is not None and "torch.cuda.is_available() is False" in reason


def test_cupy_broken_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise OSError('libcudart.so.12: not found')\n")
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = CupyNCCLBackend.unavailable_reason()
    assert reason is not None and "installed but failed to import" in reason
    assert "libcudart.so.12" in reason and "zero3-comm[cupy]" in reason


# -- cupy-nccl unique-id exchange (pure host code, every machine) ------------------------


class _FakeNccl:
    """Stands in for cupy.cuda.nccl: ids are 128 signed chars, as cupy returns them."""

    calls = 0

    @classmethod
    def get_unique_id(cls) -> tuple[int, ...]:
        cls.calls += 1
        return tuple(((i * 71 + cls.calls) % 256) - 128 for i in range(128))


def test_unique_id_roundtrip() -> None:
    unique_id = _FakeNccl.get_unique_id()
    assert min(unique_id) < 0 < max(unique_id)
    assert _cupy._decode_id(_cupy._encode_id(unique_id)) == unique_id
    assert _cupy._decode_id(_cupy._encode_id(unique_id).encode()) == unique_id


def test_unique_id_exchange_over_a_file_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each simulated rank is a separate store client with its own exchange counter, as
    # separate processes would have. (Sequential: a store wait holds the GIL.)
    world = 3
    path = str(tmp_path / "store")
    stores = []  # alive to the end: a FileStore removes its file once all clients left

    def exchange(rank: int, timeout_s: float = 10.0) -> tuple[int, ...]:
        monkeypatch.setattr(_cupy, "_exchange_counter", itertools.count())
        store = dist.FileStore(path, world + 1)
        stores.append(store)
        return _cupy._exchange_over_store(_FakeNccl, store, rank, timeout_s)  # type: ignore[arg-type]

    with pytest.raises(CommTimeoutError, match="rank 0 to publish the NCCL unique id"):
        exchange(1, timeout_s=0.2)  # rank 0 has not published yet: rank 1 waits, times out
    results = [exchange(rank) for rank in range(world)]
    assert len(set(results)) == 1 and len(results[0]) == 128
    assert _FakeNccl.calls >= 1


def test_unique_id_exchange_over_a_process_group(tmp_path: Path) -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        unique_id = _cupy._exchange_over_group(_FakeNccl, None, 0)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
    assert len(unique_id) == 128 and all(-128 <= b < 128 for b in unique_id)


def test_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert _cupy._launcher_env() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _cupy._launcher_env() == (1, 4)


# -- real hardware (skipped where it is missing) ----------------------------------------


needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _available(name: str) -> bool:
    return name in available_backends()


@pytest.fixture
def device_backend(request: pytest.FixtureRequest) -> Iterator[CommBackend]:
    name = request.param
    if not _available(name):
        pytest.skip(f"{name} is not available here")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key in os.environ:
            pytest.skip("runs as a world of one; unset the launcher environment")
    backend = create_backend(name, timeout_s=60)
    try:
        yield backend
    finally:
        backend.close()


DEVICE_BACKENDS = ["nccl", "cupy-nccl", "hccl"]


@pytest.mark.parametrize("device_backend", DEVICE_BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_collectives_match_cpu_reference(device_backend: CommBackend, dtype: torch.dtype) -> None:
    b = device_backend
    assert b.world_size == 1
    dev = b.device()
    reduces = dtype in b.capabilities.reduce_dtypes  # bf16 may move but not reduce
    cpu = (torch.randn(96, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    x = cpu.to(dev)
    out = torch.full_like(x, -1)
    b.all_gather(out, x).wait()
    results = {"all_gather": out}
    if reduces:
        for op in ReduceOp:
            out = torch.full_like(x, -1)
            b.reduce_scatter(out, x, op=op).wait()
            results[f"reduce_scatter {op}"] = out
            t = x.clone()
            b.all_reduce(t, op=op).wait()
            results[f"all_reduce {op}"] = t
    t = x.clone()
    b.broadcast(t, 0).wait()
    results["broadcast"] = t
    outs = [torch.empty(n, dtype=dtype, device=dev) for n in (10, 86)]
    b.all_gather_coalesced(outs, [x[:10], x[10:]]).wait()
    results["all_gather_coalesced"] = torch.cat(outs)
    b.barrier().wait()
    b.current_stream().synchronize()
    for what, got in results.items():
        assert got.device == dev
        assert torch.equal(got.cpu(), cpu), what  # world of one: every result is the input


@needs_cuda
@pytest.mark.parametrize("device_backend", ["nccl", "cupy-nccl"], indirect=True)
def test_wait_orders_two_streams_without_host_sync(device_backend: CommBackend) -> None:
    b = device_backend
    dev = b.device()
    x = torch.arange(1 << 20, dtype=torch.float32, device=dev)
    out = torch.full_like(x, -1.0)
    producer = torch.cuda.Stream(dev)
    consumer = torch.cuda.Stream(dev)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU spinning before the gather
    work = b.all_gather(out, x, stream=TorchDeviceStream("cuda", native=producer))
    start = time.perf_counter()
    work.wait(TorchDeviceStream("cuda", native=consumer))
    waited = time.perf_counter() - start
    with torch.cuda.stream(consumer):
        doubled = out * 2  # queued behind the gather, not after a host sync
    assert waited < 0.1, "wait(stream) blocked the host"
    assert not producer.query(), "the host waited for the producer's sleep"
    if isinstance(b, CupyNCCLBackend):
        assert not work.is_completed(), "the gather finished before the producer's sleep did"
    consumer.synchronize()
    assert work.is_completed()
    assert torch.equal(doubled, x * 2)  # without the event wait, this would read -2s


@needs_cuda
@pytest.mark.skipif(not HAS_CUPY, reason="needs cupy")
@pytest.mark.parametrize("device_backend", ["cupy-nccl"], indirect=True)
def test_cupy_streams_interoperate(device_backend: CommBackend) -> None:
    b = device_backend
    assert isinstance(b, CupyNCCLBackend)
    side = _cupy.CupyStream(new=True)
    x = torch.ones(4096, device=b.device())
    out = torch.zeros_like(x)
    with side.use():
        out.copy_(x)  # produced on the side stream, which the collective waits for
    work = b.all_reduce(out, op=ReduceOp.AVG, stream=side)
    work.wait(side)
    side.synchronize()
    assert torch.equal(out, x)
    event = side.record_event()
    event.synchronize()
    assert event.query()
    assert b.nccl_stream != side
