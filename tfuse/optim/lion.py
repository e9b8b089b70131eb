"""FusedLion: the Lion optimizer (Chen et al. 2023) over flat buffers, one launch per buffer."""

from __future__ import annotations

from typing import Any

import torch

from tfuse.optim._checks import as_float, check_betas, check_capturable_flag, check_lr, check_non_negative
from tfuse.optim._flat_optimizer import FlatOptimizer
from tfuse.optim._lion_family import LION, LionStep


class FusedLion(FlatOptimizer):
    """Lion ("EvoLved Sign Momentum", Chen et al. 2023, Algorithm 2) over flat buffers.

    Each step, per element, with ``g`` the gradient and ``m`` the momentum::

        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * weight_decay) - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    Conventions, stated: weight decay is decoupled and scaled by ``lr`` (as
    in the paper and AdamW; the paper suggests an ``lr`` 3-10x smaller and a
    ``weight_decay`` 3-10x larger than AdamW's); ``sign(0) = 0`` and
    ``sign(NaN) = NaN``, as ``torch.sign``; the momentum is updated from the
    gradient after the parameter; ``maximize`` negates the gradient. The
    state is ``exp_avg`` per parameter (the name of the widely used
    ``lion-pytorch``), created at a parameter's first gradient, with no step
    count. torch has no Lion: state dicts load into ``FusedLion`` (and
    ``lion-pytorch``'s, which share its format).

    One Triton launch per flat buffer and step; without Triton, torch's
    foreach ops (in float32 for float16/bfloat16 buffers, rounded to nearest
    even, as the kernel). ``master_weights``, ``capturable``, GradScaler,
    copies and ``torch.save`` work as for :class:`~tfuse.optim.FusedAdam`.

    Args:
        params: parameters or parameter groups, or a :class:`~tfuse.flat.FlatParams`.
        lr: learning rate, a float or a 0-dim tensor.
        betas: ``(beta1, beta2)``: the interpolation of the update's direction and the momentum's decay.
        weight_decay: decoupled weight decay (multiplied by lr).
        maximize: maximize the objective.
        foreach: accepted and ignored (tfuse has one implementation, fused).
        differentiable: must be False (the update runs outside autograd).
        fused: None or True (tfuse is always fused).
        master_weights: float32 master copies for float16/bfloat16 parameters.
        capturable: keep the step on the device (CUDA graphs); lr may then be a tensor read there.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedLion
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedLion(layer.parameters(), lr=1e-4, weight_decay=0.1)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state[layer.weight])
        ['exp_avg']
    """

    family = LION
    state_names = ("exp_avg",)
    torch_name = "a Lion implementation such as lion-pytorch (torch.optim has none)"

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
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
            weight_decay=weight_decay,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        self.check_group(defaults)
        super().__init__(params, defaults, master_weights, capturable=capturable)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_betas(type(self).__name__, group["betas"], one_allowed=True)
        check_non_negative(group["weight_decay"], "weight_decay")

    @staticmethod
    def update_row(group: dict[str, Any], step: int, first: bool) -> LionStep:
        beta1, beta2 = (as_float(b) for b in group["betas"])
        return LionStep(
            lr=as_float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            weight_decay=as_float(group["weight_decay"]),
            maximize=bool(group["maximize"]),
        )
