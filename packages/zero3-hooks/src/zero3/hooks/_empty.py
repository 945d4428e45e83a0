"""empty_init: build a model whose parameters take no memory until it is sharded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

__all__ = ["empty_init"]


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
    :func:`~zero3.hooks.shard_module` later gives each one its values straight into this
    rank's shard, from ``checkpoint=`` or by running the module initialisers. Buffers are
    created for real, so computed buffers (rotary ``inv_freq``, causal masks) keep their
    values. Tied parameters stay tied.

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
        which costs nothing and draws no random numbers. Inside the block every module
        class is affected, in every thread.
    """
    # torch's stub types the hook as returning None; a returned parameter replaces the
    # registered one (documented behaviour of the registration hooks).
    handle = register_module_parameter_registration_hook(_to_meta)  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()
