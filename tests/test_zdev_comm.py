"""The ``zdev`` comm backend: a plugin, real collectives, NCCL's refusals, the comm stream."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zero3.comm import BackendUnavailableError, backend_class, registered_backends

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(240)]

RACE = "zdev race detector"


def test_zdev_backend_is_a_plugin_that_needs_the_device_loaded():
    # This process never loads the device: the backend is registered, and says why it
    # cannot run here rather than failing somewhere inside.
    assert "zdev" in registered_backends()
    with pytest.raises(BackendUnavailableError, match=r"import zero3\.testing\.device"):
        backend_class("zdev")


def _collectives(dtype_name: str) -> dict[str, Any]:
    from zero3.comm import ReduceOp, create_backend

    dtype = getattr(torch, dtype_name)
    comm = create_backend("zdev", timeout_s=30)
    n, r = comm.world_size, comm.rank
    dev = comm.device()
    mine = torch.arange(4, dtype=dtype, device=dev) + 10 * r
    gathered = torch.empty(4 * n, dtype=dtype, device=dev)
    comm.all_gather(gathered, mine).wait()
    scattered = torch.empty(2, dtype=dtype, device=dev)
    comm.reduce_scatter(
        scattered, torch.full((2 * n,), float(r + 1), dtype=dtype, device=dev)
    ).wait()
    summed = torch.full((3,), float(r), dtype=dtype, device=dev)
    comm.all_reduce(summed, op=ReduceOp.SUM).wait()
    sent = torch.full((2,), float(r + 5), dtype=dtype, device=dev)
    comm.broadcast(sent, src=n - 1).wait()
    outs = [torch.empty(2 * n, dtype=dtype, device=dev), torch.empty(n, dtype=dtype, device=dev)]
    ins = [
        torch.full((2,), float(r), dtype=dtype, device=dev),
        torch.ones(1, dtype=dtype, device=dev),
    ]
    comm.all_gather_coalesced(outs, ins).wait()
    return {
        "type": type(comm).__name__,
        "device": str(dev),
        "gathered": gathered.float().cpu().tolist(),
        "scattered": scattered.float().cpu().tolist(),
        "summed": summed.float().cpu().tolist(),
        "sent": sent.float().cpu().tolist(),
        "coalesced": [o.float().cpu().tolist() for o in outs],
    }


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_collectives_on_zdev_tensors(zdev_pool, dtype_name):
    results = zdev_pool(2).run(_collectives, dtype_name, timeout=120)
    for r, result in enumerate(results):
        assert result["type"] == "ZdevBackend" and result["device"] == f"zdev:{r}", result
        assert result["gathered"] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0], result
        assert result["scattered"] == [1.5, 1.5], result  # AVG of 1 and 2
        assert result["summed"] == [1.0, 1.0, 1.0], result
        assert result["sent"] == [6.0, 6.0], result
        assert result["coalesced"] == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0]], result


def _refusals() -> dict[str, str]:
    from zero3.comm import create_backend

    comm = create_backend("zdev", timeout_s=30)
    other = (comm.rank + 1) % 4
    messages = {}
    for name, tensor in {
        "cpu": torch.ones(2),
        "device": torch.ones(2, device=f"zdev:{other}"),
    }.items():
        try:
            comm.all_reduce(tensor)
        except ValueError as exc:
            messages[name] = str(exc)
    comm.barrier().wait()
    return messages


def test_cpu_tensors_are_refused_as_nccl_refuses_them(zdev_pool):
    for result in zdev_pool(2).run(_refusals, timeout=120):
        # The check every device backend inherits (CommBackend._check_device).
        assert "is on cpu but the 'zdev' backend moves zdev tensors" in result["cpu"], result
        assert "but this rank's backend serves zdev:" in result["device"], result


def _output_before_wait(how: str) -> str | None:
    from zero3.comm import Stream, create_backend

    comm = create_backend("zdev", timeout_s=30)
    dev = comm.device()
    out = torch.empty(2 * comm.world_size, device=dev)
    mine = torch.ones(2, device=dev)  # kept: freeing it early would be a race of its own
    work = comm.all_gather(out, mine)
    side = Stream.for_device("zdev", new=True)
    try:
        if how == "unwaited":
            out.sum()  # read on the compute stream before wait()
        elif how == "other-stream":
            work.wait(side)  # only the side stream is ordered after the gather
            out.sum()
        else:
            work.wait()
            out.sum()
    except RuntimeError as exc:
        return str(exc)
    finally:
        work.wait()
        comm.current_stream().wait_stream(side)  # before `out` is freed (its pool's stream)
    return None


@pytest.mark.parametrize("how", ["unwaited", "other-stream", "waited"])
def test_reading_an_output_before_its_wait_is_a_race(zdev_pool, how):
    for message in zdev_pool(2).run(_output_before_wait, how, timeout=120):
        if how == "waited":
            assert message is None
        else:
            assert message is not None and RACE in message, message
            assert "zdev.all_gather (rank" in message and "writing its output" in message, message
