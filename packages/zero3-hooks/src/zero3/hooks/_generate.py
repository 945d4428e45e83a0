"""``generate()`` on a sharded model: every rank in step, at the unsharded model's speed.

Note (why the model class, not transformers' flags):
    transformers syncs ranks in ``generate`` only under DeepSpeed ZeRO-3 or for a model
    flagged ``_is_fsdp_managed_module``, on torch's default group (which the mpi and
    cupy-nccl backends lack). The class zero3 swaps in mixes in
    :class:`ShardedGeneration` when it generates (duck-typed), which turns the sync on
    over zero3's comm; docs/generation.rst, "How generate runs".

Note (votes):
    Where forwards gather (a block that keeps only part of the model), a rank that is
    done must keep running them with its peers, so the ranks vote after each token
    (``ShardedModelState.votes``). In a block that keeps every parameter,
    forwards issue no collective: each rank stops alone and they meet at its exit.
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
    """The bytes ``generate`` keeps gathered: the model's resolved gather window
    (``min(reuse, live)`` elements of :attr:`ShardedModelState.window`, what a training
    step may keep gathered already), or None (all) when the whole model fits in it.
    """
    window = state.window
    numel = min(window.reuse_numel, window.live_numel)
    if window.sharded_numel <= numel:
        return None
    return numel * window.element_size


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
        state.votes.settle()  # nothing of zero3's left in flight
        return out

    def _has_unfinished_sequences(
        self, this_peer_finished: bool, synced_gpus: bool, device: Any
    ) -> bool:
        """Transformers' stopping rule, with the ranks' vote cast through zero3's comm;
        no vote while every parameter is kept gathered (the module Note "votes").
        """
        state = try_sharded_state(self)  # type: ignore[arg-type]
        if state is None or state.comm.world_size == 1 or not synced_gpus:
            parent: Any = super()
            return bool(parent._has_unfinished_sequences(this_peer_finished, synced_gpus, device))
        plan = state.unsharded_plan
        if plan is not None and plan.complete:
            return not this_peer_finished  # forwards issue no collective: each rank stops alone
        return not state.votes.all_finished(bool(this_peer_finished))


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
