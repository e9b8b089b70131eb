"""Reference optimizers written from their papers, as torch.optim.Optimizer classes (for-loop, one tensor at a
time), for families torch lacks: the fused optimizers are compared with these as with torch's own."""

from __future__ import annotations

import torch


class ReferenceLion(torch.optim.Optimizer):
    """Lion, Chen et al. 2023 ("Symbolic Discovery of Optimization Algorithms"), Algorithm 2, per tensor:
    c = b1 m + (1 - b1) g; p = p (1 - lr wd) - lr sign(c); m = b2 m + (1 - b2) g. State ``exp_avg``.
    ``foreach`` and ``fused`` are taken and ignored (the tests pass torch's switches to every reference)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, foreach=None,
                 differentiable=False, fused=None):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
                                      foreach=foreach, differentiable=differentiable, fused=fused))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                direction = exp_avg * beta1 + grad * (1 - beta1)
                p.mul_(1 - lr * group["weight_decay"]).add_(torch.sign(direction), alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss
