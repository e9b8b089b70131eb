"""FusedAdagrad: torch.optim.Adagrad semantics, one launch per flat buffer."""

from __future__ import annotations

from typing import Any

import torch

from tfuse.optim._adagrad_family import ADAGRAD, AdagradStep
from tfuse.optim._checks import as_float, check_capturable_flag, check_lr, check_non_negative
from tfuse.optim._flat_optimizer import FlatOptimizer


class FusedAdagrad(FlatOptimizer):
    """Adagrad over flat buffers, with ``torch.optim.Adagrad``'s constructor, update and state.

    Per parameter: ``step`` and ``sum``, created in the constructor as torch
    does (step 0, ``sum`` filled with ``initial_accumulator_value``); a
    parameter added later by ``add_param_group`` gets its state at its first
    gradient, from the constructor's ``initial_accumulator_value`` (torch's
    rule, whatever the new group says). State dicts move between the two
    both ways. ``lr_decay`` divides the learning rate by ``1 + (step - 1) *
    lr_decay``; weight decay is L2 (added to the gradient). Dense gradients
    only (a sparse gradient cannot live in a flat buffer). One Triton launch
    per flat buffer and step; without Triton, torch's fused CPU Adagrad over
    runs of the buffers. ``master_weights``, ``capturable``, GradScaler,
    copies and ``torch.save`` work as for :class:`~tfuse.optim.FusedAdam`.

    Args:
        params: parameters or parameter groups, as for torch.optim, or a :class:`~tfuse.flat.FlatParams`.
        lr: learning rate, a float or a 0-dim tensor.
        lr_decay: learning-rate decay per step.
        weight_decay: L2 penalty.
        initial_accumulator_value: the starting value of each ``sum``.
        eps: added to the denominator.
        foreach: accepted and ignored (tfuse has one implementation, fused).
        maximize: maximize the objective.
        differentiable: must be False.
        fused: None or True.
        master_weights: float32 master copies for float16/bfloat16 parameters.
        capturable: keep step counts and the step's coefficients on the device (CUDA graphs).

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedAdagrad
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedAdagrad(layer.parameters(), lr=0.1, initial_accumulator_value=0.1)
        >>> float(optimizer.state[layer.bias]["step"]), optimizer.state[layer.bias]["sum"].tolist()
        (0.0, [0.10000000149011612, 0.10000000149011612])
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> float(optimizer.state[layer.bias]["step"])
        1.0
    """

    family = ADAGRAD
    state_names = ("sum",)
    torch_name = "torch.optim.Adagrad"
    creates_state_eagerly = True  # torch's Adagrad: step 0 and the initial sum in the constructor

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        capturable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            fused=fused,
        )
        self.check_group(defaults)
        check_capturable_flag(type(self).__name__, capturable)
        super().__init__(params, defaults, master_weights, capturable=capturable)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["lr_decay"], "lr_decay")
        check_non_negative(group["weight_decay"], "weight_decay")
        check_non_negative(group["initial_accumulator_value"], "initial_accumulator_value")
        check_non_negative(group["eps"], "epsilon")

    def initial_state(self, name: str, group: dict[str, Any]) -> float:
        # torch's: the constructor's value for every parameter (a group's own value is not read).
        return float(self.defaults["initial_accumulator_value"]) if name == "sum" else 0.0

    def pads_stay_zero(self) -> bool:
        # Zero padding stays zero while the denominator sqrt(sum) + eps is positive there (sum is 0 in padding).
        return all(as_float(g["eps"]) > 0 for g in self.param_groups)

    @staticmethod
    def update_row(group: dict[str, Any], step: int, first: bool) -> AdagradStep:
        return AdagradStep(
            lr=as_float(group["lr"]),
            lr_decay=as_float(group["lr_decay"]),
            weight_decay=as_float(group["weight_decay"]),
            eps=as_float(group["eps"]),
            step=step,
            maximize=bool(group["maximize"]),
        )
