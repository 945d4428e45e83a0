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
from zero3.hooks._shard import (
    ShardedModule,
    memory_stats,
    set_leaf_modules,
    shard_module,
    stats,
    unshard_module,
)

__all__ = [
    "LoadResult",
    "ShardedModule",
    "empty_init",
    "full_state_dict",
    "load_full_state_dict",
    "memory_stats",
    "set_leaf_modules",
    "shard_module",
    "stats",
    "unshard_module",
]
