"""zero3.core: configuration, partitioned parameters, the prefetch coordinator, gradient
buckets, and the state dicts and checkpoint format of sharded models.

Core knows nothing about module hooks (``zero3.hooks``) or optimizers
(``zero3.optim``); both drive it through :class:`ShardedModelState`.
"""

from zero3.core._api import (
    full_grad,
    gathered_parameters,
    local_grad,
    register_external_parameter,
    sharded_param,
)
from zero3.core._buckets import GradBucket
from zero3.core._checkpoint_dist import checkpoint_group, raise_on_every_rank
from zero3.core._checkpoint_format import (
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_LAYOUT,
    CheckpointError,
    CheckpointLayout,
    CheckpointLoadPlanner,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageReader,
    CheckpointStorageWriter,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    check_checkpoint_dir,
    quiet_dcp_warnings,
)
from zero3.core._checkpoint_reader import CheckpointReader
from zero3.core._config import Zero3Config
from zero3.core._coordinator import ParamCoordinator
from zero3.core._empty import empty_init
from zero3.core._full_state_dict import LoadResult, full_state_dict, load_full_state_dict
from zero3.core._gather import FingerprintMismatchError
from zero3.core._guard import OpKind
from zero3.core._leaves import LeafTarget, ModulePath, match_leaf_modules
from zero3.core._memory import (
    MemoryStats,
    ModelStatesEstimate,
    estimate_model_states,
    memory_stats,
    peak_rss_bytes,
)
from zero3.core._params import ParamStatus, ShardedParam, local_shard
from zero3.core._pool import BufferPool
from zero3.core._reduce_paths import (
    AllReducePath,
    DiscretePath,
    ReducePath,
    ReduceScatterPath,
    Reduction,
)
from zero3.core._reducer import GradReducer
from zero3.core._sharded_state_dict import (
    clone_state_dict,
    flat_boxes,
    load_sharded_state_dict,
    local_flat,
    sharded_like,
    sharded_state_dict,
)
from zero3.core._sources import SafetensorsSource, WeightSource, open_weight_source
from zero3.core._state import (
    ShardedModelState,
    mark_leaf,
    sharded_state,
    try_sharded_state,
)
from zero3.core._stats import StepStats
from zero3.core._trace import TraceState
from zero3.core._tracer import Tracer

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "CHECKPOINT_LAYOUT",
    "AllReducePath",
    "BufferPool",
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointLoadPlanner",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointStorageReader",
    "CheckpointStorageWriter",
    "CheckpointVersionError",
    "CorruptCheckpointError",
    "DiscretePath",
    "FingerprintMismatchError",
    "GradBucket",
    "GradReducer",
    "IncompleteCheckpointError",
    "LeafTarget",
    "LoadResult",
    "MemoryStats",
    "ModelStatesEstimate",
    "ModulePath",
    "OpKind",
    "ParamCoordinator",
    "ParamStatus",
    "ReducePath",
    "ReduceScatterPath",
    "Reduction",
    "SafetensorsSource",
    "ShardedModelState",
    "ShardedParam",
    "StepStats",
    "TraceState",
    "Tracer",
    "WeightSource",
    "Zero3Config",
    "check_checkpoint_dir",
    "checkpoint_group",
    "clone_state_dict",
    "empty_init",
    "estimate_model_states",
    "flat_boxes",
    "full_grad",
    "full_state_dict",
    "gathered_parameters",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "local_flat",
    "local_grad",
    "local_shard",
    "mark_leaf",
    "match_leaf_modules",
    "memory_stats",
    "open_weight_source",
    "peak_rss_bytes",
    "quiet_dcp_warnings",
    "raise_on_every_rank",
    "register_external_parameter",
    "sharded_like",
    "sharded_param",
    "sharded_state",
    "sharded_state_dict",
    "try_sharded_state",
]
