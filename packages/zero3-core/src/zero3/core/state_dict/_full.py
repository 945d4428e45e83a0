"""Full (unsharded) state dicts of a sharded module: gathered module by module."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn

from zero3.core._api import gathered_parameters
from zero3.core.diag._guard import OpKind
from zero3.core.model._state import sharded_state
from zero3.core.params._params import lookup

__all__ = ["LoadResult", "full_state_dict", "load_full_state_dict", "state_dict_entries"]


def state_dict_entries(root: nn.Module) -> Iterator[tuple[str, nn.Module, torch.Tensor]]:
    """``(key, owning module, tensor)`` for every entry of ``root.state_dict()``.

    Tied parameters appear under every name, as in ``state_dict()``; non-persistent
    buffers are left out.
    """
    for prefix, module in root.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in dict.items(module._parameters):
            if param is not None:
                yield dot + name, module, param
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield dot + name, module, buf


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a sharded module, gathered module by module.

    A collective: every rank must call it. Peak extra memory is one module's
    parameters. Keys equal those of the unsharded model's ``state_dict()``; values are
    CPU copies.

    Args:
        module: A module returned by ``zero3.hooks.shard_module``.
        rank0_only: Only rank 0 keeps the tensors (the others return ``{}``, having
            taken part in the gathers).
    """
    state = sharded_state(module)
    state.synchronize()  # pending edits and rank 0's buffers first: every rank alike
    keep = not rank0_only or state.comm.rank == 0
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    by_module: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for key, mod, tensor in state_dict_entries(module):
        by_module.setdefault(id(mod), []).append((key, tensor))
    for entries in by_module.values():
        with gathered_parameters([t for _, t in entries if isinstance(t, nn.Parameter)]):
            for key, tensor in entries:
                if keep:
                    if id(tensor) not in copies:
                        copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
                    out[key] = copies[id(tensor)]
    return out


class LoadResult(NamedTuple):
    """Keys a state-dict load could not match."""

    #: Keys of the model that the state dict lacks.
    missing_keys: list[str]
    #: Keys of the state dict that the model lacks.
    unexpected_keys: list[str]


def match_keys(
    module: nn.Module,
    state_dict: Mapping[str, object],
    strict: bool,
    caller: str,
    error: type[Exception],
) -> tuple[dict[str, torch.Tensor], LoadResult]:
    """The module's ``state_dict()`` entries by key, and the keys ``state_dict`` lacks or
    adds; with ``strict``, any of those raise ``error`` naming them (``caller`` first).
    """
    expected = {key: tensor for key, _, tensor in state_dict_entries(module)}
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise error(f"{caller}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
    return expected, LoadResult(missing, unexpected)


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> LoadResult:
    """Load a full (unsharded) state dict into a sharded module.

    A collective: every rank calls it, each with the full state dict (loaded with
    ``mmap=True`` it costs little memory); each rank writes its own shard of every
    parameter (and the fp32 master, if an optimizer exists) from the full tensors, and
    persistent or gathered parameters whole. A call on some ranks only raises on every
    rank instead of leaving a model half loaded.

    Raises:
        RuntimeError: With ``strict``, missing or unexpected keys; always, a shape
            mismatch (naming the key and both shapes).
    """
    state = sharded_state(module)  # a clear error for a module that is not sharded
    state.agree(OpKind.LOAD)  # a collective: a rank that skips it fails every rank now
    expected, result = match_keys(module, state_dict, strict, "load_full_state_dict", RuntimeError)
    with torch.no_grad():
        for key, target in expected.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if tuple(value.shape) != tuple(target.shape):
                raise RuntimeError(
                    f"load_full_state_dict: {key!r} has shape {tuple(value.shape)} in the state "
                    f"dict but {tuple(target.shape)} in the model"
                )
            sp = lookup(target)
            if sp is None:
                target.copy_(value)
                continue
            state.write_full(sp, value.reshape(-1).to(device=sp.device, dtype=sp.dtype))
    return result
