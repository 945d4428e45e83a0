"""zero3.optim: PartitionedOptimizer — sharded training that equals one-process training —
and checkpoints that load at any world size.

::

    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    loss.backward()
    opt.step()
    opt.zero_grad()
    save_checkpoint("ckpt", model, opt, extra={"step": step})
"""

from zero3.optim._checkpoint import load_checkpoint, save_checkpoint, wait_for_pending_saves
from zero3.optim._consolidate import consolidate_checkpoint
from zero3.optim._loss_scale import LossScaler
from zero3.optim._offload import OffloadError, OffloadStats
from zero3.optim._optimizer import PartitionedOptimizer

__all__ = [
    "LossScaler",
    "OffloadError",
    "OffloadStats",
    "PartitionedOptimizer",
    "consolidate_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "wait_for_pending_saves",
]
