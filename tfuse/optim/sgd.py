"""FusedSGD and FusedMomentum: torch.optim.SGD semantics, one launch per flat buffer."""

from __future__ import annotations

from typing import Any

import torch

from tfuse.optim._checks import as_float, check_capturable_flag, check_lr, check_non_negative
from tfuse.optim._flat_optimizer import FlatOptimizer
from tfuse.optim._update import SGD, SGDStep


class FusedSGD(FlatOptimizer):
    """SGD with optional momentum, dampening, Nesterov and weight decay, over flat buffers.

    Same constructor, update and state (``momentum_buffer`` per parameter,
    none without momentum) as ``torch.optim.SGD``; state dicts move between
    the two both ways. Each flat buffer is updated by one Triton launch per
    step; on CPU without the Triton interpreter, torch's fused CPU SGD runs
    over whole contiguous runs of the buffers. For float16/bfloat16 it is
    checked first and, when it gets them wrong, replaced by the same kernel on
    float32 copies, rounded back: torch 2.13's fused CPU SGD leaves
    low-precision parameters unchanged (see
    :func:`~tfuse.optim._update.native_low_precision_ok`).
    ``master_weights``, AMP and copies work as in :class:`~tfuse.optim.FusedAdam`.

    Args:
        params: parameters or parameter groups, as for torch.optim, or a
            :class:`~tfuse.flat.FlatParams` (see :class:`~tfuse.optim.FusedAdam`).
        lr: learning rate, a float or a 0-dim tensor (read once per step).
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs a momentum and zero dampening).
        maximize: maximize the objective.
        foreach: accepted for compatibility and ignored: it picks among
            torch's for-loop and multi-tensor implementations, which compute
            the same update; tfuse has one, the fused update of whole buffers.
        differentiable: must be False (the update runs outside autograd).
        fused: None or True; tfuse is always fused. False is refused (use
            ``torch.optim.SGD`` for torch's non-fused implementations).
        master_weights: float32 master copies for float16/bfloat16 parameters
            (see :class:`~tfuse.optim.FusedAdam`).

    Positional arguments bind as in ``torch.optim.SGD``; everything after
    ``nesterov`` is keyword-only, as there.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedSGD
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedSGD(layer.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state[layer.weight])
        ['momentum_buffer']
    """

    family = SGD
    state_names = ("momentum_buffer",)
    torch_name = "torch.optim.SGD"

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float | torch.Tensor = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        capturable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        self.check_group(defaults)
        check_capturable_flag(type(self).__name__, capturable)
        # torch.optim.SGD has no capturable switch (its groups and state dicts have no such key): an attribute here.
        super().__init__(params, defaults, master_weights, capturable=capturable)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["momentum"], "momentum")
        check_non_negative(group["weight_decay"], "weight_decay")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @staticmethod
    def update_row(group: dict[str, Any], step: int, first: bool) -> SGDStep:
        return SGDStep(
            lr=as_float(group["lr"]),
            momentum=as_float(group["momentum"]),
            dampening=as_float(group["dampening"]),
            weight_decay=as_float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
            first_step=first,
        )


class FusedMomentum(FusedSGD):
    """SGD with momentum (default 0.9), PaddlePaddle's ``momentum`` optimizer; see :class:`FusedSGD`.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedMomentum
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedMomentum(layer.parameters(), lr=0.1)
        >>> optimizer.param_groups[0]["momentum"]
        0.9
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float | torch.Tensor = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        capturable: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
            master_weights=master_weights,
            capturable=capturable,
        )
