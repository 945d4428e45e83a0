"""Walking the nested containers modules return (tuples, dicts, dataclasses, ModelOutput)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_tensors", "map_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (tuples, lists, mappings, dataclasses), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, tuple | list):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``.

    Tuples, named tuples, lists and plain dicts are rebuilt. Other mappings
    (transformers' ``ModelOutput``, an ``OrderedDict`` subclass that also keeps each
    item as an attribute) and mutable dataclasses are updated in place, since
    rebuilding them would rerun their constructors; frozen dataclasses are replaced.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(item, fn) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_tensors(item, fn) for item in obj]
    if type(obj) is dict:
        return {key: map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, Mapping):
        for key, value in list(obj.items()):
            new = map_tensors(value, fn)
            if new is not value:
                obj[key] = new  # type: ignore[index]
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            new = map_tensors(value, fn)
            if new is not value:
                changes[field.name] = new
        if not changes:
            return obj
        params = getattr(type(obj), "__dataclass_params__", None)
        if params is not None and params.frozen:
            return dataclasses.replace(obj, **changes)
        for name, value in changes.items():
            setattr(obj, name, value)
        return obj
    return obj
