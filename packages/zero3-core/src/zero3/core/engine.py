"""The engine contract: what zero3's own packages and plugin authors build on.

``zero3.hooks`` (module hooks, ``shard_module``), ``zero3.optim`` (the partitioned
optimizer, checkpoints) and ``zero3.hf`` drive a sharded model through the names here:
its :class:`ShardedModelState` and the :class:`TrainingStep` that owns each step, the
per-parameter records, the checkpoint format's pieces and the reduction strategies a
custom :class:`ReducePath` plugs into. Users call :mod:`zero3.core` instead.

This contract is for zero3's own packages and plugin authors; it may change between
minor versions.
"""

from zero3.core._api import sharded_param
from zero3.core.config._config import is_persistent
from zero3.core.config._leaves import LeafTarget, match_leaf_modules
from zero3.core.config._window import GatherWindow, resolve_window
from zero3.core.construct._empty import empty_init
from zero3.core.construct._sources import open_weight_source
from zero3.core.diag._guard import Moment, OpKind, Phase
from zero3.core.diag._tracer import Tracer
from zero3.core.files._format import (
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_LAYOUT,
    CheckpointLayout,
    CheckpointLoadPlanner,
    CheckpointSavePlanner,
    CheckpointStorageReader,
    CheckpointStorageWriter,
    DeferredTensor,
    check_checkpoint_dir,
    clone_state_dict,
    quiet_dcp_warnings,
)
from zero3.core.files._ranks import raise_on_every_rank
from zero3.core.files._reader import CheckpointReader
from zero3.core.files._snapshot import DiskSnapshot, SnapshotEntry
from zero3.core.files._swap import (
    AlignedBuffer,
    IOPool,
    SwapError,
    SwapFile,
    check_free_space,
    make_swap_dir,
    resident_pages,
    round_up,
)
from zero3.core.grads._buckets import GradBucket
from zero3.core.grads._reduce_paths import (
    AllReducePath,
    DiscretePath,
    ReducePath,
    ReduceScatterPath,
    Reduction,
)
from zero3.core.model._device_copies import DeviceCopyStats
from zero3.core.model._host_shards import HostShards
from zero3.core.model._param_offload import (
    ParamSwap,
    ParamSwapStats,
    PlannedShard,
    raise_if_any_rank_failed,
)
from zero3.core.model._state import (
    ShardedModelState,
    mark_leaf,
    sharded_state,
    try_sharded_state,
)
from zero3.core.model._step import TrainingStep, in_backward
from zero3.core.model._unshard import UnshardedPlan
from zero3.core.params._coordinator import STREAMED
from zero3.core.params._params import ParamStatus, ShardedParam
from zero3.core.params._pool import BufferPool
from zero3.core.params._trace import TraceState
from zero3.core.state_dict._full import full_state_dict, load_full_state_dict
from zero3.core.state_dict._groups import checkpoint_group
from zero3.core.state_dict._sharded import (
    OffloadedShard,
    finish_module_state_dict,
    load_module_entry,
    local_flat,
    sharded_like,
    streamed_sharded_state_dict,
)

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "CHECKPOINT_LAYOUT",
    "STREAMED",
    "AlignedBuffer",
    "AllReducePath",
    "BufferPool",
    "CheckpointLayout",
    "CheckpointLoadPlanner",
    "CheckpointReader",
    "CheckpointSavePlanner",
    "CheckpointStorageReader",
    "CheckpointStorageWriter",
    "DeferredTensor",
    "DeviceCopyStats",
    "DiscretePath",
    "DiskSnapshot",
    "GatherWindow",
    "GradBucket",
    "HostShards",
    "IOPool",
    "LeafTarget",
    "Moment",
    "OffloadedShard",
    "OpKind",
    "ParamStatus",
    "ParamSwap",
    "ParamSwapStats",
    "Phase",
    "PlannedShard",
    "ReducePath",
    "ReduceScatterPath",
    "Reduction",
    "ShardedModelState",
    "ShardedParam",
    "SnapshotEntry",
    "SwapError",
    "SwapFile",
    "TraceState",
    "Tracer",
    "TrainingStep",
    "UnshardedPlan",
    "check_checkpoint_dir",
    "check_free_space",
    "checkpoint_group",
    "clone_state_dict",
    "empty_init",
    "finish_module_state_dict",
    "full_state_dict",
    "in_backward",
    "is_persistent",
    "load_full_state_dict",
    "load_module_entry",
    "local_flat",
    "make_swap_dir",
    "mark_leaf",
    "match_leaf_modules",
    "open_weight_source",
    "quiet_dcp_warnings",
    "raise_if_any_rank_failed",
    "raise_on_every_rank",
    "resident_pages",
    "resolve_window",
    "round_up",
    "sharded_like",
    "sharded_param",
    "sharded_state",
    "streamed_sharded_state_dict",
    "try_sharded_state",
]
