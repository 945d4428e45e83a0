"""zero3.core: what a user of a sharded model calls directly.

Configuration (:class:`Zero3Config`), gathering parameters outside forward
(:func:`gathered_parameters`), external parameters, gradient shards, sharded state
dicts, step counters, memory records and estimators, and the errors zero3 raises.

zero3's own packages (``zero3.hooks``, ``zero3.optim``, ``zero3.hf``) and plugin authors
drive the engine through :mod:`zero3.core.engine`, a separate contract that may change
between minor versions.
"""

from zero3.core._api import (
    full_grad,
    gathered_parameters,
    local_grad,
    memory_stats,
    register_external_parameter,
)
from zero3.core.config._config import Zero3Config
from zero3.core.config._leaves import ModulePath
from zero3.core.config._offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from zero3.core.construct._sources import SafetensorsSource, WeightSource
from zero3.core.diag._guard import FingerprintMismatchError
from zero3.core.diag._memory import (
    MemoryStats,
    ModelStatesEstimate,
    estimate_model_states,
    peak_rss_bytes,
)
from zero3.core.diag._stats import StepStats
from zero3.core.files._format import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from zero3.core.params._params import ParamOffloadError, local_shard
from zero3.core.state_dict._full import LoadResult
from zero3.core.state_dict._sharded import load_sharded_state_dict, sharded_state_dict

__all__ = [
    "AioConfig",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "CorruptCheckpointError",
    "FingerprintMismatchError",
    "IncompleteCheckpointError",
    "LoadResult",
    "MemoryStats",
    "ModelStatesEstimate",
    "ModulePath",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ParamOffloadError",
    "SafetensorsSource",
    "StepStats",
    "WeightSource",
    "Zero3Config",
    "estimate_model_states",
    "full_grad",
    "gathered_parameters",
    "load_sharded_state_dict",
    "local_grad",
    "local_shard",
    "memory_stats",
    "peak_rss_bytes",
    "register_external_parameter",
    "sharded_state_dict",
]
