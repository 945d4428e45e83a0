"""zero3.core: configuration, partitioned parameters, the prefetch coordinator and
gradient buckets.

Core knows nothing about module hooks (``zero3.hooks``) or optimizers
(``zero3.optim``); both drive it through :class:`ShardedModelState`.
"""

from zero3.core._api import full_grad, gathered_parameters, local_grad, register_external_parameter
from zero3.core._buckets import GradBucket
from zero3.core._config import Zero3Config
from zero3.core._coordinator import ParamCoordinator
from zero3.core._empty import empty_init
from zero3.core._gather import FingerprintMismatchError
from zero3.core._memory import (
    MemoryStats,
    ModelStatesEstimate,
    estimate_model_states,
    memory_stats,
)
from zero3.core._params import ParamStatus, ShardedParam, local_shard
from zero3.core._reducer import GradReducer
from zero3.core._sources import SafetensorsSource, WeightSource, open_weight_source
from zero3.core._state import ShardedModelState, sharded_state
from zero3.core._stats import StepStats
from zero3.core._trace import TraceState
from zero3.core._tracer import Tracer

__all__ = [
    "FingerprintMismatchError",
    "GradBucket",
    "GradReducer",
    "MemoryStats",
    "ModelStatesEstimate",
    "ParamCoordinator",
    "ParamStatus",
    "SafetensorsSource",
    "ShardedModelState",
    "ShardedParam",
    "StepStats",
    "TraceState",
    "Tracer",
    "WeightSource",
    "Zero3Config",
    "empty_init",
    "estimate_model_states",
    "full_grad",
    "gathered_parameters",
    "local_grad",
    "local_shard",
    "memory_stats",
    "open_weight_source",
    "register_external_parameter",
    "sharded_state",
]
