"""Construct-time sharding: meta parameters built straight into this rank's shards.

A model built under ``zero3.hooks.empty_init()`` (or ``torch.device("meta")``) has
parameters without memory. :class:`Materializer` gives each one its values, one module at
a time, and keeps only this rank's shard: from a checkpoint (each rank reads only its own
elements, :mod:`zero3.core.construct._sources`) or by running the modules' initialisers
(``param_init_fn(module)``, else ``reset_parameters()`` / ``_reset_parameters()``).
:meth:`ShardedModelState.create <zero3.core.ShardedModelState.create>` drives it;
parameters that are not on meta (without a checkpoint) take the eager path as before.

Note (which initialiser writes what):
    In eager construction every module's ``__init__`` initialises its own parameters
    after its children have done theirs, and an initialiser may write a child's
    parameter (``nn.MultiheadAttention`` zeroes ``out_proj.bias``; transformers' GPT-2
    rescales ``c_proj.weight`` from the attention block). zero3 runs the initialisers in
    that order (children first, as ``nn.Module.apply`` does) and must not free a
    parameter before the last initialiser that writes it has run, nor allocate it after
    the first. It finds out who touches what with a dry run first: every initialiser is
    called on the still-empty model (every tensor on the meta device, where ops cost
    nothing and draw no random numbers) under a ``TorchFunctionMode`` that records the
    parameters each call reads or writes (shape and dtype queries do not count). A
    parameter then exists in full from its first initialiser to its last one; for
    well-behaved models that is its own module, so no more than a module's parameters
    are whole at once. The random-number state is restored after the dry run, so the
    real run draws exactly what eager construction draws (``reset_parameters`` in
    construction order), and an initialiser that cannot run on meta (it reads a value)
    is assumed to touch its whole subtree.

Note (freed temporaries stay resident):
    glibc keeps freed heap blocks below its mmap threshold in the process until
    ``malloc_trim`` (:ref:`fact-glibc-small-blocks`), so a module's full tensors, freed
    after its shards are cut, would still count in the resident set and the next
    module's shards would land elsewhere: the peak would grow with the model, not with
    its shards. After each module the heap is trimmed (``malloc_trim(0)``, glibc only),
    which hands the freed pages back to the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zero3.comm import CommBackend
from zero3.core.config._config import Zero3Config, is_persistent
from zero3.core.construct._empty import SkipMetaFills
from zero3.core.construct._sources import WeightSource, open_weight_source
from zero3.core.diag._memory import trim_heap
from zero3.core.params._broadcast import broadcast_from_rank0
from zero3.core.params._params import METADATA_OPS, dress_released

__all__ = ["Materializer", "check_eager_agree", "own_storage"]

_log = logging.getLogger("zero3.core")

ParamInitFn = Callable[[nn.Module], None]
Checkpoint = Any  # a path (str / os.PathLike) or a WeightSource

_CHECK_CHUNK = 1 << 20  # elements per step of the rank-consistency checksum
_SHOW = 12  # names listed per kind of problem


def own_storage(param: torch.Tensor) -> None:
    """Give ``param`` a contiguous storage of its own (needed to free it in place)."""
    exact = param.numel() * param.element_size()
    if (
        not param.is_contiguous()
        or param.storage_offset() != 0
        or param.untyped_storage().nbytes() != exact
    ):
        param.data = param.data.clone(memory_format=torch.contiguous_format)


def checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """Two integers that differ, with overwhelming odds, when the bits of ``tensor`` do.

    Integer sums over the raw bytes (16 bits at a time, plain and position-weighted):
    exact and order-free, so equal tensors give equal sums on any rank and thread count.
    """
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    plain = weighted = 0
    for start in range(0, words.numel(), _CHECK_CHUNK):
        x = words[start : start + _CHECK_CHUNK].to(torch.int64)
        w = torch.arange(start, start + x.numel(), dtype=torch.int64) % 65521 + 1
        plain += int(x.sum())
        weighted += int((x * w).sum())
    mask = (1 << 62) - 1
    return plain & mask, weighted & mask


@dataclasses.dataclass(eq=False)
class _Target:
    """One parameter the materializer produces."""

    index: int  # position in named_parameters() order
    names: list[str]  # every name it has (tied parameters have several)
    param: nn.Parameter
    dtype: torch.dtype  # the dtype it is sharded in
    persistent: bool
    key: str | None = None  # its checkpoint key
    first: int = -1  # post-order positions of the first / last initialiser touching it
    last: int = -1

    @property
    def name(self) -> str:
        return self.names[0]


@dataclasses.dataclass(eq=False)
class _Buffer:
    """One buffer (shared buffers once, with every name and slot)."""

    tensor: torch.Tensor
    names: list[str]
    slots: list[tuple[nn.Module, str]]
    persistent: bool
    key: str | None = None  # its checkpoint key

    @property
    def name(self) -> str:
        return self.names[0]


def _post_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules, children before parents (the order ``nn.Module.apply`` visits)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, mod: nn.Module) -> None:
        seen.add(id(mod))
        for child_name, child in mod.named_children():
            if id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, mod))

    visit("", module)
    return out


def _initializer(module: nn.Module, param_init_fn: ParamInitFn | None) -> Callable[[], Any] | None:
    if param_init_fn is not None:
        return functools.partial(param_init_fn, module)
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    return None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _TouchRecorder(SkipMetaFills):
    """Records which watched parameters the ops run under it read or write (and skips
    value fills of meta tensors, as :func:`empty_init` does).
    """

    def __init__(self, watched: Mapping[int, _Target]) -> None:
        super().__init__()
        self.watched = watched
        self.touched: set[int] = set()  # target indices

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in METADATA_OPS:
            for t in _tensors((args, kwargs)):
                target = self.watched.get(id(t))
                if target is not None:
                    self.touched.add(target.index)
        return super().__torch_function__(func, types, args, kwargs)


@contextlib.contextmanager
def _real_tensors_on_meta(module: nn.Module) -> Iterator[None]:
    """Swap every real parameter and buffer for a meta stand-in (restored on exit), so
    a dry run of the initialisers cannot change real values.
    """
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    stand_ins: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        tables: tuple[dict[str, Any], ...] = (mod._parameters, mod._buffers)
        for table in tables:
            for name, t in table.items():
                if t is None or t.is_meta:
                    continue
                stand = stand_ins.get(id(t))
                if stand is None:
                    empty = torch.empty_like(t, device="meta")
                    if isinstance(t, nn.Parameter):
                        empty = nn.Parameter(empty, requires_grad=t.requires_grad)
                    stand = stand_ins[id(t)] = empty
                saved.append((table, name, t))
                table[name] = stand
    try:
        yield
    finally:
        for table, name, t in saved:
            table[name] = t


def _listing(kind: str, items: list[str]) -> str:
    more = f", ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    shown = ", ".join(items[:_SHOW]) + more
    return f"  {kind} ({len(items)}): {shown}"


def _conversion_hint(module: nn.Module) -> str | None:
    """Why the keys differ, when transformers converts this model's checkpoints at load.

    transformers 5 stores some models (Mixtral and other mixtures of experts) in a
    layout it converts while loading: per-expert tensors merged into one, renamed
    modules. Only looked up when transformers is already imported (the model is one
    of its classes); zero3 does not import it.
    """
    conversions = sys.modules.get("transformers.conversion_mapping")
    find = getattr(conversions, "extract_weight_conversions_for_model", None)
    if find is None:
        return None
    for _, sub in module.named_modules():
        model_type = getattr(getattr(sub, "config", None), "model_type", None)
        if not isinstance(model_type, str):
            continue
        try:
            mapping = find(sub)
        except Exception:  # not a PreTrainedModel after all
            continue
        if mapping:
            return (
                f"transformers converts {model_type!r} checkpoints while loading them "
                f"({type(sub).__name__}: {len(mapping)} key conversions, such as experts "
                "stored one by one and merged into one tensor), so the file's keys are not "
                "the model's state_dict() keys, and zero3 does not apply that conversion. "
                "Write the weights under state_dict() keys once (from_pretrained in one "
                "process, then safetensors.torch.save_model(model, 'model.safetensors')), "
                "or build without checkpoint= and initialise."
            )
    return None


def _replaced_message(name: str, mod: nn.Module, replaced: list[str]) -> str:
    return (
        f"  the initialiser of module {name or '<root>'!r} ({type(mod).__name__}) replaced "
        f"parameter(s) {replaced} with new objects; initialise parameters in place "
        "(torch.nn.init functions, copy_()) so the sharded parameter is the one the "
        "model uses"
    )


#: What the materializer does with each shard it cuts: ``(index, shard) -> the tensor
#: the parameter holds`` (the shard itself, or an empty one when it was written out).
Keep = Callable[[int, torch.Tensor], torch.Tensor]


def _keep_in_memory(index: int, shard: torch.Tensor) -> torch.Tensor:
    return shard


def _range(numel: int, rank: int, world: int) -> tuple[int, int, int]:
    """(shard_numel, start, stop) of ``rank``'s elements, as ``ShardedParam`` cuts them."""
    shard_numel = -(-numel // world)
    start = min(rank * shard_numel, numel)
    return shard_numel, start, min(start + shard_numel, numel)


class Materializer:
    """Gives a model's meta parameters (with a checkpoint: all its parameters) their
    values straight into this rank's shards. ``ShardedModelState.create`` uses it once.

    Args:
        module: The root module.
        named: ``module.named_parameters()`` (shards are made in this order).
        config: Engine settings (persistence threshold, ``param_dtype``, sync).
        comm: The backend (rank, world size, device, the collectives that sync).
        param_init_fn: Called as ``param_init_fn(module)`` for each module instead of
            the module's ``reset_parameters()``.
        checkpoint: A ``checkpoint=`` path, or an open :class:`~zero3.core.WeightSource`.

    Attributes:
        active: Whether there is anything to do (a meta tensor, or a checkpoint).
        handled: Indices (in ``named``) of the parameters this produces; the others take
            the eager path.
    """

    def __init__(
        self,
        module: nn.Module,
        named: list[tuple[str, nn.Parameter]],
        config: Zero3Config,
        comm: CommBackend,
        *,
        param_init_fn: ParamInitFn | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.comm = comm
        self.param_init_fn = param_init_fn
        self.checkpoint = checkpoint
        self.source: WeightSource | None = None
        self.device = comm.device()
        names: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        offloaded = config.offload_param.moves_shards(self.device.type)
        self._targets = [
            _Target(
                index=index,
                names=names.get(id(param), [name]),
                param=param,
                dtype=config.param_dtype or param.dtype,
                persistent=is_persistent(
                    param.numel(), comm.world_size, config, offloaded=offloaded
                ),
            )
            for index, (name, param) in enumerate(named)
        ]
        self._buffers = self._collect_buffers()
        self.active = (
            checkpoint is not None
            or any(t.param.is_meta for t in self._targets)
            or any(b.tensor.is_meta for b in self._buffers)
        )
        if not self.active:
            self.handled: set[int] = set()
        elif checkpoint is not None:
            self.handled = {t.index for t in self._targets}
        else:
            self.handled = {t.index for t in self._targets if t.param.is_meta}
        self._post = _post_order(module)
        self._inits: dict[int, Callable[[], Any]] = {}
        self._sums: list[tuple[_Target, tuple[int, int]]] = []
        self._problems: list[str] = []
        self._keep: Keep = _keep_in_memory

    def _collect_buffers(self) -> list[_Buffer]:
        found: dict[int, _Buffer] = {}
        for prefix, mod in self.module.named_modules(remove_duplicate=False):
            for local, t in mod._buffers.items():
                if t is None:
                    continue
                name = f"{prefix}.{local}" if prefix else local
                persistent = local not in mod._non_persistent_buffers_set
                buf = found.setdefault(id(t), _Buffer(t, [], [], persistent))
                buf.names.append(name)
                buf.slots.append((mod, local))
        return list(found.values())

    # -- before any collective: decide, check, agree ------------------------------------------

    def prepare(self) -> None:
        """Open the checkpoint and check it against the model, or plan the initialisers;
        then agree with every rank, so a problem found anywhere raises everywhere before
        any parameter is touched.

        Raises:
            ValueError: Every problem found (missing / unexpected / mis-shaped checkpoint
                keys, parameters nothing initialises, buffers left on meta), at once.
            RuntimeError: Another rank failed to prepare.
        """
        if not self.active:
            return
        error: Exception | None = None
        try:
            self._plan()
        except Exception as exc:  # raised below, after every rank has heard of it
            error = exc
        failed = self._failed_ranks(error is not None)
        if error is not None:
            self.close()
            raise error
        if failed:
            self.close()
            raise RuntimeError(
                f"zero3: rank(s) {failed} could not prepare shard_module (the checkpoint or "
                "the initialisation; their error says why); no rank has started sharding"
            )

    def _failed_ranks(self, failed_here: bool) -> list[int]:
        world = self.comm.world_size
        if world == 1:
            return []
        flag = torch.tensor([1.0 if failed_here else 0.0], device=self.device)
        flags = torch.empty(world, device=self.device)
        self.comm.all_gather(flags, flag).wait()
        return [r for r in range(world) if flags[r] > 0 and r != self.comm.rank]

    def _plan(self) -> None:
        if self.checkpoint is not None and self.param_init_fn is not None:
            raise ValueError(
                "shard_module: give checkpoint= (load every parameter) or param_init_fn= "
                "(initialise meta parameters), not both"
            )
        problems: list[str] = []
        if self.checkpoint is not None:
            self.source = (
                self.checkpoint
                if isinstance(self.checkpoint, WeightSource)
                else open_weight_source(self.checkpoint)
            )
            problems += self._match_checkpoint(self.source)
        else:
            problems += self._plan_initialisers()
        stranded = [f"'{b.name}'" for b in self._buffers if b.tensor.is_meta and b.key is None]
        if stranded:
            problems.append(
                _listing("buffers on the meta device that nothing provides", stranded)
                + "\n    (build the model under zero3.hooks.empty_init(), which creates "
                "buffers for real, or pass a checkpoint= holding them; non-persistent "
                "buffers such as rotary inv_freq are never in checkpoints)"
            )
        if problems:
            what = type(self.module).__name__
            raise ValueError(f"zero3: cannot shard {what}:\n" + "\n".join(problems))

    def _match_checkpoint(self, source: WeightSource) -> list[str]:
        entries = source.entries()
        expected: set[str] = set()
        missing, shapes = [], []
        wanted: list[_Target | _Buffer] = [*self._targets, *self._buffers]
        for item in wanted:
            if isinstance(item, _Buffer) and not item.persistent:
                continue
            expected.update(item.names)
            present = [n for n in item.names if n in entries]
            if not present:
                missing.append(" / ".join(f"'{n}'" for n in item.names))
                continue
            shape = tuple(item.param.shape if isinstance(item, _Target) else item.tensor.shape)
            for key in present:
                stored = tuple(entries[key][0])
                if stored != shape:
                    shapes.append(f"'{key}': checkpoint {stored}, model {shape}")
            # A tied tensor stored under several of its names: torch's strict
            # load_state_dict copies each in module order, so the last name's value wins.
            item.key = present[-1]
        unexpected = sorted(f"'{k}'" for k in set(entries) - expected)
        if not (missing or unexpected or shapes):
            return []
        lines = [
            f"checkpoint {source.describe()!r} does not match the model (its keys must be "
            "the unsharded model's state_dict() keys; tied weights need one of their names):"
        ]
        for kind, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape mismatch", shapes),
        ):
            if items:
                lines.append(_listing(kind, items))
        hint = _conversion_hint(self.module) if (missing or unexpected) else None
        if hint is not None:
            lines.append("  " + hint)
        return ["\n".join(lines)]

    def _plan_initialisers(self) -> list[str]:
        """The dry run of the module Note: who touches which meta parameter."""
        targets = [t for t in self._targets if t.index in self.handled]
        if not targets:
            return []
        watched = {id(t.param): t for t in targets}
        by_index = {t.index: t for t in targets}
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=[]),
            _real_tensors_on_meta(self.module),
        ):
            for pos, (name, mod) in enumerate(self._post):
                init = _initializer(mod, self.param_init_fn)
                if init is None:
                    continue
                touched = self._dry_run(name, mod, init, watched)
                if touched:
                    self._inits[pos] = init
                for index in touched:
                    target = by_index[index]
                    target.first = pos if target.first < 0 else target.first
                    target.last = pos
        lonely = [t for t in targets if t.first < 0]
        if self._problems or not lonely:
            return self._problems
        how = (
            "param_init_fn touched none of them"
            if self.param_init_fn is not None
            else "their modules define no reset_parameters() / _reset_parameters(); pass "
            "param_init_fn= (for transformers models: param_init_fn=model._init_weights)"
        )
        owners = {
            id(p): type(m).__name__ for m in self.module.modules() for p in m._parameters.values()
        }
        return [
            _listing(
                "parameters on the meta device that nothing initialises",
                [f"'{t.name}' ({owners.get(id(t.param), '?')})" for t in lonely],
            )
            + f"\n    ({how}; or pass checkpoint=)"
        ]

    def _dry_run(
        self, name: str, mod: nn.Module, init: Callable[[], Any], watched: Mapping[int, _Target]
    ) -> set[int]:
        recorder = _TouchRecorder(watched)
        before = [(m, dict(m._parameters)) for m in mod.modules()]
        try:
            with recorder:
                init()
        except Exception as exc:
            subtree = {watched[id(p)].index for p in mod.parameters() if id(p) in watched}
            _log.warning(
                "zero3: the initialiser of module %r (%s) cannot run on the meta device "
                "(%s: %s); assuming it touches every parameter under it, which keeps %d "
                "parameters whole until it has run",
                name or "<root>",
                type(mod).__name__,
                type(exc).__name__,
                exc,
                len(subtree),
            )
            return subtree
        finally:
            for m, params in before:
                replaced = [k for k, v in m._parameters.items() if params.get(k) is not v]
                if replaced:
                    self._problems.append(_replaced_message(name, mod, replaced))
                    m._parameters.clear()
                    m._parameters.update(params)
        return recorder.touched

    def eager_buffers(self) -> list[torch.Tensor]:
        """Real buffers the checkpoint does not provide (synced like eager parameters)."""
        return [b.tensor for b in self._buffers if b.key is None and not b.tensor.is_meta]

    # -- the work -----------------------------------------------------------------------------

    def run(self, keep: Keep | None = None) -> dict[int, torch.Tensor]:
        """Materialize every handled parameter; return the shards of the sharded ones.

        Persistent parameters (in a world of one all of them, unless parameter offload
        moves them) come back whole in the parameter itself; the others hold no bytes
        (their class says they are released) and their shard is returned by index:
        ``keep(index, shard)`` if given, called as each shard is cut (parameter offload
        writes it out there and returns an empty tensor, so the offloaded shards never
        pile up in memory).
        """
        shards: dict[int, torch.Tensor] = {}
        if not self.active:
            return shards
        self._keep = keep or _keep_in_memory
        try:
            if self.source is not None:
                self._load_all(self.source, shards)
            else:
                self._initialise_all(shards)
        finally:
            self.close()
        return shards

    def close(self) -> None:
        """Close the checkpoint if this opened it."""
        if self.source is not None and self.source is not self.checkpoint:
            self.source.close()
        self.source = None

    def _load_all(self, source: WeightSource, shards: dict[int, torch.Tensor]) -> None:
        for t in self._targets:
            assert t.key is not None  # _match_checkpoint found every key
            numel = t.param.numel()
            if t.persistent:
                full = torch.empty(t.param.shape, dtype=t.dtype, device=self.device)
                full.view(-1).copy_(source.read_flat(t.key, 0, numel))
                self._give(t, full)
            else:
                shard_numel, start, stop = _range(numel, self.comm.rank, self.comm.world_size)
                shard = torch.empty(shard_numel, dtype=t.dtype, device=self.device)
                if stop > start:
                    shard[: stop - start].copy_(source.read_flat(t.key, start, stop))
                shard[stop - start :].zero_()
                shards[t.index] = self._keep(t.index, shard)
                self._give(t, None)
            trim_heap()
        for b in self._buffers:
            if b.key is None:
                continue
            data = source.read_flat(b.key, 0, b.tensor.numel()).view(b.tensor.shape)
            if b.tensor.is_meta:
                fresh = torch.empty(b.tensor.shape, dtype=b.tensor.dtype, device=self.device)
                fresh.copy_(data)
                for mod, local in b.slots:
                    mod._buffers[local] = fresh
                b.tensor = fresh
            else:
                b.tensor.copy_(data)

    def _give(self, t: _Target, full: torch.Tensor | None) -> None:
        """Put ``full`` into the parameter (same object; ``None``: a released parameter of
        the full shape with no bytes).
        """
        if full is None:
            # Never written, so never resident: the storage is dropped at once.
            full = torch.empty(t.param.shape, dtype=t.dtype, device=self.device)
            full.untyped_storage().resize_(0)
        param = t.param
        if not param.is_meta:
            param.data = full  # a real parameter loaded from the checkpoint
        else:
            cls, attrs = type(param), dict(param.__dict__)
            try:
                fresh = nn.Parameter(full, requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, fresh)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"zero3: cannot give the meta parameter {t.name!r} its data in place "
                    f"({exc}); drop weak references and views of it before shard_module"
                ) from exc
            if type(param) is not cls:
                param.__class__ = cls
            param.__dict__.update(attrs)
        if full.untyped_storage().nbytes() == 0 and full.numel():
            dress_released(param)

    def _initialise_all(self, shards: dict[int, torch.Tensor]) -> None:
        starting: dict[int, list[_Target]] = {}
        ending: dict[int, list[_Target]] = {}
        for t in self._targets:
            if t.index in self.handled:
                starting.setdefault(t.first, []).append(t)
                ending.setdefault(t.last, []).append(t)
        for pos, (name, mod) in enumerate(self._post):
            for t in starting.get(pos, []):
                self._give(t, torch.empty(t.param.shape, dtype=t.param.dtype, device=self.device))
            init = self._inits.get(pos)
            if init is not None:
                self._call(name, mod, init)
            if pos in ending:
                self._finish(ending[pos], shards)
                trim_heap()
        if self._sums:
            self._check_consistent()

    def _call(self, name: str, mod: nn.Module, init: Callable[[], Any]) -> None:
        before = dict(mod._parameters)
        what = f"module {name or '<root>'!r} ({type(mod).__name__})"
        try:
            init()
        except RuntimeError as exc:
            if "partitioned across ranks" not in str(exc):
                raise
            raise RuntimeError(
                f"zero3: initialising {what} touched a parameter that was already sharded "
                f"after its own initialiser ran ({exc})"
            ) from exc
        replaced = [k for k, v in mod._parameters.items() if before.get(k) is not v]
        if replaced:
            raise RuntimeError("zero3: " + _replaced_message(name, mod, replaced).strip())

    def _finish(self, targets: list[_Target], shards: dict[int, torch.Tensor]) -> None:
        """Parameters whose last initialiser has run: sync or check them, cut the shards,
        free the full tensors.
        """
        rank, world = self.comm.rank, self.comm.world_size
        for t in targets:
            if t.param.dtype != t.dtype:
                t.param.data = t.param.data.to(t.dtype)
        if world > 1 and self.config.sync_module_states:
            broadcast_from_rank0(self.comm, [t.param.detach() for t in targets])
        elif world > 1:
            self._sums += [(t, checksum(t.param)) for t in targets]
        for t in targets:
            if t.persistent:
                continue
            shard_numel, start, stop = _range(t.param.numel(), rank, world)
            shard = torch.empty(shard_numel, dtype=t.dtype, device=self.device)
            shard[: stop - start].copy_(t.param.detach().reshape(-1)[start:stop])
            shard[stop - start :].zero_()
            shards[t.index] = self._keep(t.index, shard)
            t.param.untyped_storage().resize_(0)
            dress_released(t.param)

    def _check_consistent(self) -> None:
        """With ``sync_module_states=False``: every rank must have initialised the same
        values (one all-gather of two integers per parameter).
        """
        differ = differing_across_ranks(self.comm, [s for _, s in self._sums])
        bad = [f"'{t.name}'" for (t, _), d in zip(self._sums, differ, strict=True) if d]
        if bad:
            raise ValueError(
                "zero3: ranks initialised meta parameters differently and "
                "Zero3Config.sync_module_states is False, so nothing makes them agree:\n"
                + _listing("parameters that differ between ranks", bad)
                + "\n    Seed every rank the same way before building the model, or leave "
                "sync_module_states=True (rank 0's values are broadcast)."
            )


def differing_across_ranks(comm: CommBackend, sums: list[tuple[int, int]]) -> list[bool]:
    """Which of this rank's :func:`checksum` values differ on some rank (the same answer
    on every rank: one all-gather of two integers per tensor).
    """
    device = comm.device()
    mine = torch.tensor([list(s) for s in sums], dtype=torch.int64).reshape(len(sums), 2)
    every = torch.empty((comm.world_size, *mine.shape), dtype=torch.int64, device=device)
    comm.all_gather(every, mine.to(device)).wait()
    every = every.cpu()
    return [bool(d) for d in (every != every[0]).any(dim=2).any(dim=0).tolist()]


def check_eager_agree(comm: CommBackend, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """With ``sync_module_states=False``, ordinary (not meta) parameters are sharded from
    each rank's own values: they must be equal on every rank, or every full parameter
    would be rank 0's part glued to rank 1's part and so on.

    Raises:
        ValueError: On every rank, naming the parameters that differ.
    """
    if comm.world_size == 1 or not named:
        return
    differ = differing_across_ranks(comm, [checksum(t) for _, t in named])
    bad = [f"'{name}'" for (name, _), d in zip(named, differ, strict=True) if d]
    if bad:
        raise ValueError(
            "zero3: the ranks' parameters differ and Zero3Config.sync_module_states is False, "
            "so nothing makes them agree (each full parameter would be pieced together from "
            "every rank's part of its own values):\n"
            + _listing("parameters that differ between ranks", bad)
            + "\n    Seed every rank the same way (torch.manual_seed) before building the "
            "model, load the same weights on every rank, or leave sync_module_states=True "
            "(rank 0's values are broadcast)."
        )
