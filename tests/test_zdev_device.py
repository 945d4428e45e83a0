"""The zdev simulated accelerator itself: memory, streams, events, copies, the detector.

Every case runs in a worker of the device pool (``zdev_pool``), which loads the device;
this process never does (loading makes ``torch.accelerator.is_available()`` true for the
whole process). Each detector case first shows the access is refused, then that the
synchronisation a real device needs makes it pass: a detector that raised on everything
would fail the second half.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.device, pytest.mark.multirank, pytest.mark.timeout(240)]

RACE = "zdev race detector"


def _run(zdev_pool: Any, fn: Any, *args: Any) -> Any:
    return zdev_pool(1).run(fn, *args, timeout=120)[0]


def _raises(fn: Any, match: str) -> str:
    """The message of the RuntimeError ``fn()`` raises (AssertionError if it does not)."""
    try:
        fn()
    except RuntimeError as exc:
        assert match in str(exc), str(exc)
        return str(exc)
    raise AssertionError(f"expected a RuntimeError matching {match!r}")


# -- the device ---------------------------------------------------------------------------------


def _accelerator_api() -> dict[str, Any]:
    module = torch.get_device_module("zdev")
    x = torch.arange(6.0, device="zdev:3").view(2, 3)
    side = module.Stream()
    before = torch.accelerator.current_stream()
    torch.accelerator.set_stream(side)
    inside = torch.accelerator.current_stream()
    torch.accelerator.set_stream(before)
    event = module.Event(enable_timing=True)
    event.record()
    side.wait_event(event)
    side.wait_stream(torch.accelerator.current_stream())
    with module.stream(side):
        on_side = module.current_stream()
    torch.accelerator.synchronize()
    event.synchronize()
    return {
        "available": torch.accelerator.is_available(),
        "accelerator": str(torch.accelerator.current_accelerator()),
        "devices": torch.accelerator.device_count(),
        "module": all(hasattr(module, n) for n in ("Stream", "Event", "current_stream", "stream")),
        "set_stream": inside == side and torch.accelerator.current_stream() == before,
        "stream_ctx": on_side == side and module.current_stream() == before,
        "query": side.query() and event.query(),
        "values": x.t().contiguous().cpu().tolist(),
        "device": str(x.device),
    }


def test_torch_accelerator_and_device_module(zdev_pool):
    result = _run(zdev_pool, _accelerator_api)
    assert result["available"] and result["accelerator"] == "zdev", result
    assert result["devices"] >= 4, result
    assert result["module"] and result["set_stream"] and result["stream_ctx"], result
    assert result["query"], result
    assert result["values"] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]], result
    assert result["device"] == "zdev:3", result


@pytest.mark.usefixtures("zdev_pool")  # built (or skipped without a toolchain) first
def test_host_cannot_read_device_memory():
    """A raw host dereference of device memory faults, as on a GPU (in a child process)."""
    code = (
        "import torch, zero3.testing.device\n"
        "t = torch.ones(4, device='zdev')\n"
        "print('before', flush=True)\n"
        "torch.ops.zdev.poke(t)\n"
        "print('after', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "before", (done.stdout, done.stderr)
    assert done.returncode == -11, (done.returncode, done.stderr[-2000:])  # SIGSEGV


def _copies_and_kernels() -> dict[str, Any]:
    pinned = torch.arange(8.0).pin_memory()
    on_device = pinned.to("zdev", non_blocking=True)
    back = torch.empty(8, pin_memory=True)
    back.copy_(on_device * 2, non_blocking=True)
    torch.accelerator.synchronize()
    out = torch.empty(0, device="zdev")
    torch.add(on_device, 1, out=out)  # the fallback resizes `out`: _copy_from_and_resize
    storage = on_device.untyped_storage()
    storage.resize_(64)  # 16 floats: the first 8 kept
    kept = torch.empty(0, device="zdev").set_(storage, 0, (8,), (1,))
    grads = torch.ones(3, device="zdev", requires_grad=True)
    (grads * grads).sum().backward()
    return {
        "pinned": pinned.is_pinned() and back.is_pinned(),
        "back": back.tolist(),
        "out": out.cpu().tolist(),
        "kept": kept.cpu().tolist(),
        "grad": grads.grad.cpu().tolist(),
        "devices": [torch.ones(1, device=f"zdev:{i}").device.index for i in range(4)],
        "mixed": _raises(lambda: torch.ones(3, device="zdev") + torch.ones(3), "same device"),
        "two_devices": _raises(
            lambda: torch.ones(3, device="zdev:0") + torch.ones(3, device="zdev:1"), "same device"
        ),
        "scalar_ok": (torch.ones(3, device="zdev") * torch.tensor(2.0)).cpu().tolist(),
    }


def test_pinned_memory_non_blocking_copies_and_the_fallback(zdev_pool):
    result = _run(zdev_pool, _copies_and_kernels)
    assert result["pinned"], result
    assert result["back"] == [2.0 * i for i in range(8)], result
    assert result["out"] == [1.0 + i for i in range(8)], result
    assert result["kept"] == [float(i) for i in range(8)], result
    assert result["grad"] == [2.0, 2.0, 2.0], result
    assert result["devices"] == [0, 1, 2, 3], result
    assert "zdev:0 and cpu" in result["mixed"], result  # torch.cuda's own message
    assert "zdev:0 and zdev:1" in result["two_devices"], result
    assert result["scalar_ok"] == [2.0, 2.0, 2.0], result


def _checkpoint_round_trip(path: str) -> list[float]:
    torch.save({"w": torch.arange(4.0, device="zdev:1")}, path)
    loaded = torch.load(path, map_location="zdev:2")["w"]
    assert loaded.device == torch.device("zdev", 2)
    return loaded.cpu().tolist()


def test_torch_save_and_load_map_zdev_tensors(zdev_pool, tmp_path):
    assert _run(zdev_pool, _checkpoint_round_trip, str(tmp_path / "t.pt")) == [0.0, 1.0, 2.0, 3.0]


# -- the race detector --------------------------------------------------------------------------


def _cross_stream_write_then_read() -> dict[str, str | bool]:
    side = torch.zdev.Stream()
    main = torch.zdev.current_stream()
    x = torch.zeros(4, device="zdev")
    with torch.zdev.stream(side):  # the side stream writes what the default stream made
        unordered = _raises(lambda: x.add_(1), RACE)
        side.wait_stream(main)
        x.add_(1)
    read = _raises(lambda: x * 2, RACE)  # the default stream reads the side stream's write
    torch.zdev.current_stream().wait_stream(side)
    return {"write": unordered, "read": read, "ok": (x * 2).cpu().tolist() == [2.0] * 4}


def test_detector_refuses_an_unordered_cross_stream_access(zdev_pool):
    result = _run(zdev_pool, _cross_stream_write_then_read)
    assert (
        "last written on stream 0 of zdev:0 (the default stream) by aten::zero_" in result["write"]
    )
    assert "reads" in result["read"] and "last written" in result["read"], result
    assert result["ok"] is True, result


def _write_after_read() -> dict[str, str | bool]:
    side = torch.zdev.Stream()
    x = torch.ones(4, device="zdev")
    side.wait_stream(torch.zdev.current_stream())
    with torch.zdev.stream(side):
        y = x * 3  # the side stream reads x
    message = _raises(lambda: x.fill_(5), RACE)  # the default stream overwrites it
    event = side.record_event()
    torch.zdev.current_stream().wait_event(event)
    x.fill_(5)
    return {"message": message, "ok": float(y.sum()) == 12.0}


def test_detector_refuses_overwriting_what_another_stream_reads(zdev_pool):
    result = _run(zdev_pool, _write_after_read)
    assert "writes" in result["message"] and ", read on stream" in result["message"], result


def _free_while_in_use(record: bool) -> str | None:
    side = torch.zdev.Stream()
    x = torch.ones(1024, device="zdev")  # allocated on the default stream
    side.wait_stream(torch.zdev.current_stream())
    with torch.zdev.stream(side):
        _ = x * 2
    if record:
        x.record_stream(side)
    del x  # freed: back in the default stream's pool while the side stream may read it
    try:
        torch.ones(1, device="zdev") + 1  # the next operation raises what the free found
    except RuntimeError as exc:
        return str(exc)
    return None


def test_detector_refuses_a_free_while_another_stream_uses_it(zdev_pool):
    message = _run(zdev_pool, _free_while_in_use, False)
    assert message is not None and "was freed" in message and "record_stream" in message, message
    assert _run(zdev_pool, _free_while_in_use, True) is None  # record_stream covers it


def _unsynchronised_host_read() -> dict[str, Any]:
    side = torch.zdev.Stream()
    side.wait_stream(torch.zdev.current_stream())
    with torch.zdev.stream(side):
        result = torch.ones(4, device="zdev") * 7  # a result on the side stream
    item = _raises(lambda: result[0].item(), RACE)
    to_host = _raises(lambda: result.cpu(), RACE)
    from zero3.testing.device import detector

    before = detector.host_syncs()
    side.synchronize()  # the host waits for the side stream: later work is ordered after it
    value = float(result.sum())
    after = detector.host_syncs()
    syncs = {kind: after[kind] - before[kind] for kind in after}
    return {"item": item, "cpu": to_host, "value": value, "syncs": syncs}


def test_detector_refuses_an_unsynchronised_host_read(zdev_pool):
    result = _run(zdev_pool, _unsynchronised_host_read)
    assert "item (zdev to host)" in result["item"], result
    assert "copy_ (zdev to host)" in result["cpu"], result
    assert result["value"] == 28.0, result
    # one stream synchronisation, one .item()
    assert result["syncs"] == {"stream": 1, "event": 0, "device": 0, "to-host": 1, "to-device": 0}
