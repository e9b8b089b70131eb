"""FusedLARS: LARS with momentum (You et al. 2017) over flat buffers, with per-parameter trust ratios."""

from __future__ import annotations

from typing import Any

import torch

from tfuse.optim._checks import as_float, check_capturable_flag, check_lr, check_non_negative
from tfuse.optim._flat_optimizer import FlatOptimizer
from tfuse.optim._lars_family import LARS, LarsStep


class FusedLARS(FlatOptimizer):
    """LARS with momentum (You et al. 2017, "Large Batch Training of Convolutional Networks", Algorithm 1) over
    flat buffers, in the form of MLPerf's ResNet-50 reference.

    Per parameter, with ``g`` the gradient::

        trust = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
        v = momentum * v + lr * trust * (g + weight_decay * p)
        p = p - v        (Nesterov: p - (momentum * v + lr * trust * (g + weight_decay * p)))

    Conventions, stated: the trust ratio is 1 where ``||p||`` or ``||g||`` is
    0; the learning rate and the trust ratio scale the velocity (MLPerf's and
    the paper's form, not torch SGD's ``p -= lr * v``), which starts at zero;
    only groups with a weight decay are adapted unless ``always_adapt=True``,
    so biases and batch-norm parameters go in a group with
    ``weight_decay=0.0`` and take plain SGD-momentum steps with ``lr``, as
    MLPerf excludes them. State: ``momentum_buffer`` (the velocity ``v``).

    Three Triton launches per flat buffer (norms, ratios, update) whatever the
    number of parameters; without Triton, torch's foreach ops over whole
    parameters. ``master_weights``, ``capturable`` and GradScaler work as for
    :class:`~tfuse.optim.FusedAdam`. In ``ShardedOptimizer`` as
    :class:`~tfuse.optim.FusedLAMB` (norms summed across the ranks).

    Args:
        params: parameters or parameter groups, or a :class:`~tfuse.flat.FlatParams`.
        lr: learning rate, a float or a 0-dim tensor.
        momentum: momentum factor.
        weight_decay: L2 weight decay, in the update and in the trust ratio's denominator.
        trust_coefficient: eta, the trust ratio's scale.
        eps: added to the trust ratio's denominator.
        nesterov: Nesterov momentum.
        always_adapt: adapt groups with no weight decay too.
        maximize: maximize the objective.
        master_weights: float32 master copies for float16/bfloat16 parameters.
        capturable: keep the step on the device (CUDA graphs).

    Example (MLPerf's exclusion of biases and batch norm):
        >>> import torch
        >>> from tfuse.optim import FusedLARS
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> decay = [p for p in net.parameters() if p.dim() > 1]
        >>> excluded = [p for p in net.parameters() if p.dim() <= 1]
        >>> optimizer = FusedLARS([{"params": decay, "weight_decay": 5e-5},
        ...                        {"params": excluded, "weight_decay": 0.0}], lr=2.0, momentum=0.9)
        >>> net(torch.randn(2, 3, 8, 8)).sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state[net[0].weight])
        ['momentum_buffer']
    """

    family = LARS
    state_names = ("momentum_buffer",)
    torch_name = "a LARS implementation such as MLPerf's (torch.optim has none)"

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
        *,
        nesterov: bool = False,
        always_adapt: bool = False,
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
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
            always_adapt=always_adapt,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        self.check_group(defaults)
        super().__init__(params, defaults, master_weights, capturable=capturable)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["momentum"], "momentum")
        check_non_negative(group["weight_decay"], "weight_decay")
        check_non_negative(group["trust_coefficient"], "trust_coefficient")
        check_non_negative(group["eps"], "epsilon")
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("Nesterov momentum requires a momentum")

    @staticmethod
    def update_row(group: dict[str, Any], step: int, first: bool) -> LarsStep:
        weight_decay = as_float(group["weight_decay"])
        return LarsStep(
            lr=as_float(group["lr"]),
            momentum=as_float(group["momentum"]),
            weight_decay=weight_decay,
            trust_coefficient=as_float(group["trust_coefficient"]),
            eps=as_float(group["eps"]),
            nesterov=bool(group["nesterov"]),
            adapt=bool(group["always_adapt"]) or weight_decay != 0,
            maximize=bool(group["maximize"]),
        )
