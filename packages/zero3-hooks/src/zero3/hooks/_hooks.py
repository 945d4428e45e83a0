"""The hooks of one sharded model: the four per module, grad hooks, the epilogue.

Note (end of backward without a user call):
    The epilogue (flush gradient buckets, exchange got-gradient flags, release every
    parameter, freeze the trace) is queued on the autograd engine as a final callback
    of the graph task that is running when the first hook of a backward fires.
    Reentrant activation checkpointing runs an inner backward (a nested graph task)
    whose final callbacks run when *it* ends, mid-way through the outer backward
    (torch 2.13: a callback queued inside the region runs before the outer backward
    reaches the region's inputs; docs/facts.rst). So a callback is queued per graph
    task, and only the last one to run — the outermost task, queued first — runs the
    epilogue.

Note (counts):
    A module's pre-backward count goes up once per forward call whose outputs require
    grad with grad enabled (never inside ``Function.apply``, which runs its forward
    under no_grad (docs/facts.rst), and never for eval forwards), and is reset by the
    epilogue so outputs left out of the loss leak nothing. A module's post-backward
    release waits until every backward pass that entered it (counted when its
    pre-backward fires) has reached its inputs: a module run three times gathers and
    releases three times in backward, and a checkpoint recomputation — whose nodes never
    run backward — cannot hold a release back.

Note (external parameters):
    Each module's ``_parameters`` dict is replaced by a :class:`ParamAccessDict` that
    reports reads. A read of a sharded parameter while a *different* module's forward
    runs (a parent using a child's weight) registers the parameter as external to the
    running module and gathers it at once; from then on it is gathered together with
    that module, in forward and backward. Parameters a module returns in its output
    ("dangling": a bias a child hands its caller to add) become external to the
    caller the same way.

    Cost, measured by ``tools/measure_tricks.py`` (torch 2.13, CPU, four runs): the
    dict adds 0.23-0.62 us to a ``self.weight`` read that costs 0.9-1.7 us with a plain
    dict, and the benchmark GPT (``tools/_bench/workload.py``) reads 102 parameters per
    forward+backward: 24-63 us of a ~4 s forward+backward, under 0.002%.

    Alternative considered: notice outside reads only through the released-parameter
    guard (``zero3.core``'s ``ReleasedParameter``), gathering on first touch instead of
    raising. A guard sees a read only when the parameter happens to be released at that
    moment, which depends on the schedule, not on the code. On the first step (the
    trace records; modules release on exit) ``ParentUsesChildWeight``'s read is seen.
    A read that first happens on a later step finds its parameter whole and is missed
    when it was kept by the reuse window (read after its owner ran), prefetched (read
    before its owner runs) or held by a running parent (a child reads its parent's
    weight). A missed parameter is not gathered for the reader's backward: for the
    prefetched case the measured backward raised torch's "setStorage ... out of
    bounds" (``F.linear``) or killed the process with SIGSEGV (an elementwise use).
    The dict sees every read, whatever the schedule.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.autograd.variable import Variable
from torch.utils.hooks import RemovableHandle

from zero3.core import ShardedModelState, ShardedParam, sharded_param
from zero3.hooks._functions import PostBackward, PreBackward
from zero3.hooks._tree import iter_tensors, map_tensors

__all__ = ["ModelHooks", "ParamAccessDict"]


_DOUBLE_BACKWARD_REFUSED = (
    "zero3: double backward (backward or torch.autograd.grad with create_graph=True, e.g. "
    "a gradient penalty) is not supported on a sharded model: zero3 frees each "
    "parameter's full data once its backward is done and reduces gradients into shards, "
    "so a graph of the gradient cannot be built. Compute such terms on an unsharded "
    "model (or a module left out of shard_module)."
)
_COMPILE_REFUSED = (
    "zero3: torch.compile of a sharded model is not supported: its forward hooks gather "
    "and release parameters, which Dynamo cannot trace. Run the sharded model eagerly "
    "(submodules compiled with torch.compile before shard_module still run compiled "
    "kernels inside it)."
)


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class ParamAccessDict(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` that tells the hooks when a parameter is read.

    Why every read runs Python, what it costs, and the alternative that misses reads:
    the module Note "external parameters".
    """

    __slots__ = ("hooks", "module_index")

    def __init__(self, original: dict[str, Any], hooks: ModelHooks, module_index: int) -> None:
        super().__init__(original)
        self.hooks = hooks
        self.module_index = module_index

    def __getitem__(self, key: str) -> Any:
        value = dict.__getitem__(self, key)
        if self.hooks.stack and value is not None:
            self.hooks.on_param_read(self.module_index, value)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        old = dict.get(self, key)
        if old is not None and old is not value and sharded_param(old) is not None:
            raise RuntimeError(
                f"parameter {key!r} of a sharded module cannot be replaced (or deleted); "
                "call zero3.hooks.unshard_module(model) first, change it, and shard again"
            )
        dict.__setitem__(self, key, value)


class ModelHooks:
    """Installs and runs every hook of one sharded model."""

    def __init__(self, state: ShardedModelState) -> None:
        self.state = state
        self.stack: list[int] = []  # indices of modules whose forward is running
        self.pre_counts: dict[int, int] = {}
        self.in_backward_passes: dict[int, int] = {}
        self._queued_tasks: list[int] = []
        self._handles: list[RemovableHandle] = []
        self._access_dicts: list[tuple[nn.Module, ParamAccessDict]] = []
        self._owned: dict[int, frozenset[int]] = {}
        self._grad_hooked: set[int] = set()
        self._span_starts: dict[tuple[str, int], list[float]] = {}

    # -- installation -------------------------------------------------------------------

    def install(self) -> None:
        """Register module, parameter and state-dict hooks."""
        for index, _, module in self.state.hooked_modules():
            self._handles.append(
                module.register_forward_pre_hook(
                    functools.partial(self._pre_forward, index), with_kwargs=True
                )
            )
            self._handles.append(
                module.register_forward_hook(
                    functools.partial(self._post_forward, index), with_kwargs=True
                )
            )
        for index, (_, module) in enumerate(self.state.modules):
            access = ParamAccessDict(module._parameters, self, index)
            object.__setattr__(module, "_parameters", access)
            self._access_dicts.append((module, access))
        for sp in self.state.params:
            if sp.param.requires_grad:
                self._hook_grad(sp)

    def _hook_grad(self, sp: ShardedParam) -> None:
        if sp.index in self._grad_hooked:
            return
        self._grad_hooked.add(sp.index)
        self._handles.append(
            sp.param.register_post_accumulate_grad_hook(functools.partial(self._on_grad, sp))
        )

    def remove(self) -> None:
        """Remove every hook and restore the modules' parameter dicts."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, access in self._access_dicts:
            object.__setattr__(module, "_parameters", dict(access))
        self._access_dicts.clear()

    def add_handle(self, handle: RemovableHandle) -> None:
        """Keep a handle removed together with the hooks (state-dict hooks)."""
        self._handles.append(handle)

    # -- forward --------------------------------------------------------------------------

    def _pre_forward(
        self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if index == 0 and self.stack and not _in_backward():
            self._unwind()  # a previous forward raised: its modules never exited
        if not self.stack and not _in_backward():
            self._start_forward()
        self._span_begin("fwd", index)
        self.state.fetch(module, forward=not _in_backward())
        self.stack.append(index)
        if not torch.is_grad_enabled():
            return None
        return self._wrap(PostBackward, index, (args, kwargs))  # type: ignore[no-any-return]

    def _unwind(self) -> None:
        for stale in reversed(self.stack):
            self.state.release(self.state.modules[stale][1])
        self.stack.clear()

    def _start_forward(self) -> None:
        """The outermost forward begins: open a step unless one awaits its backward.

        A training forward also picks up parameters unfrozen since the last step
        (progressive unfreezing): their gradients are reduced from now on.
        """
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILE_REFUSED)
        if torch.is_grad_enabled():
            for sp in self.state.refresh_trainable():
                self._hook_grad(sp)
        self.state.begin_forward()

    def _post_forward(
        self,
        index: int,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        if not self.stack or self.stack[-1] != index:
            return None  # the forward raised before our pre-hook ran
        self._adopt_dangling(index, output)
        self.state.release(module)
        self.stack.pop()
        self._span_end("fwd", index)
        if torch.is_grad_enabled() and any(t.requires_grad for t in iter_tensors(output)):
            self.pre_counts[index] = self.pre_counts.get(index, 0) + 1
            output = self._wrap(PreBackward, index, output)
        if not self.stack and not _in_backward():
            self._end_forward()
        return output

    def _end_forward(self) -> None:
        """The outermost forward ended: end the step if no backward will follow."""
        self.state.end_forward(backward_pending=any(self.pre_counts.values()))

    def _wrap(self, fn: type[torch.autograd.Function], index: int, obj: Any) -> Any:
        tensors = [t for t in iter_tensors(obj) if t.requires_grad]
        if not tensors:
            return obj
        outs = fn.apply(self, index, *tensors)
        replacement = {id(t): o for t, o in zip(tensors, outs, strict=True)}
        return map_tensors(obj, lambda t: replacement.get(id(t), t))

    def _adopt_dangling(self, index: int, output: Any) -> None:
        """Sharded parameters returned in ``output`` stay whole for the caller."""
        for tensor in iter_tensors(output):
            sp = sharded_param(tensor) if isinstance(tensor, nn.Parameter) else None
            if sp is None or sp.persistent:
                continue
            caller = self.stack[-2] if len(self.stack) > 1 else None
            if caller is None:
                self.state.hold_for_step(sp)  # the root returned it
            else:
                self._use_external(caller, sp)

    # -- external parameters -----------------------------------------------------------------

    def on_param_read(self, owner_index: int, param: Any) -> None:
        """A parameter was read while some module's forward runs."""
        running = self.stack[-1]
        if running == owner_index:
            return
        sp = sharded_param(param)
        if sp is None or sp.persistent:
            return
        owned = self._owned.get(running)
        if owned is None:
            owned = frozenset(p.index for p in self.state.fetch_set(running))
            self._owned[running] = owned
        if sp.index not in owned:
            self._use_external(running, sp)

    def _use_external(self, module_index: int, sp: ShardedParam) -> None:
        self._owned.pop(module_index, None)
        # Held under the running module: its release (which now includes sp) drops it.
        self.state.use_external(module_index, sp, forward=not _in_backward())

    # -- backward -----------------------------------------------------------------------------

    def pre_backward(self, module_index: int) -> None:
        """Gradients reached the module's outputs: gather its parameters."""
        if torch.is_grad_enabled():  # backward runs with grad enabled only for create_graph
            raise RuntimeError(_DOUBLE_BACKWARD_REFUSED)
        self._queue_epilogue()
        count = self.pre_counts.get(module_index, 0)
        if count > 0:
            self.pre_counts[module_index] = count - 1
        self.in_backward_passes[module_index] = self.in_backward_passes.get(module_index, 0) + 1
        self._span_begin("bwd", module_index)
        module = self.state.modules[module_index][1]
        self.state.fetch(module, forward=False)

    def post_backward(self, module_index: int) -> None:
        """Gradients reached the module's inputs: release once every pass is done."""
        self._queue_epilogue()
        remaining = self.in_backward_passes.get(module_index, 0) - 1
        if remaining > 0:
            self.in_backward_passes[module_index] = remaining
            return
        self.in_backward_passes.pop(module_index, None)
        self.state.backward_done(module_index)
        self._span_end("bwd", module_index)

    def _on_grad(self, sp: ShardedParam, param: torch.Tensor) -> None:
        self._queue_epilogue()
        grad = param.grad
        if grad is not None:
            param.grad = None
            self.state.on_grad(sp, grad)

    def _queue_epilogue(self) -> None:
        task = int(torch._C._current_graph_task_id())
        if task == -1 or task in self._queued_tasks:
            return
        self._queued_tasks.append(task)
        Variable._execution_engine.queue_callback(functools.partial(self._task_done, task))

    def _task_done(self, task: int) -> None:
        self._queued_tasks.remove(task)
        if self._queued_tasks:
            return  # an inner (reentrant checkpoint) backward ended; the outer goes on
        self.epilogue()

    def _span_begin(self, phase: str, index: int) -> None:
        tracer = self.state.tracer
        if tracer is not None:
            self._span_starts.setdefault((phase, index), []).append(tracer.now_us())

    def _span_end(self, phase: str, index: int) -> None:
        tracer = self.state.tracer
        starts = self._span_starts.get((phase, index))
        if tracer is not None and starts:
            name = self.state.modules[index][0] or "<root>"
            tracer.complete(
                f"{phase} {name}",
                "forward" if phase == "fwd" else "backward",
                starts.pop(),
                tracer.now_us(),
            )

    def epilogue(self) -> None:
        """End of backward: reduce what is left, release everything, end the step."""
        tracer = self.state.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        self._epilogue()
        if tracer is not None:
            tracer.complete("epilogue", "backward", start, tracer.now_us())
        self._span_starts.clear()

    def _epilogue(self) -> None:
        self.state.end_backward()
        self.pre_counts.clear()
        self.in_backward_passes.clear()
        self.stack.clear()


def install_hooks(state: ShardedModelState) -> ModelHooks:
    """Create and install the hooks of a sharded model."""
    hooks = ModelHooks(state)
    hooks.install()
    return hooks
