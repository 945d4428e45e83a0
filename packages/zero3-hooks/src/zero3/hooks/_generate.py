"""``generate()`` on a sharded model: every rank in step, at the unsharded model's speed.

Note (why the model class, not transformers' flags):
    transformers 5.x syncs ranks during ``generate`` (``synced_gpus``) only under
    DeepSpeed ZeRO-3 or for a model flagged ``_is_fsdp_managed_module`` (a flag that
    changes other code paths of transformers too), and its sync is an all-reduce on
    torch's default process group, which the mpi and cupy-nccl backends do not have
    (docs/facts.rst, "Generation"). A sharded model's forward is a collective, so a rank
    that stops before the others would leave them waiting in a gather. zero3 swaps the
    class of a sharded module anyway (:class:`~zero3.hooks.ShardedModule`); for a class
    that generates (it has transformers' ``generate`` and ``_has_unfinished_sequences``,
    found by duck typing: zero3.hooks does not import transformers) the swapped-in class
    also mixes in :class:`ShardedGeneration`, which turns the sync on and casts its
    vote through zero3's own comm (:meth:`ShardedModelState.all_finished
    <zero3.core.engine.ShardedModelState.all_finished>`). A rank that finished keeps
    running forwards without adding tokens (transformers' own ``synced_gpus`` loop), so
    its output equals plain ``generate``'s.

Note (why generate opens an unsharded block):
    A decoding step is a forward of one token; gathering and releasing every module for
    each token costs 7-8x the unsharded model's time on small models (measured, issue
    26). Inside :func:`~zero3.hooks.unsharded` the kept parameters are gathered once per
    ``generate`` and their modules run without hooks. The block keeps what the reuse
    window allows (``min(max_reuse_distance, max_live_parameters)`` elements, the bound
    a training step already keeps gathered) and gathers the rest per use, so a model
    larger than its window is never whole on a rank; everything goes back to the shards
    when ``generate`` returns, with no collective left pending.
"""

from __future__ import annotations

import logging
from typing import Any

from zero3.core.engine import ShardedModelState, try_sharded_state
from zero3.hooks._module import ShardedModule
from zero3.hooks._unsharded import unsharded

__all__ = ["ShardedGeneration", "generates", "window_bytes"]

_log = logging.getLogger("zero3.hooks")
_SYNCED_GPUS_POSITION = 5  # generate(inputs, generation_config, ..., synced_gpus, ...)


def generates(cls: type) -> bool:
    """Whether instances of ``cls`` generate like transformers' ``GenerationMixin``."""
    return callable(getattr(cls, "generate", None)) and callable(
        getattr(cls, "_has_unfinished_sequences", None)
    )


def window_bytes(state: ShardedModelState) -> int | None:
    """The bytes ``generate`` keeps gathered: the reuse window, or None (all) when the
    whole model fits in it.
    """
    config = state.config
    numel = min(config.max_reuse_distance, config.max_live_parameters)
    sharded = [sp for sp in state.params if not sp.persistent]
    if sum(sp.numel for sp in sharded) <= numel:
        return None
    return numel * max(sp.shard.element_size() for sp in sharded)


class ShardedGeneration(ShardedModule):
    """What a sharded model that generates adds to :class:`~zero3.hooks.ShardedModule`:
    ``generate`` syncs every rank through zero3's comm (no ``synced_gpus`` argument
    needed, as under DeepSpeed ZeRO-3) and runs inside :func:`~zero3.hooks.unsharded`
    (see the module Notes).
    """

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Transformers' ``generate``, every rank in step (a collective at world > 1).

        ``synced_gpus`` is always on at world > 1 (an explicit False, as
        ``Seq2SeqTrainer`` passes for a model it does not know is sharded, would leave
        ranks that finish early out of the others' gathers). Outside an
        :func:`~zero3.hooks.unsharded` block it opens one bounded by the reuse window.
        """
        state = try_sharded_state(self)  # type: ignore[arg-type]
        parent: Any = super()
        if state is None:
            return parent.generate(*args, **kwargs)
        if state.comm.world_size > 1:
            args, kwargs = _synced(args, kwargs)
        if state.step.unsharded:
            out = parent.generate(*args, **kwargs)
        else:
            with unsharded(self, max_bytes=window_bytes(state)):  # type: ignore[arg-type]
                out = parent.generate(*args, **kwargs)
        state.settle_votes()  # nothing of zero3's left in flight
        return out

    def _has_unfinished_sequences(
        self, this_peer_finished: bool, synced_gpus: bool, device: Any
    ) -> bool:
        """Transformers' stopping rule, with the ranks' vote cast through zero3's comm."""
        state = try_sharded_state(self)  # type: ignore[arg-type]
        if state is None or state.comm.world_size == 1 or not synced_gpus:
            parent: Any = super()
            return bool(parent._has_unfinished_sequences(this_peer_finished, synced_gpus, device))
        return not state.all_finished(bool(this_peer_finished))


def _synced(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``generate``'s arguments with ``synced_gpus=True``."""
    if len(args) > _SYNCED_GPUS_POSITION:
        given = args[_SYNCED_GPUS_POSITION]
        args = (*args[:_SYNCED_GPUS_POSITION], True, *args[_SYNCED_GPUS_POSITION + 1 :])
    else:
        given = kwargs.get("synced_gpus")
        kwargs = {**kwargs, "synced_gpus": True}
    if given is False:
        _log.debug("zero3: generate(synced_gpus=False) on a sharded model runs synced")
    return args, kwargs
