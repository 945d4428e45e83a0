"""Partitioned parameters: the side table and the storage mechanics of release.

Note (releasing memory for real):
    Swapping ``param.data`` for a shard frees nothing while a graph is alive: autograd
    saves the weight for backward (``F.linear`` saves it), and the saved tensor shares
    the *storage*, so the full buffer stays referenced until backward (measured: after
    the swap the full buffer's ``data_ptr`` is still alive in the saved tensor;
    docs/facts.rst). zero3 therefore keeps every ``nn.Parameter`` at its full shape and
    frees its storage object in place: the saved tensors share that storage object, so
    the bytes really go from all of them. Releasing swaps the bytes out into a spare
    storage (``UntypedStorage._swap_data_ptr_``) that the buffer pool may keep for the
    next gather; gathering fills a spare storage and swaps it in. Nothing is written
    through the parameter, so its version counter never moves and backward accepts the
    saved tensors. (On a torch without ``_swap_data_ptr_`` the storage is resized and
    filled in place under ``torch.autograd._unsafe_preserve_version_counter``: the copy
    is not a user mutation, and backward would otherwise refuse the saved tensor.) The
    parameter objects never change, so tied weights stay tied and optimizers, hooks and
    ``named_parameters`` see the same objects.

Note (reading a released parameter):
    A released parameter keeps its shape but has no bytes, and torch does not check:
    ``p.sum()`` on it kills the process (SIGSEGV), and ops that make a view first
    (``F.linear``, printing) raise torch's "setStorage: ... out of bounds for storage
    of size 0", which names neither the parameter nor the fix. So while released a
    parameter wears a subclass of its own class whose ``__torch_function__`` lets
    metadata through (shape, dtype, device, grad, requires_grad...) and turns every
    other op into a clear error that names the parameter and says how to gather it.
    The class goes back the moment the parameter is gathered, so forward and backward
    pay nothing for it. :meth:`ShardedParam.set_status` is the one place that changes
    the class, together with the status.

    Alternative tried: leave classes alone and push one global ``TorchFunctionMode``
    that checks every op's arguments for released parameters. It taxes every op of the
    process, released parameter or not: 1.2-1.3x the time of a small GPT's (TinyGPT's)
    forward+backward (23-31 us per op), 1.4-1.9x once sharded (the mode also sees
    zero3's own gather and copy ops), against 0.4-0.7% of the sharded step for the class
    changes (1.4-2.5 us per release + gather, 58 per step). A global mode would also
    stack with the user's own modes for the model's whole life. Measured by
    ``tools/measure_tricks.py`` (torch 2.13, CPU, one thread; ranges over four runs on a
    loaded 2-core machine).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from zero3.core.params._pool import BufferPool

__all__ = [
    "METADATA_OPS",
    "ParamStatus",
    "ReleasedParameter",
    "ShardedParam",
    "dress_released",
    "fill_full",
    "free_full",
    "local_shard",
    "lookup",
    "undress_released",
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
        shard: This rank's flat shard, ``shard_numel`` elements (padding at the end of
            the last ranks' shards is zero).
        persistent: Stays whole on every rank (small parameters).
        rank: This process's rank in the sharding group.
        world_size: Ranks in the sharding group.
        aliases_param: The shard *is* the parameter's data (a world of one): writing
            the shard updates the parameter, nothing to gather or refresh.
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
    """

    index: int
    name: str
    param: nn.Parameter
    shape: torch.Size
    numel: int
    shard_numel: int
    shard: torch.Tensor
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

    def write_local(self, values: torch.Tensor, *, masters: bool = True) -> None:
        """Set this rank's real elements: the shard, and (``masters``) the fp32 master if
        an optimizer keeps one apart. The whole parameter is not touched.
        """
        with torch.no_grad():
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
