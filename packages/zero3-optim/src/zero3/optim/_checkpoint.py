"""save_checkpoint / load_checkpoint: sharded, resharding, async and atomic, on DCP.

Every rank writes into a hidden sibling directory through DCP; rank 0 then swaps it into
place with one atomic rename exchange (two renames where the filesystem has none), so a
crash leaves the previous checkpoint or the new one, never a mix. An async save stages a
CPU copy of this rank's share before it returns and writes from DCP's own gloo group in
the background. docs/checkpoints.rst, "Atomic publication" and "Async saves".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import threading
import uuid
import zlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from zero3.core import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from zero3.core import load_sharded_state_dict as load_model_state
from zero3.core.engine import (
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_LAYOUT,
    CheckpointLoadPlanner,
    CheckpointReader,
    CheckpointSavePlanner,
    CheckpointStorageWriter,
    DeferredTensor,
    DiskSnapshot,
    checkpoint_group,
    clone_state_dict,
    quiet_dcp_warnings,
    raise_on_every_rank,
    sharded_param,
    sharded_state,
    streamed_sharded_state_dict,
)
from zero3.optim._optimizer import PartitionedOptimizer, StreamedLoad

__all__ = ["load_checkpoint", "save_checkpoint"]

_log = logging.getLogger("zero3.optim")
_L = CHECKPOINT_LAYOUT
_SAVING = ".zero3-saving-"
_OLD = ".zero3-old-"
_DCP_FILES = (".metadata", ".distcp", "zero3-checksums.json")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100

_lock = threading.Lock()
_pending: list[Future[Path]] = []
_executor: ThreadPoolExecutor | None = None
_warned_no_exchange = False


# -- public API -----------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: PartitionedOptimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
) -> Future[Path] | None:
    """Save a sharded checkpoint of ``module`` (and ``optimizer``) that loads at any world
    size. A collective: every rank calls it, between optimizer steps.

    Each rank writes only its own shards (at most one tensor's extra memory); the
    directory is published atomically once every rank has finished (see the module
    note), replacing the previous checkpoint at ``path``.

    Args:
        path: The checkpoint directory (created or replaced). An existing directory
            must be a checkpoint (or empty): anything else is refused, not deleted.
        module: A module returned by ``zero3.hooks.shard_module``.
        optimizer: Its :class:`PartitionedOptimizer`, saved with it.
        extra: Your own state: a dict of tensors and plain values (numbers, strings,
            None, and lists/dicts of those), e.g. the step, the data position, RNG
            states. A key saved by several ranks is kept once, so such values must be
            equal on every rank (per-rank values go under per-rank keys); loading
            returns it without unpickling code.
        async_save: Return with a future once this rank's state is copied (what is
            in memory to memory, offloaded state to a snapshot file beside ``path``),
            while the files are written in the background (training may go on); the
            future's result is the path.

    Returns:
        None, or with ``async_save`` a ``Future`` that resolves once the checkpoint
        is published (its exception, if the save failed, is also logged).

    Raises:
        CheckpointError: The save failed (every rank raises it).
        TypeError: ``extra`` holds something other than tensors and plain values.
        ValueError: A value of ``extra`` differs between ranks under the same key.
    """
    state = sharded_state(module)  # a clear error for a module that is not sharded
    _check_optimizer(module, optimizer)
    wait_for_pending_saves()
    # Pending in-place edits and rank 0's buffers first: whole tensors are saved once,
    # from whichever rank DCP picks, so they must be equal everywhere.
    state.synchronize()
    target = _target(path)
    group = checkpoint_group(module)
    rank = dist.get_rank(group) if group is not None else 0
    error: BaseException | None = None
    try:
        _check_extra(extra, "extra")
        _check_replaceable(target)
    except (TypeError, CheckpointError) as exc:
        error = exc
    raise_on_every_rank(group, error)
    _check_replicated(group, extra or {})
    if rank == 0:  # before the staging name's broadcast: no rank has made anything yet
        _remove_stale(target)
    staging = _staging_dir(group, target, rank)
    # Offloaded parameter shards and optimizer records are read as they are written
    # (one at a time), not all first.
    model_sd, deferred = streamed_sharded_state_dict(module)
    sd: dict[str, Any] = {
        _L.info: {"format_version": CHECKPOINT_FORMAT_VERSION, "info": _info(module, optimizer)},
        _L.model: model_sd,
        _L.extra: _copy_plain(dict(extra or {})),
    }
    later: dict[tuple[str, ...], DeferredTensor] = {(_L.model, k): v for k, v in deferred.items()}
    if optimizer is not None:
        sd[_L.optim], optim_deferred = optimizer.streamed_sharded_state_dict()
        later.update({(_L.optim, *k): v for k, v in optim_deferred.items()})
    writer = CheckpointStorageWriter(staging, file_per_item=bool(later))
    if not async_save:
        planner = CheckpointSavePlanner(later)
        with _failures("cannot save checkpoint", target), quiet_dcp_warnings():
            dcp_save(
                sd, storage_writer=writer, planner=planner, process_group=group,
                no_dist=group is None,
            )  # fmt: skip
        _publish_everywhere(group, rank, staging, target)
        return None
    # Training goes on while an async save writes: it writes a copy taken now, the
    # in-memory state copied to memory and the offloaded state to a snapshot file.
    snapshot, taken = _take_snapshot(group, rank, staging, target, later)
    try:
        keep = frozenset(e.placeholder.untyped_storage().data_ptr() for e in later.values())
        staged = clone_state_dict(sd, keep)
        del sd  # staged: the live tensors may change from here on
        planner = CheckpointSavePlanner(taken)
        future = _background().submit(
            _finish_async, staged, writer, planner, group, rank, staging, target, snapshot
        )
    except BaseException:
        if snapshot is not None:
            snapshot.close()
        raise
    future.add_done_callback(_log_failure)
    with _lock:
        _pending.append(future)
    return future


def load_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: PartitionedOptimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, at any world size.

    A collective: every rank calls it. Each rank reads only the pieces of its own
    shards (plus the whole of persistent parameters and buffers), then the optimizer's
    masters are written back into the model. Load into a freshly built model and
    optimizer (or ones to overwrite); the optimizer may be None to load weights only.

    Errors derive from :class:`~zero3.core.CheckpointError` (an ``Exception``), start
    with what is wrong, name the path, and are raised on every rank.

    Returns:
        The ``extra`` dict saved with the checkpoint (``{}`` if none): tensors and
        plain values, loaded without unpickling code.

    Raises:
        CheckpointNotFoundError: Nothing at ``path``.
        IncompleteCheckpointError: The save that wrote it did not finish.
        CorruptCheckpointError: A truncated or altered file.
        CheckpointVersionError: Another zero3 checkpoint format, or not zero3's.
        CheckpointMismatchError: A checkpoint of another model (missing or unexpected
            keys, other shapes) or optimizer layout.
    """
    sharded_state(module)
    _check_optimizer(module, optimizer)
    wait_for_pending_saves()
    target = Path(path)
    group = checkpoint_group(module)
    template: dict[str, Any] = {}
    later: dict[tuple[str, ...], DeferredTensor] = {}
    incoming: StreamedLoad | None = None
    reader: CheckpointReader | None = None
    error: BaseException | None = None
    try:
        reader = _open(target)
        # Offloaded parameter shards are written to their file as each comes in whole.
        template[_L.model], deferred = streamed_sharded_state_dict(
            module, update_masters=optimizer is None
        )
        later = {(_L.model, k): v for k, v in deferred.items()}
        with quiet_dcp_warnings():
            _check_model(reader, template[_L.model])
        template[_L.extra] = reader.template(_L.extra)
        if optimizer is not None:
            if not reader.section_keys(_L.optim):
                raise CheckpointMismatchError(
                    f"no optimizer state in checkpoint {target}: it was saved without "
                    "optimizer=; load it with optimizer=None (weights only)"
                )
            _check_optimizer_class(reader, optimizer)
            # Offloaded records are filled and written one at a time (not read first).
            incoming = optimizer.streamed_load(reader)
            template[_L.optim] = incoming.template
            later.update({(_L.optim, *k): v for k, v in incoming.deferred.items()})
    except CheckpointError as exc:
        error = exc
    raise_on_every_rank(group, error)
    assert reader is not None
    planner = CheckpointLoadPlanner(later)
    with _failures("cannot load checkpoint", target), quiet_dcp_warnings():
        dcp_load(
            template,
            storage_reader=reader.storage,
            planner=planner,
            process_group=group,
            no_dist=group is None,
        )
    unfilled = planner.unfilled()  # offloaded entries the checkpoint did not cover whole
    raise_on_every_rank(
        group,
        CorruptCheckpointError(
            f"corrupted checkpoint {target}: {unfilled[:3]} not read whole (its index "
            "does not cover them)"
        )
        if unfilled
        else None,
    )
    # With an optimizer, its saved fp32 masters (loaded next) win over the rounded values.
    # The deferred entries are in the model already (and their placeholders hold nothing).
    loaded = {k: v for k, v in template[_L.model].items() if k not in deferred}
    load_model_state(module, loaded, strict=not deferred, update_masters=optimizer is None)
    if incoming is not None:
        incoming.finish()
    extra = template[_L.extra]
    return dict(extra) if isinstance(extra, Mapping) else {}


def wait_for_pending_saves() -> None:
    """Block until this process's async saves have finished (failures were logged)."""
    with _lock:
        pending = list(_pending)
        _pending.clear()
    for future in pending:
        with contextlib.suppress(Exception):
            future.result()


# -- checks ---------------------------------------------------------------------------------


def _check_optimizer(module: nn.Module, optimizer: PartitionedOptimizer | None) -> None:
    if optimizer is not None and optimizer.module is not module:
        raise ValueError(
            "the optimizer steps another module's parameters: pass the module it was built "
            "for (PartitionedOptimizer(module, ...))"
        )


def _check_optimizer_class(reader: CheckpointReader, optimizer: PartitionedOptimizer) -> None:
    """Another optimizer's state (AdamW's moments into SGD) would load without complaint
    and fail inside torch at the next step (``KeyError: 'momentum'``), so refuse it here.
    """
    saved = reader.info.get("optimizer")
    here = type(optimizer.optimizer).__name__
    if isinstance(saved, str) and saved != here:
        raise CheckpointMismatchError(
            f"checkpoint {reader.path} holds the state of a {saved} optimizer, but this "
            f"PartitionedOptimizer wraps {here}: its state and hyperparameters do not fit. "
            f"Build PartitionedOptimizer(model, {saved}, ...) to resume that run, or load "
            "the weights alone with load_checkpoint(path, model, None) and start the "
            f"{here} optimizer fresh"
        )


_PLAIN = (bool, int, float, str, type(None))


def _check_extra(value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
            raise TypeError(
                f"save_checkpoint: {where} is a {type(value).__name__}; extra holds plain "
                "tensors (a sharded tensor belongs in the model or optimizer)"
            )
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"save_checkpoint: {where} has the key {key!r} of type "
                    f"{type(key).__name__}; extra's dict keys must be strings"
                )
            _check_extra(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_extra(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"save_checkpoint: {where} is a {type(value).__name__}; extra holds tensors and "
            "plain values only (numbers, strings, None, lists and dicts of those), so that "
            "loading it never unpickles code. Convert it (e.g. numpy arrays to tensors)."
        )


def _leaves(value: Any, path: str, out: dict[str, str]) -> dict[str, str]:
    """``{path: digest}`` of every leaf of ``extra`` (to compare ranks cheaply)."""
    if isinstance(value, torch.Tensor):
        # Flat first: view() cannot reinterpret a 0-dim tensor's bytes (a step counter).
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[path] = f"{value.dtype}{tuple(value.shape)}:{zlib.crc32(data):08x}"
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _leaves(item, f"{path}[{key!r}]", out)
    elif isinstance(value, list | tuple) and any(
        isinstance(v, torch.Tensor | Mapping | list | tuple) for v in value
    ):
        for i, item in enumerate(value):
            _leaves(item, f"{path}[{i}]", out)
    else:
        out[path] = repr(value)
    return out


def _check_replicated(group: dist.ProcessGroup | None, extra: Mapping[str, Any]) -> None:
    """DCP keeps one copy of a key saved by several ranks: such values must agree."""
    if group is None:
        return
    mine = _leaves(extra, "extra", {})
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for path, digest in mine.items():
        for rank, theirs in enumerate(everyone):
            if path in theirs and theirs[path] != digest:
                raise ValueError(
                    f"save_checkpoint: {path} differs between ranks (here rank "
                    f"{dist.get_rank(group)}, and rank {rank}); a checkpoint keeps one copy of "
                    "each key, so give per-rank values per-rank keys (e.g. "
                    "extra[f'rng_rank{rank}'])"
                )


def _copy_plain(value: Any) -> Any:
    """Copy ``extra``'s containers (tensors are staged by DCP; values are immutable)."""
    if isinstance(value, Mapping):
        return {k: _copy_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_plain(v) for v in value)
    return value


def _info(module: nn.Module, optimizer: PartitionedOptimizer | None) -> dict[str, Any]:
    aliases = []
    for name, param in module.named_parameters(remove_duplicate=False):
        sp = sharded_param(param)
        if sp is not None and sp.name != name:
            aliases.append([name, sp.name])
    cls = type(module)
    return {
        "world_size": sharded_state(module).comm.world_size,
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "hf_config": _hf_config(module),
        "aliases": aliases,
        "optimizer": type(optimizer.optimizer).__name__ if optimizer is not None else None,
    }


def _hf_config(module: nn.Module) -> str | None:
    """The model's transformers config as ``config.json`` text, when it has one."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    data = json.loads(to_json())
    if not data.get("architectures"):
        data["architectures"] = [type(module).__name__]
    return json.dumps(data, indent=2, sort_keys=True)


def _check_model(reader: CheckpointReader, model_sd: Mapping[str, Any]) -> None:
    saved = {
        key: tuple(reader.metadata.state_dict_metadata[_L.fqn(_L.model, key)].size)  # type: ignore[union-attr]
        for key in reader.section_keys(_L.model)
    }
    expected = {key: tuple(value.size()) for key, value in model_sd.items()}
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k}: {saved[k]} saved, {v} here" for k, v in expected.items() if saved.get(k, v) != v
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:5]} ({len(missing)} in all)")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:5]} ({len(unexpected)} in all)")
        if shapes:
            parts.append(f"other shapes: {'; '.join(shapes[:5])}")
        raise CheckpointMismatchError(
            f"checkpoint of another model at {reader.path} ({reader.info.get('model_class')}): "
            + ", ".join(parts)
        )


def _open(target: Path) -> CheckpointReader:
    if not os.path.lexists(target):
        moved = sorted(target.parent.glob(f".{target.name}{_OLD}*"))
        if moved:
            raise CheckpointNotFoundError(
                f"no checkpoint at {target}: a save was interrupted while replacing it, and "
                f"the previous checkpoint is at {moved[-1]} (move it back to load it)"
            )
    return CheckpointReader(target)


# -- publishing -------------------------------------------------------------------------------


def _target(path: str | os.PathLike[str]) -> Path:
    target = Path(path).absolute()
    return target.resolve() if target.is_symlink() else target


def _check_replaceable(target: Path) -> None:
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise CheckpointError(
            f"cannot save checkpoint to {target}: a file is in the way (not a directory)"
        )
    strangers = [p.name for p in target.iterdir() if not p.name.endswith(_DCP_FILES)]
    if strangers:
        raise CheckpointError(
            f"cannot save checkpoint to {target}: the directory holds files that are not "
            f"part of a checkpoint ({sorted(strangers)[:5]}); refusing to replace it"
        )


def _staging_dir(group: dist.ProcessGroup | None, target: Path, rank: int) -> Path:
    name = [f".{target.name}{_SAVING}{uuid.uuid4().hex[:12]}" if rank == 0 else None]
    if group is not None:
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    assert name[0] is not None
    return target.parent / name[0]


def _remove_stale(target: Path) -> None:
    """Delete what interrupted saves left beside ``target`` (rank 0, before a save)."""
    for pattern in (f".{target.name}{_SAVING}*", f".{target.name}{_OLD}*"):
        for stale in target.parent.glob(pattern):
            _log.info("zero3: removing %s, left by an interrupted save", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries; False where the system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(staging: Path, target: Path) -> None:
    global _warned_no_exchange
    if not os.path.lexists(target):
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # the previous checkpoint, swapped out
    else:
        if not _warned_no_exchange:
            _log.warning(
                "zero3: this filesystem cannot swap directories atomically (renameat2 "
                "RENAME_EXCHANGE); checkpoints at %s are replaced in two renames",
                target,
            )
            _warned_no_exchange = True
        old = staging.with_name(staging.name.replace(_SAVING, _OLD))
        os.rename(target, old)
        os.rename(staging, target)
        shutil.rmtree(old)
    _fsync_dir(target.parent)


def _publish_everywhere(
    group: dist.ProcessGroup | None, rank: int, staging: Path, target: Path
) -> None:
    error: BaseException | None = None
    if rank == 0:
        try:
            _publish(staging, target)
        except OSError as exc:
            error = CheckpointError(
                f"cannot publish checkpoint {target}: {exc} (the finished save is at {staging})"
            )
    raise_on_every_rank(group, error)


# -- async ------------------------------------------------------------------------------------


def _background() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-checkpoint")
        return _executor


def _take_snapshot(
    group: dist.ProcessGroup | None,
    rank: int,
    staging: Path,
    target: Path,
    later: Mapping[tuple[str, ...], DeferredTensor],
) -> tuple[DiskSnapshot | None, dict[tuple[str, ...], DeferredTensor]]:
    """Copy the offloaded state an async save writes to a snapshot file beside the
    staging directory (so an interrupted save's is removed with it); the entries that
    read it. Every rank raises if some rank could not write its own (every rank takes
    part, also one with nothing offloaded: a rank may hold no element of a parameter).
    """
    directory = staging.parent / f"{staging.name}-snapshot-rank{rank}"
    snapshot: DiskSnapshot | None = None
    taken: dict[tuple[str, ...], DeferredTensor] = {}
    error: BaseException | None = None
    need = sum(e.placeholder.numel() * e.placeholder.element_size() for e in later.values())
    try:
        if later:
            snapshot = DiskSnapshot(directory)
            free = shutil.disk_usage(directory).free
            if free < need:  # refused before anything is written
                raise OSError(errno.ENOSPC, f"{free} bytes free", str(directory))
            taken = dict(snapshot.take(later))
    except Exception as exc:  # a full disk, or a swap file that cannot be read back
        if snapshot is not None:
            snapshot.close()
            snapshot = None
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
        error = CheckpointError(
            f"cannot save checkpoint {target}: rank {rank} could not copy its offloaded "
            f"state ({need} bytes) to {directory} for an async save ({exc}). "
            + ("Free that much space there, or save" if full else "Save")
            + " with async_save=False (it reads the swap files as it writes)"
        )
    try:
        raise_on_every_rank(group, error)
    except BaseException:
        if snapshot is not None:
            snapshot.close()
        raise
    return snapshot, taken


def _finish_async(
    staged: dict[str, Any],
    writer: CheckpointStorageWriter,
    planner: CheckpointSavePlanner,
    group: dist.ProcessGroup | None,
    rank: int,
    staging: Path,
    target: Path,
    snapshot: DiskSnapshot | None,
) -> Path:
    """Write an async save's staged copy (on the checkpoint thread) and publish it."""
    try:
        # No quiet_dcp_warnings here: warnings.catch_warnings swaps the process-wide
        # filters, which training's thread uses meanwhile.
        with _failures("cannot save checkpoint", target):
            dcp_save(
                staged, storage_writer=writer, planner=planner, process_group=group,
                no_dist=group is None,
            )  # fmt: skip
    finally:
        if snapshot is not None:
            snapshot.close()
    _publish_everywhere(group, rank, staging, target)
    return target


def _log_failure(future: Future[Path]) -> None:
    exc = future.exception()
    if exc is not None:
        _log.error("zero3: async checkpoint save failed: %s", exc)


# -- DCP's failures as zero3's errors ---------------------------------------------------------


@contextlib.contextmanager
def _failures(what: str, target: Path) -> Any:
    """DCP's ``CheckpointException`` (a ``BaseException`` listing ranks and tracebacks)
    and torch.distributed errors become one :class:`~zero3.core.CheckpointError` on every rank.
    """
    try:
        yield
    except CheckpointException as exc:
        raise _first_failure(what, target, exc) from None
    except RuntimeError as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{what} {target}: {line}") from exc


def _first_failure(what: str, target: Path, exc: CheckpointException) -> CheckpointError:
    rank, (cause, _) = sorted(exc.failures.items())[0]
    if isinstance(cause, CheckpointError):
        try:
            return type(cause)(f"{cause} (rank {rank})")
        except Exception:
            return CheckpointError(f"{cause} (rank {rank})")
    line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return CheckpointError(f"{what} {target}: rank {rank}: {type(cause).__name__}: {line}")
