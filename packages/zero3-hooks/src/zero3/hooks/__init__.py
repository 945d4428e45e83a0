"""zero3.hooks: module hooks and ``shard_module`` — sharded forward and backward.

Installing zero3-comm, zero3-core and zero3-hooks is enough for sharded inference::

    from zero3.core import Zero3Config
    from zero3.hooks import shard_module

    model = shard_module(model, Zero3Config(backend="gloo"))
    with torch.no_grad():
        logits = model(tokens)
"""

from zero3.core import LoadResult
from zero3.core.engine import empty_init, full_state_dict, load_full_state_dict
from zero3.hooks._generate import ShardedGeneration
from zero3.hooks._module import ShardedModule
from zero3.hooks._shard import (
    memory_stats,
    set_leaf_modules,
    shard_module,
    stats,
    unshard_module,
)
from zero3.hooks._stream import iter_full_parameters
from zero3.hooks._unsharded import unsharded

__all__ = [
    "LoadResult",
    "ShardedGeneration",
    "ShardedModule",
    "empty_init",
    "full_state_dict",
    "iter_full_parameters",
    "load_full_state_dict",
    "memory_stats",
    "set_leaf_modules",
    "shard_module",
    "stats",
    "unshard_module",
    "unsharded",
]
