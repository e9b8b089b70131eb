"""LAMB's update over flat buffers: its row (:class:`LambStep`) and its family (:data:`LAMB`).

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2) per parameter::

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p
    p -= lr * trust * u,    trust = ||p|| / ||u||   (1 where a norm is 0)

The norms are per parameter, so each parameter is a run of its own
(``per_parameter``) and the Triton path takes three launches per flat buffer
(``kernels/trust.py``: moments, direction and partial sums, the trust ratio
of each parameter, the update), the direction kept between them in a scratch
buffer of the accumulator dtype (4 bytes per float32 parameter, freed after
the step). The PyTorch path runs torch's foreach ops over whole
parameters (float32 for float16/bfloat16 buffers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from tfuse import kernels
from tfuse._kit import acc_dtype
from tfuse._launch import launch
from tfuse.optim._per_parameter import PerParameterFamily, WholeParameters, sharded_scaled_lr, trust_ratios
from tfuse.optim._update_buffers import FlatBuffers, RunTable

# Columns of the coefficient row (kernels/trust.py's LAMB_*).
_LAMB_LR, _LAMB_BETA1, _LAMB_BETA2, _LAMB_BC1, _LAMB_BC2_SQRT = 0, 1, 3, 7, 8
_LAMB_ADAPT, _LAMB_TRUST_CLIP, _LAMB_ROW = 10, 11, 12
_LAMB_BIAS_CORRECTION = 12  # an extra column of the static table on capturable steps


@dataclasses.dataclass(frozen=True)
class LambStep:
    """What one LAMB update does: a parameter group's hyperparameters at one step count (the step taken)."""

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.0
    step: int | torch.Tensor = 1  # a 0-dim tensor on capturable steps
    bias_correction: bool = True
    adapt: bool = True  # scale by the trust ratio (False: a plain Adam-like step with lr)
    trust_clip: bool = False  # trust ratio at most 1
    maximize: bool = False

    state_names = ("exp_avg", "exp_avg_sq")
    torch_kernel = "_foreach_norm"  # the op the PyTorch path is named by (with torch's other foreach ops)

    def corrections(self) -> tuple[float, float]:
        """(1 - beta1**step, sqrt(1 - beta2**step)), or (1, 1) without bias correction."""
        if not self.bias_correction:
            return 1.0, 1.0
        return 1 - self.beta1**self.step, (1 - self.beta2**self.step) ** 0.5

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns LAMB_* of kernels/trust.py), computed in float64."""
        bc1, bc2_sqrt = self.corrections()
        return [
            self.lr,
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            self.eps,
            self.weight_decay,
            bc1,
            bc2_sqrt,
            -1.0 if self.maximize else 1.0,
            1.0 if self.adapt else 0.0,
            1.0 if self.trust_clip else 0.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from (lr 0, step 1), and the bias-correction switch."""
        row = dataclasses.replace(self, lr=0.0, step=1).coefficients()
        return [*row, 1.0 if self.bias_correction else 0.0]


class _LambFamily(PerParameterFamily):
    name = "lamb"
    kernel_name = "_lamb_moments_kernel, _trust_ratio_kernel and _lamb_update_kernel"
    uses_step = True

    def required_state(self, group):
        return {"step", "exp_avg", "exp_avg_sq"}

    def launch(self, buffers: FlatBuffers, table: RunTable, rows, grad_scale, found_inf, meta) -> None:
        param, device = buffers.param, buffers.param.device
        starts, ends, block_rows = table.blocks(device)
        block_runs = table.runs_of_blocks(device)[3]
        master = param if buffers.master is None else buffers.master
        exp_avg, exp_avg_sq = buffers.state["exp_avg"], buffers.state["exp_avg_sq"]
        acc = acc_dtype(param.dtype)
        partials = torch.empty(2 * starts.numel(), dtype=acc, device=device)
        direction = torch.empty(param.numel(), dtype=acc, device=device)  # u between the first and last launch
        skip = rows if found_inf is None else found_inf
        grid = (starts.numel(),)
        launch(
            kernels._lamb_moments_kernel,
            grid,
            (
                param,
                buffers.grad,
                exp_avg,
                exp_avg_sq,
                master,
                starts,
                ends,
                block_rows,
                rows,
                rows if grad_scale is None else grad_scale,
                skip,
                partials,
                direction,
            ),
            meta,
            device,
        )
        if buffers.reduce_sums is not None:  # a shard: norms of whole parameters, summed across ranks
            scaled_lr = sharded_scaled_lr(
                table, partials, buffers.reduce_sums, lambda norms, run_rows: _scaled_lr(norms, rows[run_rows])
            )
        else:
            scaled_lr = trust_ratios(
                table,
                partials,
                rows,
                device,
                ROW=_LAMB_ROW,
                LR=_LAMB_LR,
                ADAPT=_LAMB_ADAPT,
                TRUST_CLIP=_LAMB_TRUST_CLIP,
                LARS=False,
                ETA=0,
                WEIGHT_DECAY=0,
                EPS=0,
            )
        update_meta = {k: v for k, v in meta.items() if k != "GRAD_SCALE"}
        launch(
            kernels._lamb_update_kernel,
            grid,
            (param, master, direction, starts, ends, block_rows, rows, skip, scaled_lr, block_runs),
            update_meta,
            device,
        )

    def device_coefficients(self, static, lr, steps):
        table = static.clone()
        steps = steps.to(torch.float64)
        corrected = static[:, _LAMB_BIAS_CORRECTION] != 0
        table[:, _LAMB_LR] = lr
        bc1 = 1 - torch.pow(static[:, _LAMB_BETA1], steps)
        bc2_sqrt = torch.sqrt(1 - torch.pow(static[:, _LAMB_BETA2], steps))
        table[:, _LAMB_BC1] = torch.where(corrected, bc1, torch.ones_like(bc1))
        table[:, _LAMB_BC2_SQRT] = torch.where(corrected, bc2_sqrt, torch.ones_like(bc2_sqrt))
        return table[:, :_LAMB_BIAS_CORRECTION].contiguous()

    def torch_rows(self, hyper: LambStep, whole: WholeParameters, grad_scale, found_inf) -> Iterator[torch.Tensor]:
        return _lamb_torch(hyper, whole, grad_scale, found_inf)


def _scaled_lr(norms: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``lr * trust`` from each run's (||p||, ||u||) and coefficient row: the trust-ratio kernel's LAMB rule."""
    row = rows.to(norms.dtype)
    w, u = norms.unbind(1)
    ones = torch.ones_like(w)
    ratio = torch.where((w > 0) & (u > 0), w / u, ones)
    ratio = torch.where(row[:, _LAMB_TRUST_CLIP] != 0, ratio.clamp(max=1.0), ratio)
    return row[:, _LAMB_LR] * torch.where(row[:, _LAMB_ADAPT] != 0, ratio, ones)


def _lamb_torch(hyper: LambStep, whole: WholeParameters, grad_scale, found_inf) -> Iterator[torch.Tensor]:
    """One row's parameters (whole runs, or a shard's parts of them) on the PyTorch path: out of place, then
    written (found_inf: unchanged). A generator (PerParameterFamily.torch_update): yields the runs' squared
    norms, takes the whole parameters' norms (None: the runs are whole)."""
    state = whole.buffers.state
    params, (grads, unscaled) = whole.views(whole.source), whole.unscaled_grads(grad_scale)
    exp_avgs, exp_avg_sqs = whole.views(state["exp_avg"]), whole.views(state["exp_avg_sq"])
    signed = torch._foreach_neg(unscaled) if hyper.maximize else unscaled
    new_exp_avgs = torch._foreach_mul(exp_avgs, hyper.beta1)
    torch._foreach_add_(new_exp_avgs, signed, alpha=1.0 - hyper.beta1)
    new_exp_avg_sqs = torch._foreach_mul(exp_avg_sqs, hyper.beta2)
    torch._foreach_addcmul_(new_exp_avg_sqs, signed, signed, value=1.0 - hyper.beta2)
    bc1, bc2_sqrt = _corrections(hyper)
    denominators = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(new_exp_avg_sqs), bc2_sqrt), hyper.eps)
    directions = torch._foreach_div(torch._foreach_div(new_exp_avgs, bc1), denominators)
    if hyper.weight_decay != 0:
        torch._foreach_add_(directions, params, alpha=hyper.weight_decay)
    if hyper.adapt:
        w_norms = torch.stack(torch._foreach_norm(params))
        u_norms = torch.stack(torch._foreach_norm(directions))
    else:
        w_norms = u_norms = torch.zeros(len(params), dtype=params[0].dtype, device=params[0].device)
    whole_norms = yield torch.stack([w_norms, u_norms], 1).square()
    if whole_norms is not None:
        w_norms, u_norms = whole_norms.unbind(1)
    if hyper.adapt:
        ratios = torch.where((w_norms > 0) & (u_norms > 0), w_norms / u_norms, torch.ones_like(w_norms))
        if hyper.trust_clip:
            ratios = ratios.clamp(max=1.0)
        for direction, scale in zip(directions, (ratios * hyper.lr).unbind()):
            direction.mul_(scale)  # (a device scalar each: no host read)
    else:
        torch._foreach_mul_(directions, hyper.lr)
    targets = [
        (whole.source, params, torch._foreach_sub(params, directions)),
        (state["exp_avg"], exp_avgs, new_exp_avgs),
        (state["exp_avg_sq"], exp_avg_sqs, new_exp_avg_sqs),
    ]
    if grad_scale is not None:
        targets.append((whole.buffers.grad, grads, unscaled))
    whole.write(targets, found_inf)


def _corrections(hyper: LambStep) -> tuple[Any, Any]:
    """The bias corrections of a row whose step may be a device tensor (capturable)."""
    if not hyper.bias_correction:
        return 1.0, 1.0
    step = hyper.step.to(torch.float64) if isinstance(hyper.step, torch.Tensor) else hyper.step
    return 1 - hyper.beta1**step, (1 - hyper.beta2**step) ** 0.5


LAMB = _LambFamily()
