"""Runs a batch norm plan's kernels: the forward (statistics, then normalise + residual + activation) and the
Triton backward (the reducing pass, then dx), allocating their outputs and scratch buffer.
"""

from __future__ import annotations

import torch

from tfuse.ops._bn_geometry import _in_layout_of
from tfuse.ops._bn_plans import _backward_plan, _BatchNormSpec, _counter_stand_in, _ForwardPlan, _out_dtype


def _forward(spec: _BatchNormSpec, plan: _ForwardPlan | None, x, weight, bias, residual, running_mean, running_var):
    """Runs the forward kernels of ``plan`` (:func:`_plan_of`; None for an empty x); returns (y, stats):
    stats is the [4, C] table + partials (None in eval)."""
    y = torch.empty_like(x, dtype=_out_dtype(x, residual))  # x is dense, so y gets exactly its layout
    if x.numel() == 0:
        return y, None
    device = x.device
    res = residual if residual is not None else x
    normalise = plan.normalise
    if spec.use_batch_stats:
        buf = _statistics(spec, plan, x, weight, bias, running_mean, running_var)
        normalise(
            (x, res, y, buf, buf, buf, buf, *normalise.ints, *spec.eps_split, *spec.slope_split),
            device,
        )
        return y, buf
    normalise(
        (
            x,
            res,
            y,
            running_mean,
            running_var,
            weight if weight is not None else running_mean,
            bias if bias is not None else running_mean,
            *normalise.ints,
            *spec.eps_split,
            *spec.slope_split,
        ),
        device,
    )
    return y, None


def _statistics(spec: _BatchNormSpec, plan: _ForwardPlan, x, weight, bias, running_mean, running_var):
    """The statistics pass of a training forward (x not empty): returns the buffer whose first 4 * C elements are
    the per-channel table [mean, 1/std, scale, bias]; the running statistics are updated in place."""
    buf = torch.empty(plan.buf_size, dtype=plan.acc_dtype, device=x.device)
    update = spec.update_running
    plan.stats(
        (
            x,
            buf,
            running_mean if update else buf,
            running_var if update else buf,
            weight if weight is not None else buf,
            bias if bias is not None else buf,
            plan.counters.ready(),
            *plan.stats.ints,
            *spec.eps_split,
            *spec.momentum_split,
        ),
        x.device,
    )
    return buf


def _backward_kernels(spec, plan, dy, x, weight, bias, src, residual, stats, running, needs, residual_dtype) -> tuple:
    """The Triton backward: (dx, dweight, dbias, dresidual), None where not needed.

    ``plan``: the forward's plan; ``src``: the saved output (activations whose
    derivative follows from it) or the residual; ``stats``: the forward's
    statistics table in training, None in eval (``running`` holds the running
    statistics then).
    """
    need_x, need_weight, need_bias, need_res = needs
    dx = torch.empty_like(x) if need_x else None
    dres = torch.empty_like(x, dtype=residual_dtype) if need_res else None
    dweight = torch.empty_like(weight) if need_weight else None
    dbias = torch.empty_like(bias) if need_bias else None
    if x.numel() == 0:
        return dx, dweight.zero_() if need_weight else None, dbias.zero_() if need_bias else None, dres
    if dy.stride() != x.stride():
        dy = _in_layout_of(dy, x)
    device = x.device
    bwd_key = (needs, dy.dtype)
    bwd = plan.backward.get(bwd_key)
    if bwd is None:
        table = stats if spec.use_batch_stats else running[0]
        bwd = plan.backward[bwd_key] = _backward_plan(
            spec, plan.geometry, x, dy, src, residual, table, weight, bias, needs, residual_dtype
        )
    buf = torch.empty(bwd.buf_size, dtype=bwd.acc_dtype, device=device)
    placeholder = buf
    src_arg = src if src is not None else placeholder
    if spec.use_batch_stats:
        table = var = stats
    else:
        table, var = running
    bwd.reduce(
        (
            dy,
            src_arg,
            x,
            table,
            var,
            weight if weight is not None else table,
            bias if bias is not None else table,
            buf,
            dx if dx is not None else placeholder,
            dres if dres is not None else placeholder,
            dweight if need_weight else placeholder,
            dbias if need_bias else placeholder,
            bwd.counters.ready() if bwd.counters is not None else _counter_stand_in(device),
            *bwd.reduce.ints,
            *spec.eps_split,
            *spec.slope_split,
        ),
        device,
    )
    if bwd.dx is not None:
        bwd.dx(
            (
                dy,
                dres if bwd.from_dz else src_arg,
                x,
                buf,
                dx,
                placeholder,
                *bwd.dx.ints,
                *spec.slope_split,
            ),
            device,
        )
    return dx, dweight, dbias, dres
