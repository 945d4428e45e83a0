"""Third-party optimizers under PartitionedOptimizer: what they see, how to drive them.

Run it on two local ranks::

    ./dev run torchrun --standalone --nproc-per-node 2 examples/optimizers.py
"""

import torch
from torch import nn

from lion import Lion  # examples/lion.py: a third-party optimizer
from zero3.comm import create_backend
from zero3.core import Zero3Config
from zero3.hooks import shard_module
from zero3.optim import PartitionedOptimizer

COMM = create_backend("auto", timeout_s=60)
RANK = COMM.rank


def build(**config):
    """The same small model on every rank, sharded (``config``: Zero3Config fields)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    return shard_module(
        model, Zero3Config(param_persistence_threshold=0, **config), comm=COMM
    )


def backward(model, step, dtype=torch.float32):
    """Forward and backward on this rank's share of a global batch; returns the loss."""
    data = torch.Generator().manual_seed(step)
    x = torch.randn(8 * COMM.world_size, 16, generator=data)
    mine = slice(8 * RANK, 8 * (RANK + 1))
    loss = (
        (model(x[mine].to(dtype)).float() - x[mine].sum(1, keepdim=True)).pow(2).mean()
    )
    loss.backward()
    return loss


def what_the_optimizer_sees():
    model = build()
    opt = PartitionedOptimizer(model, Lion, lr=1e-3)
    seen = [(tuple(p.shape), p.dtype) for g in opt.param_groups for p in g["params"]]
    print(
        f"rank {RANK}: the model's shapes "
        f"{[tuple(p.shape) for p in model.parameters()]}"
    )
    print(f"rank {RANK}: Lion sees {[shape for shape, _ in seen]}, all {seen[0][1]}")
    flat = PartitionedOptimizer(build(), Lion, flat=True, lr=1e-3)
    shapes = [tuple(p.shape) for p in flat.param_groups[0]["params"]]
    print(f"rank {RANK}: with flat=True: {shapes}")


def param_groups_and_scheduler():
    model = build()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    opt = PartitionedOptimizer(model, torch.optim.AdamW, groups, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    for step in range(3):
        backward(model, step)
        opt.step()
        opt.zero_grad()
        scheduler.step()
    if RANK == 0:
        print(f"lr after 3 steps: {[round(g['lr'], 5) for g in opt.param_groups]}")


def clipping():
    model = build()
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    backward(model, step=0)
    try:  # reads param.grad, which holds nothing on a sharded model: refused, not a 0
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except RuntimeError as exc:
        refused = str(exc).split(": ", 2)[1]
    norm = opt.clip_grad_norm_(1.0)  # the global norm over every rank's shards
    opt.step()
    opt.zero_grad()
    if RANK == 0:
        print(f"torch.nn.utils.clip_grad_norm_: {refused}; ", end="")
        print(f"opt.clip_grad_norm_ saw {norm.item():.3f}")

    # The same clipping inside step(), from the config (DeepSpeed's gradient_clipping).
    model = build(gradient_clipping=1.0)
    opt = PartitionedOptimizer(model, torch.optim.SGD, lr=0.1)
    backward(model, step=0)
    opt.step()
    opt.zero_grad()
    if RANK == 0:
        print(
            "Zero3Config(gradient_clipping=1.0): clipped a norm of "
            f"{opt.last_grad_norm:.3f}"
        )


def fp16_loss_scaling():
    # fp16 parameters, fp32 master shards; dynamic loss scaling starts at 2**8.
    model = build(param_dtype=torch.float16, initial_scale_power=8)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    for step in range(3):
        data = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=data).half()
        loss = model(x).float().pow(2).mean()
        # loss * scale: small fp16 gradients stay finite.
        opt.scale_loss(loss).backward()
        opt.step()  # unscales; an inf/nan on any rank skips the step on every rank
        opt.zero_grad()
    if RANK == 0:
        master = opt.param_groups[0]["params"][0]
        skipped = opt.scaler.skipped_steps
        print(
            f"fp16: loss scale {opt.loss_scale:g}, {skipped} step(s) skipped, ", end=""
        )
        print(f"masters {master.dtype}")


what_the_optimizer_sees()
param_groups_and_scheduler()
clipping()
fp16_loss_scaling()
