"""The device-discipline instruments catch what they are for, and only that.

Each planted violation below is one an accelerator run would hit (a host tensor handed to
nccl, a packed buffer written after the collective's stream waited, a per-parameter host
sync); the same code written correctly must pass.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zero3.comm import HostStream, NCCLBackend, ReduceOp, UnsupportedDTypeError
from zero3.core import Zero3Config
from zero3.hooks import full_state_dict, shard_module
from zero3.optim import PartitionedOptimizer
from zero3.testing import (
    HOST_MEMORY,
    MIXED_DEVICES,
    STREAM_ORDER,
    CheckingBackend,
    DeviceDisciplineError,
    DeviceTracker,
    HostSyncCounter,
    Residence,
    StreamOrderError,
)
from zero3.testing.models import Checkpointed, build, loss_of
from zero3.testing.recording import RecordingBackend


def _checked(world: int = 2, *, strict: bool = True, mirror: str = "nccl"):
    tracker = DeviceTracker()
    return tracker, CheckingBackend(RecordingBackend(world), tracker, mirror=mirror, strict=strict)


# -- host memory --------------------------------------------------------------------------------


def test_a_host_flag_tensor_all_reduced_is_rejected_with_where_it_was_made():
    tracker, comm = _checked()
    with tracker:
        flags = torch.zeros(8, dtype=torch.uint8)  # planted: no device=, so host memory
        with pytest.raises(DeviceDisciplineError) as info:
            comm.all_reduce(flags, op=ReduceOp.MAX)
        good = torch.zeros(8, dtype=torch.uint8, device=comm.device())
        comm.all_reduce(good, op=ReduceOp.MAX).wait()
    message = str(info.value)
    assert "nccl.all_reduce" in message
    assert "test_instruments.py:" in message  # the line that allocated it
    assert "host memory" in message and "cuda tensors" in message
    assert [v.kind for v in tracker.violations] == [HOST_MEMORY]
    assert isinstance(info.value, ValueError)  # what CommBackend._check_device raises


def test_where_tensors_live_follows_the_accelerator_rules():
    tracker, comm = _checked()
    device = comm.device()
    with tracker:
        made = {
            "factory without device": torch.zeros(3),
            "device='cpu' string": torch.ones(3, device="cpu"),
            "comm.device()": torch.zeros(3, device=device),
            "like a device tensor": torch.empty_like(torch.zeros(3, device=device)),
            "op on a device tensor": torch.zeros(3, device=device) + 1,
            "op on host tensors": torch.zeros(3) + 1,
        }
        moved = torch.arange(4).to(device)
        back = moved.cpu()
        view = moved[1:]
    expected = {
        "factory without device": Residence.HOST,
        "device='cpu' string": Residence.HOST,
        "comm.device()": Residence.DEVICE,
        "like a device tensor": Residence.DEVICE,
        "op on a device tensor": Residence.DEVICE,
        "op on host tensors": Residence.HOST,
    }
    assert {k: tracker.residence(v) for k, v in made.items()} == expected
    assert tracker.residence(moved) is Residence.DEVICE
    assert tracker.residence(back) is Residence.HOST and back is not moved  # a real copy
    assert tracker.residence(view) is Residence.DEVICE
    assert tracker.residence(torch.ones(2)) is Residence.DEVICE  # never seen: device memory
    assert not tracker.violations


def test_a_host_tensor_mixed_into_a_device_op_is_reported():
    tracker, comm = _checked()
    with tracker:
        on_device = torch.ones(4, device=comm.device())
        on_host = torch.zeros(4, dtype=torch.bool)
        on_device.copy_(torch.arange(4.0))  # a transfer: allowed
        _ = on_device * torch.tensor(2.0)  # a 0-dim host tensor acts as a scalar: allowed
        assert not tracker.violations
        on_host |= on_device > 0  # planted: host |= device
    assert [v.kind for v in tracker.violations] == [MIXED_DEVICES]
    assert "test_instruments.py:" in tracker.violations[0].message


def test_dtype_and_layout_checks_are_the_mirrored_backends_own():
    tracker, comm = _checked(mirror="hccl")
    with tracker:
        with pytest.raises(UnsupportedDTypeError):
            comm.all_reduce(torch.zeros(2, dtype=torch.bool, device=comm.device()))
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_reduce(torch.zeros(4, 4, device=comm.device()).t())
        with pytest.raises(DeviceDisciplineError, match="'hccl' backend moves npu tensors"):
            comm.broadcast(torch.zeros(2), src=0)
    with pytest.raises(ValueError, match="mirror"):
        CheckingBackend(RecordingBackend(1), tracker, mirror="gloo")


# -- stream order ----------------------------------------------------------------------------------


def test_a_buffer_packed_after_the_reduce_stream_waited_is_a_stream_order_error():
    tracker, comm = _checked()
    with tracker:
        reduce_stream = comm.new_stream()
        grads = [torch.randn(4, device=comm.device()) for _ in range(2)]
        out = torch.empty(4, device=comm.device())
        reduce_stream.wait_stream(comm.current_stream())
        packed = torch.cat(grads)  # planted: written on the compute stream after the wait
        with pytest.raises(StreamOrderError, match=r"'compute' by op #\d+ \(cat at test_instr"):
            comm.reduce_scatter(out, packed, stream=reduce_stream)
        reduce_stream.wait_stream(comm.current_stream())  # the fix: wait after packing
        comm.reduce_scatter(out, packed, stream=reduce_stream).wait()
    assert [v.kind for v in tracker.violations] == [STREAM_ORDER]
    record = comm.records[-2]
    assert (record.role, record.stream, record.ordered) == ("input", reduce_stream.name, True)
    assert record.producer is not None and record.producer.startswith("compute#")


def test_coalesced_collectives_run_the_base_class_packing_and_are_checked():
    # The checking backend inherits CommBackend's coalesced collectives, as nccl and hccl
    # do: the packed buffer is what reaches the collective, and it is what gets checked.
    assert CheckingBackend.reduce_scatter_coalesced is NCCLBackend.reduce_scatter_coalesced
    tracker, comm = _checked()
    with tracker:
        grads = [torch.randn(4, device=comm.device()) for _ in range(3)]
        outs = [torch.empty(2, device=comm.device()) for _ in range(3)]
        comm.reduce_scatter_coalesced(outs, grads).wait()  # all on the current stream
        # A host input: on a device, the packing torch.cat itself would fail.
        comm.reduce_scatter_coalesced(outs, [*grads[:2], torch.zeros(4)]).wait()
    assert [v.kind for v in tracker.violations] == [MIXED_DEVICES]
    assert tracker.violations[0].message.startswith("cat at zero3/comm/_backend.py")
    packed = comm.records[0]
    assert (packed.collective, packed.role, packed.numel) == ("reduce_scatter", "input", 12)
    assert packed.producer is not None and "cat" in packed.producer and packed.ordered


def test_reading_a_collective_output_before_waiting_for_it_is_caught():
    tracker, comm = _checked(strict=False)
    with tracker:
        side = comm.new_stream()
        inp = torch.ones(3, device=comm.device())
        out = torch.empty(6, device=comm.device())
        side.wait_stream(comm.current_stream())
        work = comm.all_gather(out, inp, stream=side)
        out.sum()  # planted: the compute stream has not waited for the gather
        assert [v.kind for v in tracker.violations] == [STREAM_ORDER]
        work.wait(comm.current_stream())
        out.sum()
        event = side.record_event()
        comm.current_stream().wait_event(event)
    assert len(tracker.violations) == 1
    assert "'compute'" in tracker.violations[0].message and side.name in str(tracker.violations[0])


# -- host synchronizations ---------------------------------------------------------------------


def test_a_per_parameter_float_is_counted_once_per_parameter():
    tracker, comm = _checked()
    counter = HostSyncCounter(tracker)
    with tracker, counter:
        params = [torch.randn(3, device=comm.device()) for _ in range(5)]
        for n in (2, 5):
            with counter.step():
                sum(float(p.pow(2).sum()) for p in params[:n])  # planted: one sync each
            with counter.step():
                float(torch.stack([p.pow(2).sum() for p in params[:n]]).sum())
    assert counter.counts() == [2, 1, 5, 1]
    assert {s.kind for s in counter.syncs} == {"read"}
    assert all("test_instruments.py:" in s.site for s in counter.syncs)


def test_every_kind_of_host_synchronization_is_told_apart():
    tracker, comm = _checked()
    counter = HostSyncCounter(tracker)
    device = comm.device()
    with tracker, counter:
        x = torch.arange(6.0, device=device)
        host = torch.ones(6)
        with counter.step():
            x.sum().item()
            x.tolist()
            bool(x[0] > 1)
        with counter.step():
            x.cpu()
            x.to("cpu")
            host.copy_(x)
        with counter.step():
            x.copy_(host)
            x[:2] = host[:2]
            torch.tensor([1, 2], device=device)
            host.to(device)
        with counter.step():
            torch.nonzero(x)
            x[x > 2]
        with counter.step():  # none of these stalls a device
            float(host.sum())
            host.tolist()
            x.copy_(host, non_blocking=True)
            torch.zeros(2, device=device)
            x.numel()
            comm.current_stream().wait_stream(comm.new_stream())
        with counter.step():
            comm.new_stream().synchronize()
            comm.all_reduce(x).wait(HostStream())
    kinds = [[s.kind for s in step] for step in counter.steps]
    assert kinds[:5] == [
        ["read"] * 3,
        ["to-host"] * 3,
        ["to-device"] * 4,
        ["shape"] * 2,
        [],
    ]
    assert kinds[5] == ["wait", "wait"]


def test_without_a_tracker_every_tensor_counts_as_device_memory():
    counter = HostSyncCounter()
    with counter, counter.step():
        t = torch.ones(3)
        float(t.sum())
        t.cpu()
        t.to(torch.device("cpu"))  # no tracker: transfers into device memory are unknown
    assert counter.counts() == [2]


# -- backward, and transparency -----------------------------------------------------------------


def test_hooks_and_reentrant_checkpointing_in_backward_are_observed():
    tracker, comm = _checked(strict=False)
    counter = HostSyncCounter(tracker)
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True)
    seen = []

    def hook(param: torch.Tensor) -> None:
        flags = torch.zeros(2, dtype=torch.uint8)  # planted, inside backward
        comm.all_reduce(flags, op=ReduceOp.MAX).wait()
        seen.append(float(param.grad.sum()))  # a device read inside backward

    model.shared.weight.register_post_accumulate_grad_hook(hook)
    with tracker, counter, counter.step():
        x = torch.randn(3, 16).to(comm.device())
        loss_of(model(x)).backward()
    # Used outside and inside two checkpointed regions: one outer and two inner backwards.
    assert len(seen) == 3
    assert [v.kind for v in tracker.violations] == [HOST_MEMORY] * 3
    assert counter.counts(["read"]) == [3]  # (moving x to the device is a "to-device")


def _train(model, comm, steps: int = 2) -> dict[str, torch.Tensor]:
    _, make = build("gpt_tied")
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(steps):
        loss_of(model(make(2, step).to(comm.device()))).backward()
        opt.step()
        opt.zero_grad()
    return full_state_dict(model)


def test_training_through_the_instruments_is_bitwise_unchanged():
    model, _ = build("gpt_tied")
    twin = copy.deepcopy(model)
    plain = _train(model, RecordingBackend(1))
    tracker, comm = _checked(1, strict=False)
    counter = HostSyncCounter(tracker)
    with tracker, counter:
        checked = _train(twin, comm)
    assert all(torch.equal(plain[k], checked[k]) for k in plain)
