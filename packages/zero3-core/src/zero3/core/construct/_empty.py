"""empty_init: build a model whose parameters take no memory until it is sharded.

On a meta tensor an in-place fill (``normal_``, ``nn.init.*``) writes nothing, but torch
has no C++ meta kernel for ``normal_``: its first call imports torch's Python meta
registrations in every process (:ref:`fact-meta-fill`). Inside
:func:`empty_init`, and in the initialisers' dry run, a ``TorchFunctionMode`` answers such
fills on meta tensors by returning the tensor untouched, which is what the kernel does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

__all__ = ["SkipMetaFills", "empty_init"]

_T: Any = torch.Tensor
#: In-place fills that only write values (shape, dtype and device stay).
_FILLS: frozenset[Callable[..., Any]] = frozenset(
    {
        _T.normal_, _T.uniform_, _T.fill_, _T.zero_, _T.random_, _T.exponential_,
        _T.log_normal_, _T.cauchy_, _T.geometric_, _T.bernoulli_,
        nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.constant_,
        nn.init.ones_, nn.init.zeros_, nn.init.eye_, nn.init.dirac_, nn.init.xavier_uniform_,
        nn.init.xavier_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
        nn.init.orthogonal_, nn.init.sparse_,
    }
)  # fmt: skip


class SkipMetaFills(TorchFunctionMode):
    """Answers a value fill of a meta tensor with the tensor itself (see the Note)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS:
            # nn.init functions pass the tensor by keyword to __torch_function__.
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    """Parameter registration hook: the parameter, moved to the meta device."""
    if param is None or param.is_meta or isinstance(param, nn.UninitializedParameter):
        return None  # keep it (a tied parameter is already meta: its identity must stay)
    meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    if type(param) is not nn.Parameter:
        meta.__class__ = type(param)
    meta.__dict__.update(param.__dict__)
    return meta


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Build models whose parameters are placeholders on the meta device.

    Every parameter registered on a module inside the block is replaced by a meta
    tensor of the same shape, dtype and ``requires_grad`` (no memory);
    ``zero3.hooks.shard_module`` later gives each one its values straight into this
    rank's shard, from ``checkpoint=`` or by running the module initialisers. Buffers are
    created for real, so computed buffers (rotary ``inv_freq``, causal masks) keep their
    values. Tied parameters stay tied. Also importable as ``zero3.hooks.empty_init``.

    Example::

        with zero3.hooks.empty_init():
            model = LlamaForCausalLM(config)
        shard_module(model, config, checkpoint="llama-dir/")

    Note:
        It uses torch's public parameter-registration hook
        (``torch.nn.modules.module.register_module_parameter_registration_hook``), the
        way accelerate's ``init_empty_weights(include_buffers=False)`` patches
        ``register_parameter``: a module's constructor still creates each parameter
        (usually ``torch.empty``: memory allocated but never written, so never
        resident) and its ``reset_parameters()`` then runs on the meta placeholder,
        which costs nothing and draws no random numbers (value fills of meta tensors are
        skipped, see the module Note). Inside the block every module class is affected,
        in every thread.
    """
    # torch's stub types the hook as returning None; a returned parameter replaces the
    # registered one (documented behaviour of the registration hooks).
    handle = register_module_parameter_registration_hook(_to_meta)  # type: ignore[arg-type]
    try:
        with SkipMetaFills():
            yield
    finally:
        handle.remove()
