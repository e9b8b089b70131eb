"""Adagrad's update over flat buffers: its row (:class:`AdagradStep`) and its family (:data:`ADAGRAD`).

``torch.optim.Adagrad``'s maths for dense gradients::

    g = grad (negated when maximizing) + weight_decay * p
    clr = lr / (1 + (step - 1) * lr_decay)
    sum += g * g
    p -= clr * g / (sqrt(sum) + eps)

The PyTorch path runs torch's fused Adagrad (``torch._fused_adagrad_``) on
the CPU and torch's foreach ops elsewhere, in float32 for float16/bfloat16
buffers (rounded once, as the Triton kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tfuse import kernels
from tfuse.optim._update_buffers import FlatBuffers, RunTable
from tfuse.optim._update_families import UpdateFamily, launch_update

# Columns of the coefficient row (kernels/optim.py's ADAGRAD_*).
_ADAGRAD_CLR = 0
_ADAGRAD_LR_DECAY = 4  # an extra column of the static table on capturable steps


@dataclasses.dataclass(frozen=True)
class AdagradStep:
    """What one Adagrad update does: a parameter group's hyperparameters at one step count (the step taken)."""

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10
    step: int | torch.Tensor = 1  # a 0-dim tensor on capturable steps
    maximize: bool = False

    state_names = ("sum",)
    torch_kernel = "_fused_adagrad_"

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns ADAGRAD_* of kernels/optim.py), computed in float64."""
        return [
            self.lr / (1 + (self.step - 1) * self.lr_decay),
            self.weight_decay,
            self.eps,
            -1.0 if self.maximize else 1.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from: lr = 0, and lr_decay in an extra last column."""
        return [*dataclasses.replace(self, lr=0.0, step=1).coefficients(), self.lr_decay]


class _AdagradFamily(UpdateFamily):
    name = "adagrad"
    kernel_name = "_adagrad_kernel"
    uses_step = True
    # torch's fused CPU Adagrad in float16 rounds an intermediate (seen: 1.8 ulps off the float32 maths rounded
    # once): low-precision buffers go through float32 copies, as the Triton kernel computes.
    native_low_precision = False

    def required_state(self, group):
        return {"step", "sum"}

    def launch(self, buffers: FlatBuffers, table: RunTable, rows, grad_scale, found_inf, meta) -> None:
        launch_update(
            kernels._adagrad_kernel, buffers, (buffers.state["sum"],), table, rows, grad_scale, found_inf, meta
        )

    def torch_call(self, hyper, params, grads, states, grad_scale, found_inf=None):
        step = hyper.step
        if not isinstance(step, torch.Tensor):
            step = torch.tensor(float(step), dtype=torch.float32, device=params[0].device)
        if params[0].device.type == "cpu":
            torch._fused_adagrad_(
                params,
                grads,
                states["sum"],
                [step] * len(params),
                lr=hyper.lr,
                lr_decay=hyper.lr_decay,
                weight_decay=hyper.weight_decay,
                eps=hyper.eps,
                maximize=hyper.maximize,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
            return
        _foreach_adagrad(hyper, step, params, grads, states["sum"], grad_scale, found_inf)

    def device_coefficients(self, static, lr, steps):
        table = static.clone()
        steps = steps.to(torch.float64)
        table[:, _ADAGRAD_CLR] = lr / (1 + (steps - 1) * static[:, _ADAGRAD_LR_DECAY])
        return table[:, :_ADAGRAD_LR_DECAY].contiguous()

    def probe_sequences(self, kernel: str) -> list[list[Any]]:
        return []  # never probed: low precision always goes through float32 (native_low_precision)


def _foreach_adagrad(hyper, step, params, grads, sums, grad_scale, found_inf) -> None:
    """torch's multi-tensor Adagrad maths (devices without a fused Adagrad), out of place then written: with
    ``found_inf`` set nothing changes, and the flag is read on the device only."""
    unscaled = grads if grad_scale is None else torch._foreach_div(grads, grad_scale)
    signed = torch._foreach_neg(unscaled) if hyper.maximize else unscaled
    if hyper.weight_decay != 0:
        signed = torch._foreach_add(signed, params, alpha=hyper.weight_decay)
    new_sums = torch._foreach_addcmul(sums, signed, signed)
    std = torch._foreach_add(torch._foreach_sqrt(new_sums), hyper.eps)
    clr = hyper.lr / (1 + (step.to(torch.float64) - 1) * hyper.lr_decay)  # in float64, as the kernel's row
    new_params = torch._foreach_sub(params, torch._foreach_mul(torch._foreach_div(signed, std), clr))
    updates = [(params, new_params), (sums, new_sums)]
    if grad_scale is not None:
        updates.append((grads, unscaled))
    for targets, values in updates:
        if found_inf is not None:
            values = [torch.where(found_inf != 0, t, v) for t, v in zip(targets, values)]
        torch._foreach_copy_(targets, values)


ADAGRAD = _AdagradFamily()
