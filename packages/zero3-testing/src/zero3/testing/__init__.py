"""zero3.testing: the pooled multi-rank test harness, shared test models and instruments.

A development-only package: installed in the workspace so that spawned workers can
import the harness and the models (pytest's importlib mode makes test modules
unimportable there). The instruments make accelerator rules checkable on CPU:
:class:`DeviceTracker` (where tensors would live, which stream wrote them),
:class:`CheckingBackend` (a CPU backend that rejects what nccl/hccl would) and
:class:`HostSyncCounter` (host synchronizations per step).
"""

from zero3.testing._checking import (
    CheckedWork,
    CheckingBackend,
    DeviceDisciplineError,
    StreamOrderError,
    TensorRecord,
)
from zero3.testing._harness import CaseError, GroupPool, RankExited, WorkerGroup
from zero3.testing._session import run_in_session
from zero3.testing._syncs import SYNC_KINDS, DeviceMemory, HostSync, HostSyncCounter, RealDevice
from zero3.testing._tracker import (
    HOST_MEMORY,
    MIXED_DEVICES,
    STREAM_ORDER,
    DeviceTracker,
    RecordingEvent,
    RecordingStream,
    Residence,
    Violation,
)

__all__ = [
    "HOST_MEMORY",
    "MIXED_DEVICES",
    "STREAM_ORDER",
    "SYNC_KINDS",
    "CaseError",
    "CheckedWork",
    "CheckingBackend",
    "DeviceDisciplineError",
    "DeviceMemory",
    "DeviceTracker",
    "GroupPool",
    "HostSync",
    "HostSyncCounter",
    "RankExited",
    "RealDevice",
    "RecordingEvent",
    "RecordingStream",
    "Residence",
    "StreamOrderError",
    "TensorRecord",
    "Violation",
    "WorkerGroup",
    "run_in_session",
]
