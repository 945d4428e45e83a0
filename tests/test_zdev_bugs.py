"""The device catches the engine's device bugs: each bug class reintroduced on purpose.

Each case trains one clean step first (the engine as it is passes), then patches one
engine method or class for the rest of the case to reintroduce a bug of a known class,
and returns what the next step raised:

* a host (CPU) tensor handed to a collective: the got-gradient flags all-reduced from
  host memory (the bug issue 17 fixed) — the zdev backend refuses it as NCCL does;
* a gathered buffer read before its gather's event: the gather waited for on a stream
  the compute stream never waits for — the detector sees the compute stream read what
  the comm stream writes;
* a pool buffer reused while the comm stream still uses it: a pool that keeps device
  buffers (as the engine's pool keeps host ones) and a gather that gives its buffer back
  when it is issued instead of when it is finished — the next gather packs into it;
* a host read of an unsynchronised device result: the flags read back to the host
  before their all-reduce is waited for.

The patches replace zero3's own methods for one case inside the worker, never torch's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

from zero3.comm import ReduceOp, Stream
from zero3.core import Zero3Config
from zero3.core.engine import BufferPool, ShardedModelState, sharded_state
from zero3.hooks import shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import build, loss_of

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(240)]

RACE = "zdev race detector"


def _flags(reducer: Any) -> torch.Tensor:
    """The reducer's got-gradient/late flags, built on the host as the engine builds them."""
    n = len(reducer.params)
    flags = torch.zeros(2 * n, dtype=torch.uint8)
    flags[:n] = reducer._arrived
    return flags


def flags_from_host_memory(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Bug: the flags all-reduced where they were built, in host memory."""
    flags = _flags(self)
    n = len(self.params)
    self.comm.all_reduce(flags, op=ReduceOp.MAX).wait()
    return flags[:n].bool(), flags[n:].bool()


def flags_read_before_wait(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Bug: the host reads the reduced flags before the all-reduce is waited for."""
    on_device = _flags(self).to(self.comm.device())
    n = len(self.params)
    work = self.comm.all_reduce(on_device, op=ReduceOp.MAX)
    flags = on_device.cpu()
    work.wait()
    return flags[:n].bool(), flags[n:].bool()


def _coordinator_module(state: ShardedModelState) -> Any:
    """The module the coordinator builds its gather handles in (where to patch the class)."""
    return sys.modules[type(state.coordinator).__module__]


def _waits_on_an_unused_stream(handle: type) -> type:
    class WaitsElsewhere(handle):  # type: ignore[misc, valid-type]
        """Bug: the gather is waited for on a stream the compute stream never waits for."""

        def finish(self, stream: Stream | None = None) -> None:
            super().finish(Stream.for_device("zdev", new=True))

    return WaitsElsewhere


def _gives_back_at_issue(handle: type) -> type:
    class GivesBackEarly(handle):  # type: ignore[misc, valid-type]
        """Bug: the receive buffer goes back to the pool as soon as the gather is issued."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pool.give(self._recv)

    return GivesBackEarly


def keeps_device_buffers(self: BufferPool, buffer: torch.Tensor) -> None:
    """A pool that keeps device buffers as the engine's keeps host ones (no size limit)."""
    base = self._lent.pop(buffer.data_ptr(), None)
    self._free.append(base if base is not None else buffer.reshape(-1).view(torch.uint8))
    self.cached_bytes += self._free[-1].numel()


@contextlib.contextmanager
def _bug(name: str, state: ShardedModelState) -> Iterator[None]:
    """Reintroduce bug ``name`` into the engine classes ``state`` uses, for the block."""
    reducer = type(state.reducer)
    module = _coordinator_module(state)
    handle = module.GatherHandle
    patches = {
        "host-tensor": [(reducer, "_exchange_flags", flags_from_host_memory)],
        "read-before-event": [(module, "GatherHandle", _waits_on_an_unused_stream(handle))],
        "pool-reuse": [
            (BufferPool, "give", keeps_device_buffers),
            (module, "GatherHandle", _gives_back_at_issue(handle)),
        ],
        # the pool alone, buffers returned when the engine returns them: no bug
        "pool-keeps-device-buffers": [(BufferPool, "give", keeps_device_buffers)],
        "host-read-unsynchronised": [(reducer, "_exchange_flags", flags_read_before_wait)],
    }[name]
    with contextlib.ExitStack() as stack:
        for owner, attribute, replacement in patches:
            stack.enter_context(mock.patch.object(owner, attribute, replacement))
        yield


def _step(model: torch.nn.Module, opt: PartitionedOptimizer, make: Any, step: int) -> None:
    dev = torch.device("zdev", int(os.environ["LOCAL_RANK"]))
    n, r = torch.distributed.get_world_size(), torch.distributed.get_rank()
    x = make(2 * n, step)[r * 2 : (r + 1) * 2].to(dev)
    loss_of(model(x)).backward()
    opt.step()
    opt.zero_grad()


def _with_bug(name: str) -> dict[str, Any]:
    from zero3.testing.device import detector

    model, make = build("gpt_tied")
    model.to(torch.device("zdev", int(os.environ["LOCAL_RANK"])))
    config = Zero3Config(
        backend="zdev", param_persistence_threshold=0, overlap_comm=True, overlap_chunk_size=2000
    )
    shard_module(model, config)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _step(model, opt, make, 0)  # the engine as it is
    clean = stats(model).gathers
    error: BaseException | None = None
    with _bug(name, sharded_state(model)):
        try:
            for step in (1, 2):
                _step(model, opt, make, step)
        except (RuntimeError, ValueError) as exc:
            error = exc
    detector.take_pending()  # frees while unwinding the failed step
    torch.distributed.barrier()
    return {
        "clean_gathers": clean,
        "type": type(error).__name__ if error else None,
        "message": str(error) if error else "",
    }


def _run(zdev_pool: Any, name: str) -> list[dict[str, Any]]:
    results = zdev_pool(2).run(_with_bug, name, timeout=180)
    for result in results:
        assert result["clean_gathers"] > 0, result  # the clean step really gathered
    return results


def test_a_host_tensor_handed_to_a_collective_is_refused(zdev_pool):
    for result in _run(zdev_pool, "host-tensor"):
        assert result["type"] == "ValueError", result
        assert "is on cpu but the 'zdev' backend moves zdev tensors" in result["message"], result


def test_a_gathered_buffer_read_before_its_event_is_a_race(zdev_pool):
    for result in _run(zdev_pool, "read-before-event"):
        assert result["type"] == "RuntimeError" and RACE in result["message"], result
        assert "zdev.all_gather (rank" in result["message"], result
        assert "reads" in result["message"] and "last written" in result["message"], result


def test_a_pool_buffer_reused_while_the_comm_stream_uses_it_is_a_race(zdev_pool):
    for result in _run(zdev_pool, "pool-reuse"):
        assert result["type"] == "RuntimeError" and RACE in result["message"], result
        assert "zdev.all_gather (rank" in result["message"], result
        assert "writes" in result["message"], result


def test_a_pool_of_device_buffers_given_back_after_the_wait_is_safe(zdev_pool):
    for result in _run(zdev_pool, "pool-keeps-device-buffers"):
        assert result["type"] is None, result


def test_a_host_read_of_an_unsynchronised_result_is_a_race(zdev_pool):
    for result in _run(zdev_pool, "host-read-unsynchronised"):
        assert result["type"] == "RuntimeError" and RACE in result["message"], result
        assert "copy_ (zdev to host)" in result["message"], result
        assert "zdev.all_reduce (rank" in result["message"], result
