"""LARS's update over flat buffers: its row (:class:`LarsStep`) and its family (:data:`LARS`).

LARS with momentum (You et al. 2017, "Large Batch Training of Convolutional
Networks", Algorithm 1), in the form of MLPerf's ResNet-50 reference::

    trust = eta ||p|| / (||g|| + weight_decay ||p|| + eps)   (1 where a norm is 0)
    v = momentum v + lr * trust * (g + weight_decay p)
    p -= v                          (Nesterov: p -= momentum v + lr * trust * (g + weight_decay p))

Per-parameter norms, so each parameter is a run of its own and the Triton
path takes three launches per flat buffer (``kernels/trust.py``); the PyTorch
path runs torch's foreach ops over whole parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from tfuse import kernels
from tfuse._kit import acc_dtype
from tfuse._launch import launch
from tfuse.optim._per_parameter import PerParameterFamily, WholeParameters, sharded_scaled_lr, trust_ratios
from tfuse.optim._update_buffers import FlatBuffers, RunTable

# Columns of the coefficient row (kernels/trust.py's LARS_*).
_LARS_LR, _LARS_WEIGHT_DECAY, _LARS_TRUST_COEFFICIENT, _LARS_EPS, _LARS_ADAPT, _LARS_ROW = 0, 2, 3, 4, 7, 8


@dataclasses.dataclass(frozen=True)
class LarsStep:
    """What one LARS update does: a parameter group's hyperparameters."""

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    momentum: float = 0.9
    weight_decay: float = 0.0
    trust_coefficient: float = 0.001  # eta
    eps: float = 0.0
    nesterov: bool = False
    adapt: bool = True  # scale by the trust ratio (False: plain SGD with momentum, as for excluded groups)
    maximize: bool = False

    state_names = ("momentum_buffer",)
    torch_kernel = "_foreach_norm"  # the op the PyTorch path is named by (with torch's other foreach ops)

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns LARS_* of kernels/trust.py)."""
        return [
            self.lr,
            self.momentum,
            self.weight_decay,
            self.trust_coefficient,
            self.eps,
            1.0 if self.nesterov else 0.0,
            -1.0 if self.maximize else 1.0,
            1.0 if self.adapt else 0.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from: every column but the learning rate's."""
        return dataclasses.replace(self, lr=0.0).coefficients()


class _LarsFamily(PerParameterFamily):
    name = "lars"
    kernel_name = "_lars_norms_kernel, _trust_ratio_kernel and _lars_update_kernel"
    uses_step = False

    def required_state(self, group):
        return {"momentum_buffer"}

    def launch(self, buffers: FlatBuffers, table: RunTable, rows, grad_scale, found_inf, meta) -> None:
        param, device = buffers.param, buffers.param.device
        starts, ends, block_rows = table.blocks(device)
        block_runs = table.runs_of_blocks(device)[3]
        master = param if buffers.master is None else buffers.master
        acc = acc_dtype(param.dtype)
        partials = torch.empty(2 * starts.numel(), dtype=acc, device=device)
        skip = rows if found_inf is None else found_inf
        grid = (starts.numel(),)
        scale = rows if grad_scale is None else grad_scale
        norms = (param, buffers.grad, master, starts, ends, block_rows, rows, scale, skip, partials)
        launch(kernels._lars_norms_kernel, grid, norms, meta, device)
        if buffers.reduce_sums is not None:  # a shard: norms of whole parameters, summed across ranks
            scaled_lr = sharded_scaled_lr(
                table, partials, buffers.reduce_sums, lambda norms, run_rows: _scaled_lr(norms, rows[run_rows])
            )
        else:
            scaled_lr = trust_ratios(
                table, partials, rows, device, ROW=_LARS_ROW, LR=_LARS_LR, ADAPT=_LARS_ADAPT, TRUST_CLIP=0,
                LARS=True, ETA=_LARS_TRUST_COEFFICIENT, WEIGHT_DECAY=_LARS_WEIGHT_DECAY, EPS=_LARS_EPS,
            )  # fmt: skip
        update_meta = {k: v for k, v in meta.items() if k != "GRAD_SCALE"}  # (phase 1 left the gradients unscaled)
        momentum_buffer = buffers.state["momentum_buffer"]
        update = (param, buffers.grad, momentum_buffer, master, starts, ends, block_rows, rows, skip, scaled_lr,
                  block_runs)  # fmt: skip
        launch(kernels._lars_update_kernel, grid, update, update_meta, device)

    def device_coefficients(self, static, lr, steps):
        table = static.clone()
        table[:, _LARS_LR] = lr
        return table

    def torch_rows(self, hyper: LarsStep, whole: WholeParameters, grad_scale, found_inf) -> Iterator[torch.Tensor]:
        return _lars_torch(hyper, whole, grad_scale, found_inf)


def _scaled_lr(norms: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``lr * trust`` from each run's (||p||, ||g||) and coefficient row: the trust-ratio kernel's LARS rule."""
    row = rows.to(norms.dtype)
    w, g = norms.unbind(1)
    ones = torch.ones_like(w)
    decay, eta, eps = row[:, _LARS_WEIGHT_DECAY], row[:, _LARS_TRUST_COEFFICIENT], row[:, _LARS_EPS]
    ratio = torch.where((w > 0) & (g > 0), eta * w / (g + decay * w + eps), ones)
    return row[:, _LARS_LR] * torch.where(row[:, _LARS_ADAPT] != 0, ratio, ones)


def _lars_torch(hyper: LarsStep, whole: WholeParameters, grad_scale, found_inf) -> Iterator[torch.Tensor]:
    """One row's parameters (whole runs, or a shard's parts of them) on the PyTorch path: out of place, then
    written (found_inf: unchanged). A generator (PerParameterFamily.torch_update): yields the runs' squared
    norms, takes the whole parameters' norms (None: the runs are whole)."""
    velocities_flat = whole.buffers.state["momentum_buffer"]
    params, (grads, unscaled) = whole.views(whole.source), whole.unscaled_grads(grad_scale)
    velocities = whole.views(velocities_flat)
    signed = torch._foreach_neg(unscaled) if hyper.maximize else unscaled
    steps = torch._foreach_add(signed, params, alpha=hyper.weight_decay) if hyper.weight_decay else list(signed)
    if hyper.adapt:
        w_norms = torch.stack(torch._foreach_norm(params))
        g_norms = torch.stack(torch._foreach_norm(unscaled))
    else:
        w_norms = g_norms = torch.zeros(len(params), dtype=params[0].dtype, device=params[0].device)
    whole_norms = yield torch.stack([w_norms, g_norms], 1).square()
    if whole_norms is not None:
        w_norms, g_norms = whole_norms.unbind(1)
    if hyper.adapt:
        ratios = hyper.trust_coefficient * w_norms / (g_norms + hyper.weight_decay * w_norms + hyper.eps)
        ratios = torch.where((w_norms > 0) & (g_norms > 0), ratios, torch.ones_like(ratios))
        steps = [step * scale for step, scale in zip(steps, (ratios * hyper.lr).unbind())]  # (device scalars)
    else:
        steps = torch._foreach_mul(steps, hyper.lr)
    new_velocities = torch._foreach_add(torch._foreach_mul(velocities, hyper.momentum), steps)
    moves = (
        torch._foreach_add(torch._foreach_mul(new_velocities, hyper.momentum), steps)
        if hyper.nesterov
        else (new_velocities)
    )
    targets = [(whole.source, params, torch._foreach_sub(params, moves)), (velocities_flat, velocities, new_velocities)]
    if grad_scale is not None:
        targets.append((whole.buffers.grad, grads, unscaled))
    whole.write(targets, found_inf)


LARS = _LarsFamily()
