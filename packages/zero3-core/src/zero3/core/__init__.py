"""zero3.core: configuration, partitioned parameters, the prefetch coordinator and
gradient buckets.

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
from zero3.core._config import Zero3Config
from zero3.core._coordinator import ParamCoordinator
from zero3.core._gather import FingerprintMismatchError
from zero3.core._guard import OpKind
from zero3.core._leaves import LeafTarget, ModulePath, match_leaf_modules
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
    "AllReducePath",
    "BufferPool",
    "DiscretePath",
    "FingerprintMismatchError",
    "GradBucket",
    "GradReducer",
    "LeafTarget",
    "ModulePath",
    "OpKind",
    "ParamCoordinator",
    "ParamStatus",
    "ReducePath",
    "ReduceScatterPath",
    "Reduction",
    "ShardedModelState",
    "ShardedParam",
    "StepStats",
    "TraceState",
    "Tracer",
    "Zero3Config",
    "full_grad",
    "gathered_parameters",
    "local_grad",
    "local_shard",
    "mark_leaf",
    "match_leaf_modules",
    "register_external_parameter",
    "sharded_param",
    "sharded_state",
    "try_sharded_state",
]
