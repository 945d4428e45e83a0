"""A third-party optimizer, defined outside torch and zero3 (used by optimizers.py)."""

import torch


class Lion(torch.optim.Optimizer):
    """A third-party optimizer (Chen et al. 2023): it only follows torch's protocol."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(
            params, {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if (
                    p.grad is None
                ):  # no rank produced a gradient for it: skip, as torch does
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((avg * beta1 + p.grad * (1 - beta1)).sign(), alpha=-group["lr"])
                avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
