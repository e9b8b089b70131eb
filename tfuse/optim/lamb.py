"""FusedLAMB: LAMB (You et al. 2019) over flat buffers, with per-parameter trust ratios."""

from __future__ import annotations

from typing import Any

import torch

from tfuse.optim._checks import as_float, check_betas, check_capturable_flag, check_lr, check_non_negative
from tfuse.optim._flat_optimizer import FlatOptimizer
from tfuse.optim._lamb_family import LAMB, LambStep


class FusedLAMB(FlatOptimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2) over flat buffers.

    Per parameter, with ``g`` the gradient::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p
        p = p - lr * trust * u,  trust = ||p|| / ||u||

    Conventions, stated (those of NVIDIA Apex's ``FusedLAMB`` and timm's
    ``Lamb``): weight decay is decoupled (added to the update direction, so
    it takes part in the trust ratio); the trust ratio is 1 where either norm
    is 0; by default only groups with a weight decay are adapted (Apex's
    ``use_nvlamb=False``, timm's ``always_adapt=False``), so a group of biases
    and norm weights with ``weight_decay=0`` takes plain Adam-like steps;
    ``always_adapt=True`` adapts every group; ``trust_clip=True`` caps the
    ratio at 1. No global gradient clipping inside the step (Apex clips to
    ``max_grad_norm``): call ``tfuse.optim.clip_grad_norm_`` before it. The
    state is ``step``, ``exp_avg``, ``exp_avg_sq`` per parameter.

    The norms are per parameter: each step is three Triton launches per flat
    buffer (moments and partial sums, the ratios, the update), whatever the
    number of parameters. Without Triton, torch's foreach ops over whole
    parameters (in float32 for float16/bfloat16). ``master_weights``,
    ``capturable`` and GradScaler work as for :class:`~tfuse.optim.FusedAdam`.
    In ``ShardedOptimizer`` a parameter split across shards takes its norms
    summed over the ranks that hold its parts (one small all-reduce per step).

    Args:
        params: parameters or parameter groups, or a :class:`~tfuse.flat.FlatParams`.
        lr: learning rate, a float or a 0-dim tensor.
        betas: the moments' decay rates.
        eps: added to the denominator.
        weight_decay: decoupled weight decay, part of the update direction.
        bias_correction: divide the moments by ``1 - beta**step``.
        always_adapt: adapt groups with no weight decay too.
        trust_clip: cap the trust ratio at 1.
        maximize: maximize the objective.
        master_weights: float32 master copies for float16/bfloat16 parameters.
        capturable: keep step counts and the step on the device (CUDA graphs).

    Example (biases and norms in a group without weight decay, not adapted):
        >>> import torch
        >>> from tfuse.optim import FusedLAMB
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        >>> decay = [p for p in net.parameters() if p.dim() > 1]
        >>> no_decay = [p for p in net.parameters() if p.dim() <= 1]
        >>> optimizer = FusedLAMB([{"params": decay, "weight_decay": 0.01},
        ...                        {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
        >>> net(torch.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state[net[0].weight])
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    family = LAMB
    state_names = ("exp_avg", "exp_avg_sq")
    torch_name = "a LAMB implementation such as Apex's FusedLAMB (torch.optim has none)"

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        always_adapt: bool = False,
        trust_clip: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        capturable: bool = False,
    ) -> None:
        check_capturable_flag(type(self).__name__, capturable)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            always_adapt=always_adapt,
            trust_clip=trust_clip,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        self.check_group(defaults)
        super().__init__(params, defaults, master_weights, capturable=capturable)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["eps"], "epsilon")
        check_betas(type(self).__name__, group["betas"])
        check_non_negative(group["weight_decay"], "weight_decay")

    def pads_stay_zero(self) -> bool:
        # Zero padding stays zero while the denominator is positive there.
        return all(as_float(g["eps"]) > 0 for g in self.param_groups)

    @staticmethod
    def update_row(group: dict[str, Any], step: int, first: bool) -> LambStep:
        beta1, beta2 = (as_float(b) for b in group["betas"])
        weight_decay = as_float(group["weight_decay"])
        return LambStep(
            lr=as_float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=as_float(group["eps"]),
            weight_decay=weight_decay,
            step=step,
            bias_correction=bool(group["bias_correction"]),
            adapt=bool(group["always_adapt"]) or weight_decay != 0,
            trust_clip=bool(group["trust_clip"]),
            maximize=bool(group["maximize"]),
        )
