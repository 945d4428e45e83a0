"""Partitioned parameters: the side table and the storage mechanics of release.

Note (releasing memory for real):
    Swapping ``param.data`` for a shard frees nothing while a graph is alive: the
    tensors autograd saves share the parameter's *storage* (:ref:`fact-data-swap`). So
    every ``nn.Parameter`` keeps its full shape and its storage object is emptied in
    place: releasing swaps the bytes out into a spare storage
    (``UntypedStorage._swap_data_ptr_``, pooled for the next gather), gathering fills a
    spare one and swaps it in. Nothing is written through the parameter, so its version
    counter never moves and backward accepts the saved tensors (without the swap the
    storage is refilled under ``_unsafe_preserve_version_counter``:
    :ref:`fact-refill-version`). The parameter objects never change, so tied weights
    stay tied.

Note (reading a released parameter):
    A released parameter has no bytes and torch does not check: ``p.sum()`` kills the
    process (:ref:`fact-empty-parameter-read`). So while released a parameter wears a
    subclass of its own class whose ``__torch_function__`` lets metadata through and
    turns every other op into an error naming the parameter and how to gather it; the
    class goes back the moment it is gathered. :func:`dress_released` and
    :func:`undress_released` are the only code that changes it. A global
    ``TorchFunctionMode`` instead would tax every op of the process
    (:ref:`fact-tricks`).

Note (``param.grad`` of a sharded parameter):
    zero3 takes every gradient the moment autograd has accumulated it and reduces it
    into per-rank shards, so ``param.grad`` is None where plain PyTorch holds a
    gradient. Code written for one process reads it (``torch.nn.utils.clip_grad_norm_``
    over ``model.parameters()``, gradient-norm logging) and would see nothing: no
    clipping, a norm of 0, without a word. So every sharded parameter, persistent ones
    and those of a world of one included, is an instance of a subclass of its own class
    with :class:`ShardedParameter` mixed in, whose ``grad`` raises where plain PyTorch
    would hold a gradient (from the end of a backward that produced one, on any rank,
    until gradients are cleared) and is None where it would be None. Setting it works
    as on any tensor (``zero_grad`` sets None; a gradient set before a backward is
    accumulated into, as autograd does). The subclass changes no op (it defines no
    ``__torch_function__``), so forward and backward pay nothing for it; zero3's own
    hooks read and clear the field directly (:func:`raw_grad`).

Note (``zero_grad`` of a module wrapping the sharded one):
    ``nn.Module.zero_grad`` reads each parameter's ``grad`` and sets it to None. Called
    on the sharded root, zero3's ``ShardedModule.zero_grad`` ends the gradient
    accumulation window first; called on a module that *wraps* it (a ``peft.PeftModel``:
    the HF Trainer calls ``model.zero_grad()`` on the model it was given) it never
    reaches zero3, and its first read would raise. So the getter recognises that read:
    when the calling frame is ``nn.Module.zero_grad`` itself (compared by code object,
    nothing patched) and its module holds the whole sharded model, the window ends
    there, exactly as ``ShardedModule.zero_grad`` ends it, and the read gives None. A
    ``zero_grad`` of a submodule still raises: zero3 cannot clear part of a window.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from zero3.core.params._pool import BufferPool

__all__ = [
    "METADATA_OPS",
    "GradHolder",
    "ParamOffloadError",
    "ParamStatus",
    "ReleasedParameter",
    "ShardHome",
    "ShardReadError",
    "ShardedParam",
    "ShardedParameter",
    "dress_released",
    "dress_sharded",
    "fill_full",
    "free_full",
    "local_shard",
    "lookup",
    "raw_grad",
    "set_raw_grad",
    "undress_released",
    "undress_sharded",
    "write_full",
]


class ParamStatus(enum.Enum):
    """Whether a parameter's full data is present on this rank."""

    #: Only this rank's shard is present; the parameter's storage is freed.
    NOT_AVAILABLE = "not_available"
    #: A gather of the full data is in flight.
    INFLIGHT = "inflight"
    #: The full data is present (gathered, or a persistent parameter).
    AVAILABLE = "available"


class GradHolder(Protocol):
    """Where a parameter's gradients go (the model's training step and reducer)."""

    def holds_grad(self, sp: ShardedParam) -> bool:
        """Whether plain PyTorch would hold a gradient of ``sp`` now (see the Note)."""
        ...

    def zero_grad_from(self, module: nn.Module) -> bool:
        """``module.zero_grad()`` runs: end the window if ``module`` holds the whole
        sharded model (returns whether it did; the Note on wrapping modules).
        """
        ...


class ParamOffloadError(RuntimeError):
    """Offloaded parameter shards could not be stored or read back (``offload_param``;
    raised on every rank).
    """


class ShardReadError(RuntimeError):
    """An offloaded parameter shard could not be read back (names the file)."""


class ShardHome(Protocol):
    """Where a parameter's shard lives between uses when ``offload_param`` moves it away
    from the parameter's device: a swap file (``ParamSwap``), or host memory while the
    model is on an accelerator (``HostShards``).

    Note (a shard read on demand):
        Every reader of :attr:`zero3.core.engine.ShardedParam.shard` gets the values:
        an out shard is read back first (:meth:`bring_in`) and stays resident until
        the home drops it again (after the gather that packed it, after an optimizer
        step writes it, or when the model state settles the shards), so code that
        reads shards outside the hot path needs no knowledge of offload. The gather
        path reads ahead in trace order so that it rarely waits, and packs what
        :meth:`for_gather` gives it. An in-place edit of a resident shard moves its
        version counter, and the home writes it back before dropping it.
    """

    #: Whether reading a shard back can fail, as a file read can. Every gather of its
    #: shards then checks its fingerprints at once, so that all ranks stop at a gather
    #: one rank could not fill. It is the home's kind, not its state, so every rank
    #: decides alike.
    reads_can_fail: bool

    def for_gather(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s shard for the gather that packs it now, on the current stream: a
        copy on the parameter's device where the home makes one (read ahead, or queued
        by this call once a swap file's read is in; the current stream waits for it, the
        host does not), else :attr:`~zero3.core.engine.ShardedParam.shard` (read back if
        out). Valid until the gather has packed it and dropped ``sp``. Raises
        :class:`ShardReadError` as :meth:`bring_in` does.
        """
        ...

    def bring_in(self, sp: ShardedParam) -> torch.Tensor:
        """Read ``sp``'s shard back (or take a read already under way); it is resident
        until dropped. Raises :class:`ShardReadError` naming the file.
        """
        ...

    def drop(self, sp: ShardedParam) -> None:
        """Let a resident shard go (written back first if it was edited in place)."""
        ...

    def read_ahead(self, upcoming: Iterable[ShardedParam], limit_numel: int) -> None:
        """Start reading the shards of ``upcoming`` (in gather order), at most about
        ``limit_numel`` shard elements in flight.
        """
        ...

    def write(self, sp: ShardedParam, values: torch.Tensor, *, edit: bool) -> None:
        """Set this rank's real elements of ``sp`` to ``values`` in its home (a swap
        file's shard is not resident afterwards; nothing read ahead before the write is
        used after it). ``edit``: the values come from outside the optimizer (a load,
        ``gathered_parameters``), which the optimizer's masters must take.
        """
        ...


@dataclasses.dataclass(eq=False)
class ShardedParam:
    """Partitioned state of one parameter (zero3's side table, no tensor attributes).

    Attributes:
        index: Position in the model's deterministic parameter order (same on all ranks).
        name: Qualified name of the parameter (its first name, for tied ones).
        param: The ``nn.Parameter`` itself, kept at full shape.
        shape: Full shape.
        numel: Full number of elements.
        shard_numel: Elements per rank (the numel padded to a multiple of the world size,
            divided by it).
        persistent: Stays whole on every rank (small parameters).
        rank: This process's rank in the sharding group.
        world_size: Ranks in the sharding group.
        aliases_param: The shard *is* the parameter's data (a persistent parameter in a
            world of one): writing the shard updates the parameter, nothing to gather or
            refresh.
        holds: Modules currently running (forward or backward) that use this parameter;
            it is never released while held.
        pinned: Open ``gathered_parameters`` blocks holding it; it stays whole across
            steps until they exit.
        owners: Names of the modules holding it in ``_parameters`` (for messages).
        master: The fp32 master of this rank's real elements, where an optimizer keeps
            one apart from :attr:`shard` (non-fp32 parameters); written together with
            the shard by ``ShardedModelState.write_local``.
        version: The parameter's autograd version counter when zero3 last knew its
            whole data to equal the shards; a different counter means an in-place edit
            (zero3's own fills and writes never move it).
        grads: Where its gradients go, asked when ``param.grad`` is read (None: not
            trainable when sharded, or not wired yet).
        home: Where its shard lives between uses when ``offload_param`` moves it away
            from the parameter's device (a swap file, or host memory while the model is
            on an accelerator; None: on the parameter's device, always resident).
    """

    index: int
    name: str
    param: nn.Parameter
    shape: torch.Size
    numel: int
    shard_numel: int
    _shard: torch.Tensor
    persistent: bool
    rank: int
    world_size: int
    aliases_param: bool = False
    _status: ParamStatus = dataclasses.field(default=ParamStatus.AVAILABLE, repr=False)
    holds: int = 0
    pinned: int = 0
    owners: list[str] = dataclasses.field(default_factory=list)
    master: torch.Tensor | None = None
    version: int = 0
    grads: GradHolder | None = dataclasses.field(default=None, repr=False)
    home: ShardHome | None = dataclasses.field(default=None, repr=False)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's flat shard, ``shard_numel`` elements (padding at the end of the
        last ranks' shards is zero); with a :attr:`home` it is read back first where
        ``offload_param`` keeps it out (see :class:`~zero3.core.params._params.ShardHome`).
        """
        if self.home is not None and self._shard.numel() != self.shard_numel:
            return self.home.bring_in(self)
        return self._shard

    @shard.setter
    def shard(self, value: torch.Tensor) -> None:
        self._shard = value

    @property
    def held_shard(self) -> torch.Tensor:
        """The shard tensor as held now, never read back (empty while offloaded)."""
        return self._shard

    @property
    def resident(self) -> bool:
        """Whether the shard is in memory now (always, without a :attr:`home`)."""
        return self.home is None or self._shard.numel() == self.shard_numel

    @property
    def offloaded(self) -> bool:
        """Whether parameter offload keeps the shard away from the parameter's device
        (in a swap file, or in host memory while the model is on an accelerator).
        """
        return self.home is not None or self._shard.device != self.param.device

    @property
    def device(self) -> torch.device:
        """Where the shard lives when resident (the parameter's device)."""
        return self.param.device

    @property
    def itemsize(self) -> int:
        """Bytes per element of the parameter and its shard."""
        return self.param.dtype.itemsize

    @property
    def status(self) -> ParamStatus:
        """Whether the full data is present (change it with :meth:`set_status`)."""
        return self._status

    def set_status(self, value: ParamStatus) -> None:
        """Record whether the full data is present, and dress the parameter to match.

        This changes the class of the user's ``nn.Parameter``: leaving AVAILABLE dresses
        it as a :class:`~zero3.core.params._params.ReleasedParameter` subclass of its own
        class, becoming AVAILABLE again undresses it (see the module Note "reading a
        released parameter" for why, and what the alternative costs). Every status
        change goes through here, so a parameter's class and its bytes never disagree.
        """
        self._status = value
        if value is ParamStatus.AVAILABLE:
            undress_released(self.param)
        else:
            dress_released(self.param)

    @property
    def dtype(self) -> torch.dtype:
        """The parameter dtype."""
        return self.param.dtype

    @property
    def padded_numel(self) -> int:
        """``shard_numel * world_size``: the numel rounded up to a multiple of N."""
        return self.shard_numel * self.world_size

    @property
    def local_numel(self) -> int:
        """Real (non-padding) elements in this rank's shard."""
        return self.valid_numel(self.rank)

    def valid_range(self, rank: int) -> tuple[int, int]:
        """Element range ``[start, stop)`` of the full parameter held by ``rank``."""
        start = min(rank * self.shard_numel, self.numel)
        return start, min(start + self.shard_numel, self.numel)

    def valid_numel(self, rank: int) -> int:
        """Real (non-padding) elements in ``rank``'s shard."""
        start, stop = self.valid_range(rank)
        return stop - start

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains."""
        return self.param.requires_grad

    def write_local(
        self, values: torch.Tensor, *, masters: bool = True, stepped: bool = False
    ) -> None:
        """Set this rank's real elements: the shard, and (``masters``) the fp32 master if
        an optimizer keeps one apart. The whole parameter is not touched. ``stepped``:
        the values are the optimizer's own stepped masters (an offloaded shard then
        needs no "edited" mark for the optimizer to take).
        """
        with torch.no_grad():
            if self.home is not None and values.numel() == self.local_numel:
                self.home.write(self, values, edit=not stepped)
            else:
                self.shard[: values.numel()].copy_(values)
            if masters and self.master is not None:
                self.master.copy_(values)

    def __repr__(self) -> str:
        return (
            f"ShardedParam({self.name!r}, shape={tuple(self.shape)}, {self.status.name}, "
            f"persistent={self.persistent})"
        )


_T: Any = torch.Tensor  # typed Any: the stubs give properties as values, not descriptors
#: What a released parameter still answers: metadata that needs no data.
METADATA_OPS: frozenset[Callable[..., Any]] = frozenset(
    {
        _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.layout.__get__,
        _T.requires_grad.__get__, _T.requires_grad.__set__, _T.is_leaf.__get__,
        _T.grad.__get__, _T.grad.__set__, _T.grad_fn.__get__, _T.ndim.__get__,
        _T.is_cuda.__get__, _T.is_cpu.__get__, _T.is_meta.__get__, _T.is_sparse.__get__,
        _T.is_quantized.__get__, _T.itemsize.__get__, _T.nbytes.__get__,
        _T.size, _T.dim, _T.ndimension, _T.numel, _T.nelement, _T.element_size,
        _T.stride, _T.storage_offset, _T.is_contiguous, _T.untyped_storage, _T.data_ptr,
        _T.requires_grad_, _T.register_hook, _T.register_post_accumulate_grad_hook,
        _T.get_device, _T.is_floating_point, _T.is_complex, _T.__len__, _T.__hash__,
        _T._is_view, _T._version.__get__,
    }
)  # fmt: skip
_TEXT = frozenset({_T.__repr__, _T.__str__, _T.__format__})


def _first_released(args: Iterable[Any]) -> torch.Tensor | None:
    for arg in args:
        if isinstance(arg, ReleasedParameter):
            return arg
        if isinstance(arg, list | tuple):
            found = _first_released(arg)
            if found is not None:
                return found
    return None


class ReleasedParameter(nn.Parameter):
    """What a sharded parameter is while its data is not on this rank (see the Note).

    Metadata works; any op that would read the data raises a ``RuntimeError`` naming
    the parameter instead of reading freed memory.
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in METADATA_OPS:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        param = _first_released(args)
        sp = lookup(param) if param is not None else None
        name = sp.name if sp is not None else "?"
        if func in _TEXT:
            shape = tuple(sp.shape) if sp is not None else "?"
            return f"<zero3 partitioned parameter {name!r} shape={shape}, not gathered>"
        what = getattr(func, "__name__", repr(func))
        if what in ("__get__", "__set__"):  # a property: name the attribute
            what = getattr(getattr(func, "__self__", None), "__name__", what)
        if _under_dynamo():
            raise RuntimeError(
                "zero3: torch.compile of a sharded model is not supported: Dynamo inspects "
                f"the parameters (here {name!r}, `{what}`) before zero3's hooks can gather "
                "them, and the hooks gather and release parameters, which it cannot trace. "
                "Run the sharded model eagerly."
            )
        raise RuntimeError(
            f"zero3: parameter {name!r} is partitioned across ranks and not gathered here, "
            f"so `{what}` cannot read it. zero3 gathers parameters inside the sharded "
            "module's forward and backward; elsewhere wrap the access in "
            "`with zero3.core.gathered_parameters([param]):` (every rank must enter it), "
            "and use zero3.hooks.full_state_dict(model) for state dicts."
        )


def _under_dynamo() -> bool:
    """Whether torch.compile's tracer is on the call stack (checked on errors only)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("torch._dynamo"):
            return True
        frame = frame.f_back
    return False


_RELEASED_CLASSES: dict[type, type] = {}
_ORIGINAL_CLASSES: dict[type, type] = {}


def _released_class(cls: type) -> type:
    """``ReleasedParameter`` mixed into a parameter's own class (cached)."""
    released = _RELEASED_CLASSES.get(cls)
    if released is None:
        released = type(f"Released{cls.__name__}", (ReleasedParameter, cls), {})
        _RELEASED_CLASSES[cls] = released
        _ORIGINAL_CLASSES[released] = cls
    return released


def dress_released(param: torch.Tensor) -> None:
    """Give a parameter without bytes its released class (``ReleasedParameter`` mixed
    into its own class), so any read of its data is a clear error.
    """
    cls = type(param)
    if not issubclass(cls, ReleasedParameter):
        param.__class__ = _released_class(cls)


def undress_released(param: torch.Tensor) -> None:
    """Give a parameter that has its bytes again its own class back."""
    original = _ORIGINAL_CLASSES.get(type(param))
    if original is not None:
        param.__class__ = original


#: The ``grad`` attribute of every tensor: reads and writes the field autograd fills.
_GRAD: Any = torch._C.TensorBase.grad
#: ``raw_grad(param)``: ``param.grad`` as autograd left it, without the check of
#: :class:`ShardedParameter`; ``set_raw_grad(param, grad)`` sets it. zero3's gradient
#: hook uses them on every parameter of every step: bound slot wrappers, no Python frame.
raw_grad: Callable[[torch.Tensor], torch.Tensor | None] = _GRAD.__get__
set_raw_grad: Callable[[torch.Tensor, torch.Tensor | None], None] = _GRAD.__set__


class ShardedParameter(nn.Parameter):
    """Mixed into the class of every sharded parameter: its ``grad`` refuses to be read
    where plain PyTorch would hold a gradient that zero3 has reduced into shards (see
    the module Note "``param.grad`` of a sharded parameter").
    """

    @property
    def grad(self) -> torch.Tensor | None:
        """The gradient autograd left here, if any; raises where zero3 holds it in shards."""
        grad = _GRAD.__get__(self)
        if grad is None:
            sp = lookup(self)
            if sp is not None and sp.grads is not None and sp.grads.holds_grad(sp):
                zeroing = _zero_grad_caller(sys._getframe(1))
                if zeroing is None or not sp.grads.zero_grad_from(zeroing):
                    raise RuntimeError(_no_full_grad(sp.name))
        return grad  # type: ignore[no-any-return]

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        _GRAD.__delete__(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        # A copy is an ordinary parameter of the user's class, outside zero3 (reading a
        # released one's data raises, naming gathered_parameters).
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        cls = unsharded_class(type(self))
        data = self.data.clone(memory_format=torch.preserve_format)
        copy = cls(data, self.requires_grad)
        memo[id(self)] = copy
        return copy  # type: ignore[no-any-return]


_MODULE_ZERO_GRAD = nn.Module.zero_grad.__code__


def _zero_grad_caller(frame: Any) -> nn.Module | None:
    """The module whose ``nn.Module.zero_grad`` is the calling frame, or None (the Note
    on wrapping modules).
    """
    if frame is None or frame.f_code is not _MODULE_ZERO_GRAD:
        return None
    module = frame.f_locals.get("self")
    return module if isinstance(module, nn.Module) else None


def _no_full_grad(name: str) -> str:
    return (
        f"zero3: parameter {name!r} of a sharded model has no .grad: zero3 took its "
        "gradient into its own buffers (reduced into per-rank shards), so code that reads "
        "param.grad would see nothing (torch.nn.utils.clip_grad_norm_(model.parameters()) "
        "would clip nothing and return 0). Clip with "
        "zero3.optim.PartitionedOptimizer.clip_grad_norm_(max_norm) or "
        "Zero3Config(gradient_clipping=max_norm); read gradients with "
        "zero3.core.local_grad(param) (this rank's shard) or zero3.core.full_grad(param) "
        "(a collective) before the optimizer steps; step with a PartitionedOptimizer. "
        "Setting param.grad = None (zero_grad) works as usual."
    )


_SHARDED_CLASSES: dict[type, type] = {}
_UNSHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    """``ShardedParameter`` mixed into a parameter's own class (cached; same name, so
    ``type(param).__name__`` is unchanged).
    """
    sharded = _SHARDED_CLASSES.get(cls)
    if sharded is None:
        sharded = type(
            cls.__name__,
            (ShardedParameter, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        _SHARDED_CLASSES[cls] = sharded
        _UNSHARDED_CLASSES[sharded] = cls
    return sharded


def unsharded_class(cls: type) -> type:
    """The user's own parameter class behind a sharded (or released) one."""
    cls = _ORIGINAL_CLASSES.get(cls, cls)
    return _UNSHARDED_CLASSES.get(cls, cls)


def dress_sharded(param: torch.Tensor) -> None:
    """Give a parameter being sharded its sharded class (released ones stay released)."""
    cls = type(param)
    released = issubclass(cls, ReleasedParameter)
    own = _ORIGINAL_CLASSES.get(cls, cls) if released else cls
    if issubclass(own, ShardedParameter):
        return
    sharded = _sharded_class(own)
    param.__class__ = _released_class(sharded) if released else sharded


def undress_sharded(param: torch.Tensor) -> None:
    """Give a parameter that is sharded no more (whole again) the user's class back."""
    param.__class__ = unsharded_class(type(param))


# param -> ShardedParam for every sharded parameter in this process, keyed by identity
# (tensors compare elementwise, so an ordinary weak dict cannot hold them).
_TABLE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(sp: ShardedParam) -> None:
    """Record ``sp`` as the partitioned state of ``sp.param``."""
    _TABLE[sp.param] = sp


def unregister(param: nn.Parameter) -> None:
    """Forget a parameter (when a model is unsharded)."""
    _TABLE.pop(param, None)


def lookup(param: torch.Tensor) -> ShardedParam | None:
    """The partitioned state of ``param``, or None if it is not sharded."""
    return _TABLE.get(param)  # type: ignore[no-any-return]


def require(param: torch.Tensor, what: str) -> ShardedParam:
    """Like :func:`lookup`, but raise a clear error for an unsharded parameter."""
    sp = lookup(param)
    if sp is None:
        raise ValueError(
            f"{what}: the tensor of shape {tuple(param.shape)} is not a parameter of a "
            "sharded module (call zero3.hooks.shard_module(model) first)"
        )
    return sp


_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def free_full(param: torch.Tensor, pool: BufferPool | None = None) -> None:
    """Free the full storage of ``param`` in place (autograd's saved copies included).

    With a pool, the bytes go to it for reuse by the next gather of this size.
    """
    storage = param.untyped_storage()
    if pool is None or not _SWAP or storage.nbytes() == 0:
        storage.resize_(0)
        return
    holder = torch.UntypedStorage(0, device=storage.device)
    storage._swap_data_ptr_(holder)  # type: ignore[attr-defined]  # the parameter's is empty now
    pool.give_storage(holder)


def fill_full(param: torch.Tensor, fill: Callable[[torch.Tensor], None], pool: BufferPool) -> None:
    """Give a released ``param`` its bytes again: ``fill`` writes a flat view of a
    (pooled) storage, which is then swapped into the parameter's own storage object.

    Writing a spare storage and swapping it in never touches the parameter's version
    counter, so autograd's saved tensors stay valid without bookkeeping.
    """
    nbytes = param.numel() * param.element_size()
    if not _SWAP:
        storage = param.untyped_storage()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        with torch.no_grad(), _unsafe_preserve_version_counter(param):
            fill(param.view(-1))
        return
    fresh = pool.take_storage(nbytes, param.device)
    with torch.no_grad(), torch.inference_mode(False):
        flat = torch.empty(0, dtype=param.dtype, device=param.device)
        flat.set_(fresh, 0, (param.numel(),), (1,))
        fill(flat)
    param.untyped_storage()._swap_data_ptr_(fresh)  # type: ignore[attr-defined]


def write_full(param: torch.Tensor, flat: torch.Tensor) -> None:
    """(Re)allocate ``param``'s storage and fill it with ``flat`` (numel elements)."""
    nbytes = param.numel() * param.element_size()
    storage = param.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
    with torch.no_grad(), _unsafe_preserve_version_counter(param):
        param.view(-1).copy_(flat)


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's real elements of a sharded parameter (a flat view, no padding).

    The view aliases the shard zero3 keeps: edits change the parameter after its next
    gather. Use it for debugging and checkpoint tooling.
    """
    sp = require(param, "zero3.core.local_shard")
    return sp.shard[: sp.local_numel]
