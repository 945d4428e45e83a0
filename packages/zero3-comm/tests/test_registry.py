"""Single-process tests of backend discovery, selection and argument validation."""

from __future__ import annotations

import pytest
import torch

import zero3.comm as comm
from zero3.comm import _registry


@pytest.fixture(autouse=True)
def fresh_registry():
    _registry._reset_registry()
    yield
    _registry._reset_registry()


def test_builtins_are_registered_first_then_plugins():
    names = comm.registered_backends()
    assert names[:5] == ["gloo", "nccl", "hccl", "mpi", "cupy-nccl"]
    assert "loopback" in names  # the example plugin, found through its entry point
    assert "gloo" in comm.available_backends()


def test_plugin_backend_is_picked_by_name_and_works():
    backend = comm.create_backend("loopback")
    assert type(backend).__name__ == "LoopbackBackend"
    assert (backend.rank, backend.world_size) == (0, 1)
    out = torch.empty(3)
    backend.all_gather(out, torch.tensor([1.0, 2.0, 3.0])).wait()
    assert out.tolist() == [1.0, 2.0, 3.0]


def test_unknown_backend_lists_registered_ones():
    with pytest.raises(comm.UnknownBackendError) as info:
        comm.create_backend("glooo")
    message = str(info.value)
    assert "'glooo'" in message
    for name in ("gloo", "nccl", "mpi", "loopback"):
        assert name in message


def test_unavailable_backend_says_why_and_what_is_available():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(comm.BackendUnavailableError) as info:
        comm.create_backend("nccl")
    message = str(info.value)
    assert "'nccl' is not available" in message
    assert "CUDA" in message
    assert "gloo" in message  # lists what would work instead


class _Other(comm.CommBackend):
    name = "gloo"

    def _all_gather(self, output, input, stream):  # pragma: no cover - never called
        raise NotImplementedError

    _reduce_scatter = _all_reduce = _broadcast = _barrier = _all_gather


def test_duplicate_name_is_an_error_unless_overriding():
    registry = comm.BackendRegistry()
    registry.register("gloo", comm.GlooBackend)
    registry.register("gloo", comm.GlooBackend)  # same class again is harmless
    with pytest.raises(ValueError, match=r"already registered.*override=True"):
        registry.register("gloo", _Other)
    registry.register("gloo", _Other, override=True)
    assert registry.get("gloo") is _Other


def test_register_rejects_non_backends():
    with pytest.raises(TypeError, match=r"not a subclass of zero3\.comm\.CommBackend"):
        comm.BackendRegistry().register("x", dict)  # type: ignore[arg-type]


def test_default_backend_hook_decides_what_auto_means(monkeypatch):
    class ChooseLoopback:
        @comm.hookimpl
        def zero3_comm_default_backend(self, device_type):
            return "loopback" if device_type == "cpu" else None

    manager, _ = _registry._load()
    manager.register(ChooseLoopback())
    assert type(comm.create_backend("auto")).__name__ == "LoopbackBackend"


def test_auto_is_gloo_on_cpu(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    manager, registry = _registry._load()
    assert _registry._auto_name(manager, registry) == "gloo"


def test_validation_errors_name_the_problem():
    backend = comm.create_backend("loopback")
    with pytest.raises(ValueError, match="needs world_size"):
        backend.all_gather(torch.empty(4), torch.ones(3))
    with pytest.raises(ValueError, match="must be contiguous"):
        backend.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="differs from input dtype"):
        backend.all_gather(torch.empty(3, dtype=torch.float16), torch.ones(3))
    with pytest.raises(comm.UnsupportedDTypeError, match=r"cannot reduce torch\.bool"):
        backend.all_reduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="src=3 is not a rank"):
        backend.broadcast(torch.ones(2), src=3)
    with pytest.raises(TypeError, match="one dtype"):
        backend.all_gather_coalesced(
            [torch.empty(1), torch.empty(1, dtype=torch.float16)],
            [torch.ones(1), torch.ones(1, dtype=torch.float16)],
        )
    with pytest.raises(TypeError, match=r"zero3\.comm\.ReduceOp"):
        backend.all_reduce(torch.ones(2), op="sum")  # type: ignore[arg-type]


def test_coalesced_defaults_use_one_flat_collective():
    calls = []

    class Counting(type(comm.create_backend("loopback"))):  # type: ignore[misc]
        def _all_gather(self, output, input, stream):
            calls.append(("all_gather", input.numel()))
            return super()._all_gather(output, input, stream)

        def _reduce_scatter(self, output, input, op, stream):
            calls.append(("reduce_scatter", input.numel()))
            return super()._reduce_scatter(output, input, op, stream)

    backend = Counting()
    outs = [torch.empty(2), torch.empty(3)]
    backend.all_gather_coalesced(outs, [torch.ones(2), torch.full((3,), 2.0)]).wait()
    assert outs[1].tolist() == [2.0, 2.0, 2.0]
    backend.reduce_scatter_coalesced(outs, [torch.ones(2), torch.ones(3)]).wait()
    assert calls == [("all_gather", 5), ("reduce_scatter", 5)]


def test_host_stream_is_a_no_op_and_comparable():
    s = comm.Stream.for_device("cpu")
    assert isinstance(s, comm.HostStream)
    s.wait_stream(comm.Stream.for_device("cpu"))
    assert s.record_event().query()
    with s.use():
        pass
    assert s == comm.HostStream()


def test_a_broken_plugin_does_not_take_the_builtins_down(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.entry_points

    def with_broken(*args, **kwargs):
        eps = list(real(*args, **kwargs))
        if kwargs.get("group") == "zero3.comm":
            eps.append(
                importlib.metadata.EntryPoint(
                    name="broken", value="zero3_no_such_module_xyz", group="zero3.comm"
                )
            )
        return eps

    monkeypatch.setattr(_registry.importlib.metadata, "entry_points", with_broken)
    with pytest.warns(UserWarning, match="plugin 'broken'.*failed to load"):
        names = comm.registered_backends()
    assert "gloo" in names and "loopback" in names
    with pytest.raises(comm.UnknownBackendError, match="plugin 'broken' failed to load"):
        comm.create_backend("broken")


def test_gloo_refuses_a_partial_launch_environment(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(ValueError, match=r"started by mpiexec.*'mpi' backend"):
        comm.GlooBackend(timeout_s=5)
    monkeypatch.delenv("PMI_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="rendezvous environment is incomplete"):
        comm.GlooBackend(timeout_s=5)
