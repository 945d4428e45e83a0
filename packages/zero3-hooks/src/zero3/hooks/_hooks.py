"""The hooks of one sharded model: the four per module and the gradient hooks.

Each hook hands its event to the model's training step
(:class:`~zero3.core.engine.TrainingStep`), which owns the step's state; the hooks put
the backward listeners into the graph, refuse what zero3 cannot run (double backward,
``torch.compile``) and notice parameters a module reads without owning them.

Note (backward hooks in the graph):
    ``register_full_backward_hook`` fires unreliably with several outputs, in-place
    ops or inputs that need no gradient, so zero3 welds its backward hooks into the
    graph as identity Functions: one on a module's outputs, whose backward runs before
    any of the module's own backward ops (pre-backward: gather), and one on its inputs,
    whose backward runs after all of them (post-backward: release). The outputs are
    detached aliases of the inputs, not views, so downstream in-place ops behave
    exactly as they would without zero3.

Note (external parameters):
    Each module's ``_parameters`` dict is replaced by a :class:`ParamAccessDict` that
    reports reads. A read of a sharded parameter while a *different* module's forward
    runs (a parent using a child's weight) registers the parameter as external to the
    running module and gathers it at once; from then on it is gathered together with
    that module, in forward and backward. Parameters a module returns in its output
    ("dangling": a bias a child hands its caller to add) become external to the caller
    the same way. Why a dict that sees every read, what it costs and the alternative
    that misses reads: :ref:`fact-guard-only-reads`, :ref:`fact-tricks`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zero3.core.engine import ShardedModelState, ShardedParam, in_backward, sharded_param
from zero3.hooks._copy import PICKLE_REFUSED, seed_plain_copy
from zero3.hooks._tree import iter_tensors, map_tensors

__all__ = [
    "BackwardListener",
    "ListenedIdentity",
    "ModelHooks",
    "ParamAccessDict",
    "ParkedHook",
    "PostBackward",
    "PreBackward",
    "installed",
]

#: The hooks installed on each sharded root module (``shard_module`` registers them).
INSTALLED: weakref.WeakKeyDictionary[nn.Module, ModelHooks] = weakref.WeakKeyDictionary()


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


#: Installs state-dict guards on some modules of a model (by index); returns the handles.
GuardInstaller = Callable[[ShardedModelState, Sequence[int]], list[RemovableHandle]]


class BackwardListener(Protocol):
    """What the Functions call back into (the hooks of one sharded model)."""

    def pre_backward(self, module_index: int) -> None:
        """Gradients reached the module's outputs."""

    def post_backward(self, module_index: int) -> None:
        """Gradients reached the module's inputs."""


class ListenedIdentity(torch.autograd.Function):
    """Identity on some tensors whose backward tells a listener about a module."""

    @staticmethod
    def forward(
        ctx: Any, listener: BackwardListener, module_index: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.listener = listener
        ctx.module_index = module_index
        return tuple(t.detach() for t in tensors)


class PreBackward(ListenedIdentity):
    """Identity on a module's outputs; its backward gathers the module's parameters."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.listener.pre_backward(ctx.module_index)
        return (None, None, *grads)


class PostBackward(ListenedIdentity):
    """Identity on a module's inputs; its backward releases the module's parameters."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.listener.post_backward(ctx.module_index)
        return (None, None, *grads)


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
        if value is not None and self.hooks.step.running() is not None:
            self.hooks.on_param_read(self.module_index, value)
        return value

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        # Reached first when copy.deepcopy copies this module (see zero3.hooks._copy):
        # copy the module's whole subtree as ordinary modules.
        self.hooks.seed_copy(self.module_index, memo)
        return memo[id(self)]  # type: ignore[no-any-return]

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(PICKLE_REFUSED)

    def __setitem__(self, key: str, value: Any) -> None:
        old = dict.get(self, key)
        if old is not None and old is not value and sharded_param(old) is not None:
            raise RuntimeError(
                f"parameter {key!r} of a sharded module cannot be replaced (or deleted); "
                "call zero3.hooks.unshard_module(model) first, change it, and shard again"
            )
        dict.__setitem__(self, key, value)


class ParkedHook:
    """A module hook taken out of its module's hook dict, to be put back where it was.

    Note (in place, not registered again):
        A hook registered again would run after every hook added since, such as
        transformers' output-capturing hooks (installed on the first forward), which
        would then capture outputs without zero3's pre-backward hook. The entry goes
        back under its key, in its old place (``OrderedDict.move_to_end``).
    """

    def __init__(self, handle: RemovableHandle) -> None:
        self.handle = handle
        hooks = handle.hooks_dict_ref()
        assert hooks is not None
        self._order = list(hooks)
        self._fn = hooks.pop(handle.id)
        self._flags: list[tuple[Any, Any]] = []
        for ref in handle.extra_dict_ref:
            extra = ref()
            if extra is not None and handle.id in extra:
                self._flags.append((extra, extra.pop(handle.id)))

    def restore(self) -> None:
        """Put the hook back in its old place."""
        hooks = self.handle.hooks_dict_ref()
        if hooks is None:
            return  # the module is gone
        hooks[self.handle.id] = self._fn
        for extra, value in self._flags:
            extra[self.handle.id] = value
        before = [key for key in self._order if key in hooks]
        known = set(before)
        for key in [*before, *(key for key in hooks if key not in known)]:
            hooks.move_to_end(key)


class ModelHooks:
    """Installs the hooks of one sharded model and hands their events to its step."""

    def __init__(self, state: ShardedModelState, guards: GuardInstaller | None = None) -> None:
        self.state = state
        self.step = state.step
        self._guards = guards
        self._guarded: set[int] = set()  # modules with state-dict guards
        self._version = state.structure_version  # adoptions the hooks have followed
        self._handles: list[RemovableHandle] = []
        self._forward: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        self._access_dicts: dict[int, tuple[nn.Module, ParamAccessDict]] = {}
        self._parked: list[ParkedHook] = []
        self._plain: list[int] = []  # modules whose parameter dict is a plain dict for now
        self._owned: dict[int, frozenset[int]] = {}
        self._grad_hooked: set[int] = set()
        self._span_starts: dict[tuple[str, int], list[float]] = {}

    # -- installation -------------------------------------------------------------------

    def install(self) -> None:
        """Register module, parameter and state-dict hooks (on modules not hooked yet:
        after an adoption, the new ones).
        """
        for index, _, module in self.state.hooked_modules():
            if index in self._forward:
                continue
            pre = module.register_forward_pre_hook(
                functools.partial(self._pre_forward, index), with_kwargs=True
            )
            post = module.register_forward_hook(
                functools.partial(self._post_forward, index), with_kwargs=True
            )
            self._handles += [pre, post]
            self._forward[index] = (pre, post)
        for index, (_, module) in enumerate(self.state.modules):
            if index not in self._access_dicts and index not in self._plain:
                self._watch_reads(index, module)
        for sp in self.state.params:
            if sp.param.requires_grad:
                self._hook_grad(sp)
        if self._guards is not None:
            fresh = [i for i in range(len(self.state.modules)) if i not in self._guarded]
            self._handles += self._guards(self.state, fresh)
            self._guarded.update(fresh)

    def adopt(self) -> None:
        """Adopt what was added to the model since sharding (``ShardedModelState.adopt``,
        a collective when anything was) and hook the new modules and parameters, also
        after an adoption that building an optimizer made.
        """
        self.state.adopt()
        if self._version != self.state.structure_version:
            self._version = self.state.structure_version
            self._owned.clear()
            self.install()

    def _hook_grad(self, sp: ShardedParam) -> None:
        if sp.index in self._grad_hooked:
            return
        self._grad_hooked.add(sp.index)
        on_grad = functools.partial(self._on_grad, sp)
        self._handles.append(sp.param.register_post_accumulate_grad_hook(on_grad))

    def _watch_reads(self, index: int, module: nn.Module) -> None:
        access = ParamAccessDict(module._parameters, self, index)
        object.__setattr__(module, "_parameters", access)
        self._access_dicts[index] = (module, access)

    def remove(self) -> None:
        """Remove every hook and restore the modules' parameter dicts."""
        self.resume()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._forward.clear()
        for module, access in self._access_dicts.values():
            object.__setattr__(module, "_parameters", dict(access))
        self._access_dicts.clear()

    # -- zero3.hooks.unsharded ------------------------------------------------------------

    def suspend(self, indices: Iterable[int], guard: Callable[..., None] | None) -> None:
        """Take the forward hooks and the parameter-read dicts of modules ``indices``
        out, until :meth:`resume` (see :class:`ParkedHook` for why in place). ``guard``
        becomes the root's first forward pre-hook meanwhile.
        """
        for index in sorted(indices):
            handles = self._forward.get(index)
            if handles is not None:
                self._parked += [ParkedHook(handle) for handle in handles]
            entry = self._access_dicts.get(index)
            if entry is not None:
                module, access = entry
                object.__setattr__(module, "_parameters", dict(access))
                self._plain.append(index)
        if guard is not None:
            root = self.state.modules[0][1]
            handle = root.register_forward_pre_hook(guard, prepend=True)
            self._parked.append(_Temporary(handle))

    def resume(self) -> None:
        """Put back what :meth:`suspend` took out."""
        for parked in reversed(self._parked):
            parked.restore()
        self._parked.clear()
        for index in self._plain:
            self._watch_reads(index, self.state.modules[index][1])
        self._plain.clear()

    def add_handle(self, handle: RemovableHandle) -> None:
        """Keep a handle removed together with the hooks (state-dict hooks)."""
        self._handles.append(handle)

    def seed_copy(self, module_index: int, memo: dict[int, Any]) -> None:
        """Prepare ``copy.deepcopy``'s memo so that the module and its subtree copy as
        ordinary modules (a collective when it holds partitioned parameters; see
        ``zero3.hooks._copy``).
        """
        ours: dict[int, set[int]] = {}
        for handle in self._handles:
            for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
                table = ref()
                if table is not None:
                    ours.setdefault(id(table), set()).add(handle.id)
        module = self.state.modules[module_index][1]
        seed_plain_copy(module, memo, ours, lambda v: isinstance(v, ParamAccessDict))

    # -- forward --------------------------------------------------------------------------

    def _pre_forward(
        self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILE_REFUSED)
        if self.step.running() is None and not in_backward():
            self._span_starts.clear()  # spans a raising forward or backward left open
            if not self.step.is_open and not self.step.unsharded:
                self.adopt()  # modules or parameters added since (adapters)
        self._span_begin("fwd", index)
        for sp in self.step.enter_forward(index):
            self._hook_grad(sp)  # unfrozen since the last step (progressive unfreezing)
        if not torch.is_grad_enabled():
            return None
        return self._wrap(PostBackward, index, (args, kwargs))  # type: ignore[no-any-return]

    def _post_forward(
        self,
        index: int,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        if self.step.running() != index:
            return None  # the forward raised before our pre-hook ran
        self._adopt_dangling(output)
        wants_backward = torch.is_grad_enabled() and any(
            t.requires_grad for t in iter_tensors(output)
        )
        self.step.exit_forward(index, backward_follows=wants_backward)
        self._span_end("fwd", index)
        return self._wrap(PreBackward, index, output) if wants_backward else output

    def _wrap(self, fn: type[torch.autograd.Function], index: int, obj: Any) -> Any:
        tensors = [t for t in iter_tensors(obj) if t.requires_grad]
        if not tensors:
            return obj
        outs = fn.apply(self, index, *tensors)
        replacement = {id(t): o for t, o in zip(tensors, outs, strict=True)}
        return map_tensors(obj, lambda t: replacement.get(id(t), t))

    def _adopt_dangling(self, output: Any) -> None:
        """Sharded parameters returned in ``output`` stay whole for the caller."""
        for tensor in iter_tensors(output):
            sp = sharded_param(tensor) if isinstance(tensor, nn.Parameter) else None
            if sp is None or sp.persistent:
                continue
            caller = self.step.caller()
            if caller is None:
                self.step.hold_for_step(sp)  # the root returned it
            else:
                self._use_external(caller, sp)

    # -- external parameters -----------------------------------------------------------------

    def on_param_read(self, owner_index: int, param: Any) -> None:
        """A parameter was read while some module's forward runs."""
        running = self.step.running()
        if running is None or running == owner_index:
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
        self.step.use_external(module_index, sp)

    # -- backward -----------------------------------------------------------------------------

    def pre_backward(self, module_index: int) -> None:
        """Gradients reached the module's outputs: gather its parameters."""
        if torch.is_grad_enabled():  # backward runs with grad enabled only for create_graph
            raise RuntimeError(_DOUBLE_BACKWARD_REFUSED)
        self._span_begin("bwd", module_index)
        self.step.pre_backward(module_index)

    def post_backward(self, module_index: int) -> None:
        """Gradients reached the module's inputs: release once every pass is done."""
        if self.step.post_backward(module_index):
            self._span_end("bwd", module_index)

    def _on_grad(self, sp: ShardedParam, param: torch.Tensor) -> None:
        self.step.on_grad(sp)

    # -- trace spans ----------------------------------------------------------------------------

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


class _Temporary(ParkedHook):
    """A hook added for the time of a suspension: removed when it ends."""

    def __init__(self, handle: RemovableHandle) -> None:
        self.handle = handle

    def restore(self) -> None:
        self.handle.remove()


def installed(module: nn.Module) -> ModelHooks | None:
    """The hooks of a sharded root module, or None."""
    return INSTALLED.get(module)


def install_hooks(state: ShardedModelState, guards: GuardInstaller | None = None) -> ModelHooks:
    """Create and install the hooks of a sharded model (``guards``: installs the
    state-dict guards on the given modules, then on each adopted one).
    """
    hooks = ModelHooks(state, guards)
    hooks.install()
    return hooks
