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


class ReferenceLAMB(torch.optim.Optimizer):
    """LAMB, You et al. 2019 ("Large Batch Optimization for Deep Learning"), Algorithm 2, per tensor, with the
    conventions of Apex's FusedLAMB and timm's Lamb: decoupled weight decay inside the direction, trust ratio 1
    where a norm is 0, only groups with weight decay adapted unless ``always_adapt``, ``trust_clip`` caps it at 1.
    No global gradient clipping. State ``step`` (a tensor, as torch's), ``exp_avg``, ``exp_avg_sq``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, *, bias_correction=True,
                 always_adapt=False, trust_clip=False, maximize=False, foreach=None, differentiable=False, fused=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, always_adapt=always_adapt,
                                      trust_clip=trust_clip, maximize=maximize, foreach=foreach,
                                      differentiable=differentiable, fused=fused))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1.0, 1.0)
                direction = (exp_avg / bc1) / ((exp_avg_sq / bc2).sqrt() + eps) + decay * p
                ratio = 1.0
                if decay != 0 or group["always_adapt"]:
                    w_norm, u_norm = float(p.norm()), float(direction.norm())
                    ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                    if group["trust_clip"]:
                        ratio = min(ratio, 1.0)
                p.sub_(direction, alpha=lr * ratio)
        return loss


class ReferenceLARS(torch.optim.Optimizer):
    """LARS with momentum, You et al. 2017 ("Large Batch Training of Convolutional Networks"), Algorithm 1, per
    tensor, in MLPerf's form: trust = eta ||p|| / (||g|| + wd ||p|| + eps) (1 where a norm is 0; groups without
    weight decay not adapted unless ``always_adapt``), v = momentum v + lr trust (g + wd p) from v = 0, p -= v
    (Nesterov: p -= momentum v + lr trust (g + wd p)). State ``momentum_buffer``."""

    def __init__(self, params, lr=1.0, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=0.0, *,
                 nesterov=False, always_adapt=False, maximize=False, foreach=None, differentiable=False, fused=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                                      always_adapt=always_adapt, maximize=maximize, foreach=foreach,
                                      differentiable=differentiable, fused=fused))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, decay = float(group["lr"]), group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                ratio = 1.0
                if decay != 0 or group["always_adapt"]:
                    w_norm, g_norm = float(p.norm()), float(p.grad.norm())
                    if w_norm > 0 and g_norm > 0:
                        ratio = group["trust_coefficient"] * w_norm / (g_norm + decay * w_norm + group["eps"])
                step = (grad + decay * p) * (lr * ratio)
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                velocity = state["momentum_buffer"]
                velocity.mul_(momentum).add_(step)
                p.sub_(velocity * momentum + step if group["nesterov"] else velocity)
        return loss


class ReferenceMuon(torch.optim.Optimizer):
    """torch.optim.Muon for the matrices and torch.optim.AdamW for the other parameters, as one optimizer (Keller
    Jordan's MuonWithAuxAdam): each step runs torch's own for-loop functions (``torch.optim._muon.muon``,
    ``torch.optim.adam.adam`` with decoupled weight decay). A group without ``use_muon`` is split, its matrices to
    Muon and the rest to AdamW with the ``adamw_*`` options; N-D matrices are torch's 2-D algorithm on the
    ``(size(0), -1)`` reshape, with the lr adjustment of that shape. State as torch's two classes keep it."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 adamw_lr=3e-4, adamw_betas=(0.9, 0.95), adamw_eps=1e-10, adamw_weight_decay=0.0,
                 foreach=None, differentiable=False, fused=None):
        self.adamw = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn))

    def add_param_group(self, param_group):
        if "use_muon" in param_group:
            extra = self.adamw if not param_group["use_muon"] else {}
            super().add_param_group({**extra, **param_group})
            return
        params = list(param_group["params"])
        matrices, others = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
        if matrices:
            super().add_param_group({**param_group, "params": matrices, "use_muon": True})
        if others:
            super().add_param_group({**self.adamw, "params": others, "use_muon": False})

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim._muon import muon
        from torch.optim.adam import adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["use_muon"]:
                for p in params:
                    self.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
                for p in params:  # one at a time: each as its (size(0), -1) matrix, with that shape's lr adjustment
                    buffer = self.state[p]["momentum_buffer"]
                    matrix, momentum = (t.detach().reshape(p.shape[0], -1).clone() for t in (p, buffer))
                    muon([matrix], [p.grad.reshape(p.shape[0], -1)], [momentum], foreach=False, lr=group["lr"],
                         weight_decay=group["weight_decay"], momentum=group["momentum"], nesterov=group["nesterov"],
                         ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"], eps=group["eps"],
                         adjust_lr_fn=group["adjust_lr_fn"], has_complex=False)
                    p.copy_(matrix.view(p.shape))
                    buffer.copy_(momentum.view(p.shape))
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                 [], [s["step"] for s in states], foreach=False, decoupled_weight_decay=True, amsgrad=False,
                 beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=False)
        return loss
