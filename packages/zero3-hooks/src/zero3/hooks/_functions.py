"""Autograd Functions that put the backward hooks into the graph.

Note:
    ``register_full_backward_hook`` fires unreliably with several outputs, in-place
    ops or inputs that need no gradient, so (like DeepSpeed) zero3 welds its backward
    hooks into the graph as identity Functions: one on a module's outputs, whose
    backward runs before any of the module's own backward ops (pre-backward: gather),
    and one on its inputs, whose backward runs after all of them (post-backward:
    release). The outputs are detached aliases of the inputs, not views, so
    downstream in-place ops behave exactly as they would without zero3.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["BackwardListener", "PostBackward", "PreBackward"]


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
