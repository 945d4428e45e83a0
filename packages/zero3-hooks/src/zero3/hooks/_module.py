"""ShardedModule: the mixin zero3 adds to the class of a sharded module."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from zero3.core.engine import finish_module_state_dict, try_sharded_state
from zero3.hooks._copy import PICKLE_REFUSED

__all__ = ["ShardedModule", "unsharded_class"]


def unsharded_class(cls: type) -> type:
    """The user's class behind a sharded one (``ShardedModule`` mixed in)."""
    return next(c for c in cls.__mro__ if not issubclass(c, ShardedModule))


class ShardedModule:
    """Mixin zero3 adds to a sharded module's class (FSDP2 swaps classes the same way).

    The sharded module keeps its class name and behaviour; ``isinstance(model,
    ShardedModule)`` tells it is sharded. The mixin makes ``model.zero_grad()`` end
    the gradient accumulation window (trainers such as the HF Trainer call the
    module's ``zero_grad``, not the optimizer's).

    Note (why the class changes):
        zero3 owns the gradients (``param.grad`` holds none on a sharded model), so the
        window must end when the user clears gradients, and torch has no hook on
        ``nn.Module.zero_grad``; trainers (the HF Trainer) call the module's. Without the
        mixin the gradients of a backward thrown away would be added to the next
        window's (:ref:`fact-trainer-zero-grad`). FSDP2 swaps the
        class the same way (``FSDPModule``).
    """

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and end zero3's gradient accumulation window."""
        state = try_sharded_state(self)  # type: ignore[arg-type]
        if state is not None:  # first: then reading param.grad gives None, as after it
            state.step.end_window(clear=True)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """``copy.deepcopy``: an ordinary, unsharded copy holding the full values.

        A collective when the model has partitioned parameters (it gathers them, one
        module at a time): every rank copies. Copying this module's state reaches its
        ``_parameters`` (zero3's ``ParamAccessDict``) first, which prepares the copy of
        the whole model (``zero3.hooks._copy``); here the copy gets the user's class.
        """
        cls: Any = unsharded_class(type(self))
        copied: nn.Module = cls.__new__(cls)
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def state_dict(
        self,
        *args: Any,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """``nn.Module.state_dict`` of a sharded model, cheap enough to call on the whole
        model (peft's ``save_pretrained`` does, then keeps its adapters' keys).

        A collective (every rank calls it). The same keys as the unsharded model's;
        frozen partitioned parameters are ``ShardedTensor`` values in their natural
        shapes, viewing this rank's shard (no gather, no copy, what
        ``zero3.core.sharded_state_dict`` gives); trainable ones are whole copies
        (gathered); persistent parameters and buffers are whole as usual. With
        ``keep_vars=True`` the parameters themselves, released or not. Called through a
        wrapping module (a ``PeftModel``) too: torch's recursion reaches this method.
        The design and why: docs/transformers.rst, "Whole-model state_dict() of a
        sharded model".
        """
        state = try_sharded_state(self)  # type: ignore[arg-type]
        if state is None or args:  # unsharded, or torch's deprecated positional form
            return super().state_dict(  # type: ignore[misc, no-any-return]
                *args, destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()  # type: ignore[attr-defined]  # torch's
        before = set(destination)
        super().state_dict(destination=destination, prefix=prefix, keep_vars=True)  # type: ignore[misc]
        if not keep_vars:
            added = [key for key in destination if key not in before]
            finish_module_state_dict(state, destination, added)
        return destination

    def __copy__(self) -> Any:
        """``copy.copy``: a shallow copy (the same parameters and hooks), as for any module."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling (``torch.save(model)``) is refused, saying what to do instead."""
        raise TypeError(PICKLE_REFUSED)

    def to(self, *args: Any, **kwargs: Any) -> ShardedModule:
        """``nn.Module.to`` for a sharded module: casts the parameter shards to a
        floating-point dtype (before an optimizer is built), checks the device, and
        moves or casts buffers as ``nn.Module.to`` does.

        The shards already live on the device the comm backend serves, so ``.to()`` of
        that device changes nothing (trainers call it); another device is an error
        naming both. A cast is collective (every rank casts); after a
        ``PartitionedOptimizer`` exists the parameters' dtype is fixed (its fp32
        masters follow it) and a cast is an error saying to cast first. See
        :meth:`zero3.core.engine.ShardedModelState.convert`.
        """
        state = try_sharded_state(self)  # type: ignore[arg-type]
        if state is None:  # unsharded while this class was still in place
            return super().to(*args, **kwargs)  # type: ignore[misc, no-any-return]
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is not None:
            raise ValueError(
                "zero3: .to(memory_format=...) is not supported on a sharded module; set "
                "the memory format before shard_module"
            )
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(
                f"nn.Module.to only accepts floating point or complex dtypes, but got desired "
                f"dtype={dtype}"
            )
        state.convert(device, dtype)
        for module in self.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    cast = dtype if dtype is not None and buf.is_floating_point() else None
                    module._buffers[key] = buf.to(device, cast, non_blocking)
        return self

    def cpu(self) -> ShardedModule:
        """``.to("cpu")`` (see :meth:`to`)."""
        return self.to("cpu")

    def cuda(self, device: int | torch.device | None = None) -> ShardedModule:
        """``.to("cuda")`` (see :meth:`to`)."""
        if device is None:
            return self.to("cuda")
        return self.to(torch.device("cuda", device) if isinstance(device, int) else device)

    def float(self) -> ShardedModule:
        """``.to(torch.float32)`` (see :meth:`to`)."""
        return self.to(torch.float32)

    def half(self) -> ShardedModule:
        """``.to(torch.float16)`` (see :meth:`to`)."""
        return self.to(torch.float16)

    def bfloat16(self) -> ShardedModule:
        """``.to(torch.bfloat16)`` (see :meth:`to`)."""
        return self.to(torch.bfloat16)

    def double(self) -> ShardedModule:
        """``.to(torch.float64)`` (see :meth:`to`)."""
        return self.to(torch.float64)
