"""Lion's update over flat buffers: its row of hyperparameters (:class:`LionStep`) and its family (:data:`LION`).

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
Algorithm 2) keeps one momentum per parameter and moves every element by
``lr`` in the direction of the sign of an interpolation between that
momentum and the gradient, with decoupled weight decay::

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

torch has no Lion; the PyTorch path runs torch's foreach ops (float32 for
float16/bfloat16 buffers, as the Triton kernel computes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tfuse import kernels
from tfuse.optim._update_buffers import FlatBuffers, RunTable
from tfuse.optim._update_families import UpdateFamily, launch_update

# Columns of the coefficient row (kernels/optim.py's LION_*).
_LION_LR, _LION_DECAY = 0, 5
_LION_WEIGHT_DECAY = 7  # an extra column of the static table on capturable steps


@dataclasses.dataclass(frozen=True)
class LionStep:
    """What one Lion update does: a parameter group's hyperparameters (``step`` is not used by Lion)."""

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    maximize: bool = False

    state_names = ("exp_avg",)
    torch_kernel = "_foreach_sign"  # the op the PyTorch path is named by (with torch's other foreach ops)

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns LION_* of kernels/optim.py), computed in float64."""
        return [
            self.lr,
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            1.0 - self.lr * self.weight_decay,
            -1.0 if self.maximize else 1.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from: lr = 0, and the weight decay in an extra last column."""
        return [*dataclasses.replace(self, lr=0.0).coefficients(), self.weight_decay]


class _LionFamily(UpdateFamily):
    name = "lion"
    kernel_name = "_lion_kernel"
    uses_step = False
    native_low_precision = False  # foreach ops in float16/bfloat16 would round every intermediate

    def required_state(self, group):
        return {"exp_avg"}

    def launch(self, buffers: FlatBuffers, table: RunTable, rows, grad_scale, found_inf, meta) -> None:
        launch_update(
            kernels._lion_kernel, buffers, (buffers.state["exp_avg"],), table, rows, grad_scale, found_inf, meta
        )

    def torch_call(self, hyper, params, grads, states, grad_scale, found_inf=None):
        exp_avgs = states["exp_avg"]
        if found_inf is not None:
            _lion_unless_found_inf(hyper, params, grads, exp_avgs, grad_scale, found_inf)
            return
        # In place, one temporary (the direction): the usual step.
        if grad_scale is not None:
            torch._foreach_div_(grads, grad_scale)  # unscaled and left so, as torch's fused optimizers do
        signed = torch._foreach_neg(grads) if hyper.maximize else grads
        direction = torch._foreach_mul(exp_avgs, hyper.beta1)
        torch._foreach_add_(direction, signed, alpha=1.0 - hyper.beta1)
        torch._foreach_sign_(direction)
        torch._foreach_mul_(direction, hyper.lr)
        torch._foreach_mul_(params, 1.0 - hyper.lr * hyper.weight_decay)
        torch._foreach_sub_(params, direction)
        torch._foreach_mul_(exp_avgs, hyper.beta2)
        torch._foreach_add_(exp_avgs, signed, alpha=1.0 - hyper.beta2)

    def torch_words(self, kernel: str) -> str:
        return "torch's foreach ops (_foreach_sign and elementwise arithmetic)"

    def device_coefficients(self, static, lr, steps):
        table = static.clone()
        table[:, _LION_LR] = lr
        table[:, _LION_DECAY] = 1 - lr * static[:, _LION_WEIGHT_DECAY]
        return table[:, :_LION_WEIGHT_DECAY].contiguous()

    def probe_sequences(self, kernel: str) -> list[list[Any]]:
        return []  # never probed: low precision always goes through float32 (native_low_precision)


def _lion_unless_found_inf(hyper, params, grads, exp_avgs, grad_scale, found_inf) -> None:
    """Lion out of place, then written where ``found_inf`` is 0: with it set nothing changes (the gradients stay
    scaled too), and the flag is read on the device only (torch.where), as torch's fused kernels skip a step."""
    unscaled = grads if grad_scale is None else torch._foreach_div(grads, grad_scale)
    signed = torch._foreach_neg(unscaled) if hyper.maximize else unscaled
    direction = torch._foreach_mul(exp_avgs, hyper.beta1)
    torch._foreach_add_(direction, signed, alpha=1.0 - hyper.beta1)
    moves = torch._foreach_mul(torch._foreach_sign(direction), hyper.lr)
    new_params = torch._foreach_mul(params, 1.0 - hyper.lr * hyper.weight_decay)
    torch._foreach_sub_(new_params, moves)
    new_exp_avgs = torch._foreach_mul(exp_avgs, hyper.beta2)
    torch._foreach_add_(new_exp_avgs, signed, alpha=1.0 - hyper.beta2)
    updates = [(params, new_params), (exp_avgs, new_exp_avgs)]
    if grad_scale is not None:
        updates.append((grads, unscaled))
    for targets, values in updates:
        torch._foreach_copy_(targets, [torch.where(found_inf != 0, t, v) for t, v in zip(targets, values)])


LION = _LionFamily()
