"""TrainingStep: the one owner of a sharded model's step.

A step opens when the outermost forward starts and ends either with that forward (an
inference step, or a training forward whose outputs need no backward) or with the
epilogue of the backward that follows. Between steps the gradient accumulation window
stays open across backward passes until the optimizer steps or gradients are cleared.
:class:`TrainingStep` decides all of that; the coordinator (gathers), the reducer
(gradient collectives) and :class:`~zero3.core.model._sync.ModelSync` (edits, buffers)
do the collectives. ``zero3.hooks`` calls its forward and backward methods,
``zero3.optim`` and ``zero3.hooks.ShardedModule.zero_grad`` end the window; nothing
else writes its fields.

Note (end of backward without a user call):
    The epilogue is queued on the autograd engine as a final callback of the graph task
    running when the first hook of a backward fires. Reentrant activation checkpointing
    runs nested graph tasks whose callbacks run when *they* end, mid-way through the
    outer backward (:ref:`fact-reentrant-callbacks`), so one callback is queued per task
    and only the last one to run — the outermost task's — runs the epilogue.

Note (counts):
    A module's pending-backward count goes up once per forward call whose outputs require
    grad with grad enabled and is reset by the epilogue, so outputs left out of the loss
    leak nothing. Its release in backward waits until every backward pass that entered
    it has reached its inputs: a module run three times gathers and releases three times,
    and a checkpoint recomputation (whose nodes never run backward) cannot hold a release
    back.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.autograd.variable import Variable

from zero3.core.diag._guard import Moment, Phase, waiting_for
from zero3.core.diag._stats import StatsBook
from zero3.core.grads._reducer import GradReducer
from zero3.core.model._sync import ModelSync
from zero3.core.params._coordinator import ParamCoordinator
from zero3.core.params._params import ShardedParam, raw_grad, set_raw_grad

__all__ = ["TrainingStep", "in_backward"]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return bool(torch._C._current_graph_task_id() != -1)


class TrainingStep:
    """When a sharded model's step opens and ends, its backward bookkeeping, the
    gradient accumulation window and the epilogue (see the module docstring).

    Args:
        modules: Every module as ``(qualified_name, module)``, in ``named_modules()`` order.
        params: Every sharded parameter.
        coordinator: Gathers and releases parameters.
        reducer: Reduces gradients.
        sync: Merges edits and buffers at the end of inference steps.
        stats: The step counters (rotated when a step opens).
    """

    def __init__(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        params: Sequence[ShardedParam],
        coordinator: ParamCoordinator,
        reducer: GradReducer,
        sync: ModelSync,
        stats: StatsBook,
    ) -> None:
        self._modules = modules
        self._params = params
        self._coordinator = coordinator
        self._reducer = reducer
        self._sync = sync
        self._stats = stats
        self._number = 0  # steps begun (every rank begins the same steps)
        self._open = False
        self._training = True
        self._micro_steps = 0  # backward passes in the accumulation window
        self._stack: list[int] = []  # modules whose forward is running, outermost first
        self._pending: dict[int, int] = {}  # forward calls whose backward has not run
        self._passes: dict[int, int] = {}  # backward passes that entered a module
        self._tasks: list[int] = []  # graph tasks with an epilogue queued, outermost first
        self._unsharded = False  # inside zero3.hooks.unsharded: steps follow its own trace
        # Module forwards awaiting backward when this step's backward began (None: not yet),
        # and whether the listeners were called at its half.
        self._backward_total: int | None = None
        self._backward_half_seen = False
        # Called when a step's backward is half done (optimizer offload reads the first
        # sub-groups' state then: it overlaps the rest of the backward, and by then half
        # the activations are freed, so the read buffers do not add to the step's peak);
        # weak, so a listener's owner (an optimizer) is not kept alive by the model.
        self._backward_listeners: list[weakref.WeakMethod[Callable[[], None]]] = []

    # -- what the rest of zero3 reads ----------------------------------------------------

    @property
    def number(self) -> int:
        """Steps begun so far."""
        return self._number

    @property
    def is_open(self) -> bool:
        """Whether a step is in progress."""
        return self._open

    @property
    def micro_steps(self) -> int:
        """Backward passes so far in the current gradient accumulation window."""
        return self._micro_steps

    @property
    def pending_backwards(self) -> int:
        """Forward calls whose outputs await a backward in this step."""
        return sum(self._pending.values())

    @property
    def busy(self) -> bool:
        """A step is open or gradients are accumulating (no re-planning now)."""
        return self._open or self._micro_steps > 0

    @property
    def unsharded(self) -> bool:
        """Whether a ``zero3.hooks.unsharded`` block is open on the model."""
        return self._unsharded

    def running(self) -> int | None:
        """The module whose forward runs now (innermost), or None."""
        return self._stack[-1] if self._stack else None

    def caller(self) -> int | None:
        """The module that called the running one, or None at the root."""
        return self._stack[-2] if len(self._stack) > 1 else None

    def moment(self, *, forward: bool = True) -> Moment:
        """The step and phase a collective issued now belongs to."""
        if not self._open:
            return Moment(self._number, Phase.BETWEEN)
        if not forward:
            return Moment(self._number, Phase.BACKWARD)
        return Moment(self._number, Phase.TRAIN_FORWARD if self._training else Phase.INFER_FORWARD)

    # -- forward (zero3.hooks) ------------------------------------------------------------

    def enter_forward(self, index: int) -> list[ShardedParam]:
        """A module's forward starts: gather its parameters (opening a step first if this
        is the outermost forward). Returns the parameters unfrozen since the last step:
        their gradients are reduced from now on and they need gradient hooks.
        """
        backward = in_backward()
        if index == 0 and self._stack and not backward:
            self._unwind()  # a previous forward raised: its modules never exited
        unfrozen: list[ShardedParam] = []
        if not self._stack and not backward:
            if torch.is_grad_enabled():
                unfrozen = self._follow_trainable()
            self._open_if_closed()
        self._fetch(index, forward=not backward)
        self._stack.append(index)
        return unfrozen

    def exit_forward(self, index: int, *, backward_follows: bool) -> None:
        """The running module's forward ended: release what is not reused soon. With
        ``backward_follows`` its outputs carry the pre-backward hook. The step ends with
        the outermost forward unless a backward will follow.
        """
        self._coordinator.release_sub_module(
            self._modules[index][1], backward_follows=backward_follows and self._training
        )
        self._stack.pop()
        if backward_follows:
            self._pending[index] = self._pending.get(index, 0) + 1
        if not self._stack and not in_backward():
            self._end_forward()

    def use_external(self, index: int, sp: ShardedParam) -> None:
        """Module ``index`` reads ``sp``, which it does not own: from now on ``sp`` is
        gathered with it, and it is gathered (and held under the module) at once.
        """
        if self._coordinator.add_external(index, sp):
            self._coordinator.fetch_params([sp], index, self.moment(forward=not in_backward()))

    def hold_for_step(self, sp: ShardedParam) -> None:
        """The root module returned ``sp``: keep it whole until the step ends."""
        if not sp.persistent:
            sp.holds += 1

    # -- backward (zero3.hooks) -----------------------------------------------------------

    def on_backward(self, listener: Callable[[], None]) -> None:
        """Call the bound method ``listener`` when each step's backward is half done: half
        of the module forwards that awaited a backward when it began have had theirs.
        Held weakly: it stops with its object.
        """
        self._backward_listeners.append(weakref.WeakMethod(listener))

    def _backward_progress(self) -> None:
        if self._backward_half_seen or self._backward_total is None:
            return
        if 2 * self.pending_backwards > self._backward_total:
            return
        self._backward_half_seen = True
        alive = []
        for ref in self._backward_listeners:
            listener = ref()
            if listener is not None:
                alive.append(ref)
                listener()
        self._backward_listeners = alive

    def pre_backward(self, index: int) -> None:
        """Gradients reached the module's outputs: gather its parameters."""
        self._queue_epilogue()
        if self._backward_total is None and self._backward_listeners:
            self._backward_total = self.pending_backwards
        count = self._pending.get(index, 0)
        if count > 0:
            self._pending[index] = count - 1
        self._backward_progress()
        self._passes[index] = self._passes.get(index, 0) + 1
        self._fetch(index, forward=False)

    def post_backward(self, index: int) -> bool:
        """Gradients reached the module's inputs: release it once every backward pass
        that entered it is done (returns whether it was released now), and reduce a
        leaf's buckets.
        """
        self._queue_epilogue()
        remaining = self._passes.get(index, 0) - 1
        if remaining > 0:
            self._passes[index] = remaining
            return False
        self._passes.pop(index, None)
        self._coordinator.release_sub_module(self._modules[index][1])
        if self._coordinator.is_leaf(index):
            self._reducer.leaf_done(index)
        return True

    def on_grad(self, sp: ShardedParam) -> None:
        """``sp``'s gradient was accumulated: zero3 takes it (``param.grad`` goes back to
        None) and reduces it.
        """
        self._queue_epilogue()
        grad = raw_grad(sp.param)
        if grad is not None:
            set_raw_grad(sp.param, None)
            self._reducer.on_grad(sp, grad)

    # -- the accumulation window (zero3.optim, ShardedModule.zero_grad) --------------------

    def end_window(self, *, clear: bool = False) -> None:
        """End the gradient accumulation window (an optimizer step or a ``zero_grad``);
        ``clear``: gradients were cleared (``zero_grad``), so ``param.grad`` reads None
        again (after an optimizer step plain PyTorch still holds them: reading raises).
        """
        self._micro_steps = 0
        self._reducer.end_window(clear=clear)

    def holds_grad(self, sp: ShardedParam) -> bool:
        """Whether plain PyTorch would hold a gradient of ``sp`` now (``param.grad``)."""
        return self._reducer.holds_grad(sp)

    def zero_grad_from(self, module: nn.Module) -> bool:
        """``module.zero_grad()`` runs on a module that may wrap the sharded model (a
        ``peft.PeftModel``): if it holds the whole model, end the window and clear, as
        ``ShardedModule.zero_grad`` does (``zero3.core.params._params``, Note "zero_grad
        of a module wrapping the sharded one"). Returns whether it did.
        """
        root = self._modules[0][1]
        if not any(m is root for m in module.modules()):
            return False
        self.end_window(clear=True)
        return True

    def close(self) -> None:
        """End an open step now (the model is being unsharded)."""
        if self._open:
            self._close()

    # -- zero3.hooks.unsharded ----------------------------------------------------------

    def enter_unsharded(self) -> None:
        """An ``unsharded`` block opens: the steps inside it (forwards of modules whose
        hooks stay) follow a trace of their own, so no training or inference trace
        learns their module order.

        Raises:
            RuntimeError: A block is open already, or a step is: a forward runs, or a
                training forward's backward has not run yet.
        """
        if self._unsharded:
            raise RuntimeError(
                "zero3.hooks.unsharded: the model is inside an unsharded() block already; "
                "blocks do not nest (the outer one keeps its parameters gathered)"
            )
        if self._open or self._stack:
            raise RuntimeError(
                "zero3.hooks.unsharded: a step of the model is in progress (a forward is "
                "running, or the backward of a training forward has not run yet). Enter "
                "unsharded() between steps: after backward, or before the next forward"
            )
        self._unsharded = True

    def exit_unsharded(self) -> None:
        """The ``unsharded`` block ends: a step it left open (a forward that raised) is
        closed, so the next step opens afresh on its own trace.
        """
        self._unsharded = False
        if self._open and not in_backward():
            self._close()
        self._stack.clear()

    # -- inside -----------------------------------------------------------------------------

    def _open_if_closed(self) -> None:
        # Grad mode picks the kind: a training step (its trace spans the backward that
        # follows) or an inference step (forward only).
        if not self._open:
            self._open = True
            self._number += 1
            self._training = torch.is_grad_enabled()
            self._backward_total, self._backward_half_seen = None, False
            self._coordinator.begin_pass(self._training, "unsharded" if self._unsharded else None)
            self._stats.rotate()

    def _close(self) -> None:
        self._coordinator.end_pass(self._params)
        self._open = False

    def _fetch(self, index: int, *, forward: bool) -> None:
        # A backward that runs after its step was closed (a second backward through a
        # retained graph) opens a step of its own.
        self._open_if_closed()
        self._coordinator.fetch_sub_module(self._modules[index][1], self.moment(forward=forward))

    def _unwind(self) -> None:
        for stale in reversed(self._stack):
            self._coordinator.release_sub_module(self._modules[stale][1])
        self._stack.clear()

    def _end_forward(self) -> None:
        if self._open and (not self._training or not any(self._pending.values())):
            self._close()
            self._sync.synchronize(self._number)

    def _follow_trainable(self) -> list[ShardedParam]:
        """Re-plan gradient buckets if parameters were frozen or unfrozen since the last
        step; returns the parameters that became trainable.
        """
        trainable = [sp for sp in self._params if sp.requires_grad]
        planned = self._reducer.params
        if [sp.index for sp in trainable] == [sp.index for sp in planned]:
            return []
        if self._micro_steps:
            changed = sorted({sp.name for sp in trainable} ^ {sp.name for sp in planned})
            raise RuntimeError(
                f"zero3: requires_grad changed for {changed[:5]} in the middle of a gradient "
                "accumulation window; freeze or unfreeze parameters between optimizer steps"
            )
        known = {sp.index for sp in planned}
        self._reducer.replace_params(trainable, self._coordinator.leaf_of())
        return [sp for sp in trainable if sp.index not in known]

    def _queue_epilogue(self) -> None:
        task = int(torch._C._current_graph_task_id())
        if task == -1 or task in self._tasks:
            return
        if not self._tasks:
            self._reducer.begin_backward(accumulate=self._micro_steps > 0)
            self._coordinator.begin_backward()  # the turn: forward's cached buffers go
        self._tasks.append(task)
        Variable._execution_engine.queue_callback(functools.partial(self._task_done, task))

    def _task_done(self, task: int) -> None:
        self._tasks.remove(task)
        if not self._tasks:  # else an inner (reentrant checkpoint) backward ended
            self._epilogue()

    def _epilogue(self) -> None:
        """End of backward: reduce what is left, release everything, end the step."""
        tracer = self._coordinator.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        rank, number = self._reducer.comm.rank, self._number
        try:
            with waiting_for(
                lambda: f"rank {rank} timed out reducing gradients at the end of step {number}",
                rank=rank,
                during=lambda: f"the gradient reduction at the end of backward (step {number})",
            ):
                self._reducer.end_backward()
            self._micro_steps += 1
            if self._open:
                self._close()
        finally:
            self._pending.clear()
            self._passes.clear()
            self._stack.clear()
        if tracer is not None:
            tracer.complete("epilogue", "backward", start, tracer.now_us())
