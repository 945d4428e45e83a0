"""zero3.optim: PartitionedOptimizer — sharded training that equals one-process training.

::

    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""

from zero3.optim._loss_scale import LossScaler
from zero3.optim._optimizer import PartitionedOptimizer

__all__ = ["LossScaler", "PartitionedOptimizer"]
