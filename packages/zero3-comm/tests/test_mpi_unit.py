"""Single-process tests of the MPI backend (an MPI world of one under plain pytest).

Multi-rank behaviour (results against gloo, async progress, timeouts) is tested under
``mpiexec`` in ``tests/mpi``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from zero3.comm import (
    CommError,
    MPIBackend,
    ReduceOp,
    UnsupportedDTypeError,
    create_backend,
    registered_backends,
)
from zero3.comm._mpi import _reducible_dtypes, bf16_reduce_local

pytestmark = pytest.mark.timeout(60)

MPI = pytest.importorskip("mpi4py.MPI", reason="mpi4py is not installed (zero3-comm[mpi])")

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ALL_DTYPES = [*FLOATS, torch.uint8, torch.int8, torch.int32, torch.int64]


@pytest.fixture
def backend() -> Iterator[MPIBackend]:
    b = MPIBackend(comm=MPI.COMM_SELF, timeout_s=10)
    yield b
    b.close()


def sample(dtype: torch.dtype, n: int = 37, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (n,), generator=g).to(dtype)


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


# -- availability and construction ------------------------------------------------------


def test_registered_and_available() -> None:
    assert "mpi" in registered_backends()
    assert MPIBackend.unavailable_reason() is None
    assert MPIBackend.is_available()


def test_missing_mpi4py_message(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes the import raise ModuleNotFoundError, as if not installed.
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    reason = MPIBackend.unavailable_reason()
    assert reason is not None
    assert "mpi4py" in reason and "pip install 'zero3-comm[mpi]'" in reason
    with pytest.raises(ImportError, match=r"zero3-comm\[mpi\]"):
        MPIBackend()


def test_create_backend_world_of_one() -> None:
    b = create_backend("mpi", timeout_s=5)
    try:
        assert isinstance(b, MPIBackend)
        assert (b.rank, b.world_size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
        assert b.name == "mpi" and b.device_type == "cpu"
        assert b.capabilities.native_reduce_scatter and b.capabilities.needs_progress_helper
        assert b.timeout_s == 5.0
        # The backend works on its own duplicate of COMM_WORLD, never on the caller's.
        assert b.comm != MPI.COMM_WORLD
        assert MPI.Comm.Compare(b.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    finally:
        b.close()


# -- the bf16 user-defined reduction ops ------------------------------------------------


SPECIALS = [0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40, float("inf"), float("-inf"), 0.1]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN])
def test_bf16_op_matches_torch(op: ReduceOp) -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.cat([torch.randn(4096, generator=g) * 100, torch.tensor(SPECIALS)]).bfloat16()
    b = torch.cat([torch.randn(4096, generator=g), torch.tensor(SPECIALS[::-1])]).bfloat16()
    expected = {
        ReduceOp.SUM: lambda: b + a,
        ReduceOp.MAX: lambda: torch.maximum(b, a),
        ReduceOp.MIN: lambda: torch.minimum(b, a),
    }[op]()
    inout = b.clone()
    # Through MPI_Reduce_local: the very op object the collectives use.
    bf16_reduce_local(a.view(torch.uint16).numpy(), inout.view(torch.uint16).numpy(), op)
    assert torch.equal(bf16_bits(inout), bf16_bits(expected))


def test_bf16_sum_rounds_to_nearest_even() -> None:
    # 1 + 2^-8 is a tie between bf16 neighbours 1 and 1 + 2^-7: it rounds to the even 1.
    # 1 + 3 * 2^-8 ties between 1 + 2^-7 and 1 + 2^-6 and rounds up to the even 1 + 2^-6.
    a = torch.tensor([1.0, 1.0 + 2**-7, 2.0**-8], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-8, 2.0**-8, 2.0**-8], dtype=torch.bfloat16)
    inout = b.clone()
    bf16_reduce_local(a.view(torch.uint16).numpy(), inout.view(torch.uint16).numpy())
    assert inout.float().tolist() == [1.0, 1.0 + 2**-6, 2.0**-7]


def test_bf16_sum_keeps_nan() -> None:
    a = torch.tensor([float("nan"), float("inf")], dtype=torch.bfloat16)
    inout = torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16)
    bf16_reduce_local(a.view(torch.uint16).numpy(), inout.view(torch.uint16).numpy())
    assert inout.isnan().all()


def test_bf16_op_on_empty_buffers() -> None:
    a = torch.empty(0, dtype=torch.bfloat16)
    bf16_reduce_local(a.view(torch.uint16).numpy(), a.clone().view(torch.uint16).numpy())


# -- collectives at world size 1 ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_collectives_world_of_one(backend: MPIBackend, dtype: torch.dtype) -> None:
    x = sample(dtype)
    out = torch.full_like(x, 7)
    backend.all_gather(out, x).wait()
    assert torch.equal(out, x)
    out = torch.full_like(x, 7)
    backend.reduce_scatter(out, x, op=ReduceOp.SUM).wait()
    assert torch.equal(out, x)
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
        y = x.clone()
        backend.all_reduce(y, op=op).wait()
        assert torch.equal(y, x)
    y = x.clone()
    backend.broadcast(y, 0).wait()
    assert torch.equal(y, x)
    backend.barrier().wait()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_avg_world_of_one(backend: MPIBackend, dtype: torch.dtype) -> None:
    x = sample(dtype)
    y = x.clone()
    backend.all_reduce(y, op=ReduceOp.AVG).wait()
    assert torch.equal(y, x)
    out = torch.empty_like(x)
    backend.reduce_scatter(out, x).wait()  # AVG is the default
    assert torch.equal(out, x)


def test_avg_divides_by_world_size_inside_wait() -> None:
    # A backend claiming a world of 4 on COMM_SELF is not possible, so check the hook
    # the AVG path runs: the division happens once, in wait(), after completion.
    b = MPIBackend(comm=MPI.COMM_SELF, timeout_s=10)
    try:
        b._world_size = 4  # only the divisor reads it at world 1 ...
        b._rank = 0
        t = torch.full((8,), 8.0)
        work = b._all_reduce(t, ReduceOp.AVG, None)
        work.wait()
        assert t.tolist() == [2.0] * 8
        work.wait()  # a second wait does not divide again
        assert t.tolist() == [2.0] * 8
    finally:
        b.close()


def test_coalesced_world_of_one(backend: MPIBackend) -> None:
    inputs = [sample(torch.float32, n, seed=n) for n in (3, 1, 10)]
    outputs = [torch.empty_like(t) for t in inputs]
    backend.all_gather_coalesced(outputs, inputs).wait()
    assert all(torch.equal(o, i) for o, i in zip(outputs, inputs, strict=True))
    outputs = [torch.empty_like(t) for t in inputs]
    backend.reduce_scatter_coalesced(outputs, inputs, op=ReduceOp.SUM).wait()
    assert all(torch.equal(o, i) for o, i in zip(outputs, inputs, strict=True))


def test_non_contiguous_input_and_grad(backend: MPIBackend) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    x = base.t()  # non-contiguous: the backend must send logical order, not memory order
    out = torch.empty(12)
    backend.all_gather(out, x).wait()
    assert torch.equal(out, x.reshape(-1))
    w = torch.ones(5, requires_grad=True)
    out = torch.empty(5)
    backend.all_gather(out, w).wait()
    assert torch.equal(out, torch.ones(5))


def test_zero_elements(backend: MPIBackend) -> None:
    x = torch.empty(0, dtype=torch.bfloat16)
    backend.all_gather(torch.empty(0, dtype=torch.bfloat16), x).wait()
    backend.all_reduce(x.clone()).wait()


# -- errors -----------------------------------------------------------------------------


def test_unsupported_dtype(backend: MPIBackend) -> None:
    x = torch.ones(4, dtype=torch.complex64)
    with pytest.raises(UnsupportedDTypeError, match="cannot reduce"):
        backend.all_reduce(x)
    with pytest.raises(UnsupportedDTypeError, match="AVG needs a floating dtype"):
        backend.all_reduce(torch.ones(4, dtype=torch.int32), op=ReduceOp.AVG)
    # Gathers move bytes: any dtype works.
    out = torch.empty(4, dtype=torch.complex64)
    backend.all_gather(out, x).wait()
    assert torch.equal(out, x)


def test_bad_arguments(backend: MPIBackend) -> None:
    with pytest.raises(ValueError, match="world_size"):
        backend.all_gather(torch.empty(3), torch.ones(4))
    with pytest.raises(ValueError, match="world_size"):
        backend.reduce_scatter(torch.empty(3), torch.ones(4))
    with pytest.raises(TypeError, match="dtype"):
        backend.all_gather(torch.empty(4, dtype=torch.float16), torch.ones(4))
    with pytest.raises(ValueError, match="contiguous"):
        backend.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="src=1"):
        backend.broadcast(torch.ones(4), 1)
    with pytest.raises(ValueError, match="meta"):
        backend.all_reduce(torch.ones(4, device="meta"))
    with pytest.raises(TypeError, match="ReduceOp"):
        backend.all_reduce(torch.ones(4), op="sum")  # type: ignore[arg-type]


def test_closed_backend_refuses_work() -> None:
    b = MPIBackend(comm=MPI.COMM_SELF)
    b.close()
    b.close()  # idempotent
    with pytest.raises(CommError, match="closed"):
        b.all_reduce(torch.ones(2))


# -- work handles and the progress thread -----------------------------------------------


def test_is_completed_and_repeated_wait(backend: MPIBackend) -> None:
    x = torch.ones(1 << 16)
    out = torch.empty_like(x)
    work = backend.all_gather(out, x)
    deadline = time.monotonic() + 10
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed() never became True"
        time.sleep(1e-4)
    work.wait()
    work.wait()
    assert work.is_completed()
    assert torch.equal(out, x)


def test_progress_thread_lifecycle() -> None:
    b = MPIBackend(comm=MPI.COMM_SELF)
    try:
        assert b.progress_thread is None  # started lazily, with the first collective
        b.all_reduce(torch.ones(4)).wait()
        thread = b.progress_thread
        assert thread is not None and thread.is_alive() and thread.daemon
        assert b.capabilities.async_host
    finally:
        b.close()
    assert b.progress_thread is None
    assert not thread.is_alive()


def test_no_progress_thread_when_disabled() -> None:
    b = MPIBackend(comm=MPI.COMM_SELF, progress_thread=False)
    try:
        work = b.all_reduce(torch.ones(4))
        assert b.progress_thread is None
        assert not b.capabilities.async_host
        deadline = time.monotonic() + 10
        while not work.is_completed():  # without a thread, is_completed() polls MPI
            assert time.monotonic() < deadline
        work.wait()
    finally:
        b.close()


def test_thread_level_below_multiple_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    with caplog.at_level("WARNING", logger="zero3.comm._mpi"):
        b = MPIBackend(comm=MPI.COMM_SELF)
    try:
        assert "MPI_THREAD_MULTIPLE" in caplog.text
        assert not b.capabilities.async_host
        x = sample(torch.bfloat16)
        b.all_reduce(x.clone()).wait()
        assert b.progress_thread is None
    finally:
        b.close()


def test_many_requests_from_two_threads(backend: MPIBackend) -> None:
    # Issuing and waiting from several threads at once must stay correct: one lock
    # serializes the MPI calls and each request is completed exactly once.
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(50):
                x = sample(torch.float32, 64, seed=seed * 100 + i)
                out = torch.empty_like(x)
                backend.all_gather(out, x).wait()
                assert torch.equal(out, x)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors


def test_reducible_dtypes_follow_the_mpi_library() -> None:
    # An MPI without a 16-bit float type (fromcode("e") fails) must not claim float16.
    class NoFloat16:
        DATATYPE_NULL = MPI.DATATYPE_NULL

        class Datatype:
            @staticmethod
            def fromcode(code: str) -> object:
                if code == "e":
                    raise ValueError("cannot map code 'e' to MPI datatype")
                return MPI.Datatype.fromcode(code)

    dtypes = _reducible_dtypes(NoFloat16)
    assert torch.float16 not in dtypes
    assert {torch.float32, torch.bfloat16, torch.int64} <= dtypes
    b = MPIBackend(comm=MPI.COMM_SELF)
    try:
        assert b.capabilities.reduce_dtypes == _reducible_dtypes(MPI)
    finally:
        b.close()
