"""The hyperparameters of an update, one row each: :class:`AdamStep` and :class:`SGDStep`.

Each row says what one update of a parameter group does, and gives the
Triton kernel's coefficient row (the columns ADAM_* and SGD_* of
``kernels/optim.py``) and the row a capturable step starts from.
"""

from __future__ import annotations

import dataclasses
import math

import torch

# Columns of the coefficient rows (kernels/optim.py's ADAM_* and SGD_*; pinned by tests/test_capturable.py).
_ADAM_STEP_SIZE, _ADAM_BETA1, _ADAM_BETA2, _ADAM_DECAY, _ADAM_BC2_SQRT = 0, 1, 3, 7, 8
_ADAM_DECOUPLED_WD = 11  # an extra column of the static table on capturable steps: AdamW's wd (0 for Adam)
_SGD_LR = 0


@dataclasses.dataclass(frozen=True)
class AdamStep:
    """What one Adam/AdamW update does: a parameter group's hyperparameters at one step count.

    The fields mean what they mean in ``torch.optim.Adam``; ``step`` is the
    step being taken (1 for the first), ``decoupled_weight_decay`` makes it AdamW.
    """

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    step: int | torch.Tensor = 1  # a 0-dim tensor on capturable steps
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state buffers this update reads and writes."""
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")

    @property
    def torch_kernel(self) -> str:
        """torch's fused kernel for this update (the PyTorch path)."""
        return "_fused_adamw_" if self.decoupled_weight_decay else "_fused_adam_"

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns ADAM_* of kernels/optim.py), computed in float64."""
        bias_correction1 = 1 - self.beta1**self.step
        bias_correction2 = 1 - self.beta2**self.step
        decoupled = self.decoupled_weight_decay
        return [
            self.lr / bias_correction1,
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            self.eps,
            0.0 if decoupled else self.weight_decay,
            1.0 - self.lr * self.weight_decay if decoupled else 1.0,
            math.sqrt(bias_correction2),
            -1.0 if self.maximize else 1.0,
            1.0 if self.amsgrad else 0.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from (see ``_AdamFamily.device_coefficients``): the columns
        that depend on neither lr nor the step, and AdamW's weight decay in an extra last column."""
        row = dataclasses.replace(self, lr=0.0, step=1).coefficients()
        return [*row, self.weight_decay if self.decoupled_weight_decay else 0.0]


@dataclasses.dataclass(frozen=True)
class SGDStep:
    """What one SGD update does: a parameter group's hyperparameters, as in ``torch.optim.SGD``.

    ``first_step``: the momentum buffer starts as the gradient (torch: the
    parameter has no momentum buffer yet) instead of being read.
    """

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    first_step: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state buffers this update reads and writes."""
        return ("momentum_buffer",) if self.momentum != 0 else ()

    @property
    def torch_kernel(self) -> str:
        """torch's fused kernel for this update (the PyTorch path)."""
        return "_fused_sgd_"

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns SGD_* of kernels/optim.py)."""
        return [
            self.lr,
            self.momentum,
            1.0 - self.dampening,
            self.weight_decay,
            1.0 if self.nesterov else 0.0,
            -1.0 if self.maximize else 1.0,
            1.0 if self.first_step else 0.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from: every column but the learning rate's."""
        return dataclasses.replace(self, lr=0.0).coefficients()
