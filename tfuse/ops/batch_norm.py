"""``batch_norm_act``: batch norm (+ residual) + activation, fused (kernels/batch_norm.py).

Launches: training forward 2 (the statistics, whose partials the last
program of each column group merges into the table with the
running-statistics update; the normalise + residual + activation pass); eval
forward 1. Training backward 2 (a reducing pass that also writes d(residual)
and whose last programs merge d(weight), d(bias) and the dx coefficients;
the dx pass), 1 when x needs no gradient; eval backward 1. No merge has a
launch of its own: see kernels/batch_norm.py ("last program merges").

Layouts: x is read in place when it is NCHW-contiguous or channels_last (for
1-D/3-D inputs: contiguous, or channels innermost); any other layout is
copied to contiguous first. The residual and dy take x's layout (copied
when theirs differs), so every kernel addresses all full-size tensors alike.

Host cost: everything that depends only on shapes, strides, dtypes and flags
(tiling, grids, compile-time switches, the reduction grid sized from the
compiled kernel's occupancy) is computed once and cached; a call allocates
the outputs and one float32 scratch buffer per pass and launches.

Arrival counters: each merging reduction (the statistics; the backward sums
when weight, bias or x need gradients) counts its programs' arrivals in
int32 counters of its own, one per column group and one per block of chunks
(``groups * (1 + blocks)``), held by its plan: allocated zeroed once, when
the plan is built. Every launch leaves them 0, so nothing clears them
between calls or CUDA graph replays, and a replay allocates nothing.
Launches of one plan must therefore not overlap on the device (as launches
on one stream never do); concurrent streams running the same shapes would
need plans of their own. Plans dropped from the cache give their counters
to later plans (a captured graph may still point at them). The merge costs
no launch and no pass: the partials are read once, as a separate merge
kernel read them, plus each block's partial once more when a group's chunks
are merged in two levels; each program adds one or two atomics.

Statistics are float32 (float64 for float64 inputs). Saved for backward:
x, weight and bias, plus the output y for activations whose derivative
follows from it (relu, sigmoid, tanh, leaky_relu with slope >= 0), else the
residual; the pre-activation is recomputed, never stored. The per-channel
statistics table (training) or the running statistics (eval) go along too.

Inside: this module (the public :func:`batch_norm_act`, its Triton path),
``_bn_checks`` (the argument checks), ``_bn_geometry`` (layouts, tilings and
grids), ``_bn_plans`` (cached launch plans, arrival counters), ``_bn_passes``
(running a plan's kernels), ``_bn_torch`` (the PyTorch path and the
differentiable backward) and ``_bn_op`` (the ``torch.library`` ops).
"""

from __future__ import annotations

import logging

import torch

from tfuse._backend import Backend, log_backend_once, select_backend
from tfuse.ops._bn_checks import _call_key, _check_call, _checked_calls

# Besides what this module uses, the names it held before it was split, for code that reads them here
# (ruff: F401). They are aliases: the code reads each name in its defining module, so a test patches it
# there; a patch here would reach nothing.
from tfuse.ops._bn_geometry import (  # noqa: F401
    _SEG_LANE,
    _SEG_ONE,
    _SEG_PACKED,
    ELEMENTS_PER_THREAD,
    ELEMENTWISE_PROGRAMS_PER_SM,
    MAX_CHANNEL_BLOCK,
    MAX_STEPS,
    ONE_LEVEL_STEPS,
    TILE_ELEMENTWISE,
    TILE_REDUCE,
    _geometry_of,
    _in_layout_of,
    _layout,
)
from tfuse.ops._bn_op import _batch_norm_act_op, _batch_norm_act_traced
from tfuse.ops._bn_passes import _forward
from tfuse.ops._bn_plans import MAX_PLANS, _plan_of, _spec  # (its mutable plan caches: patch them there)
from tfuse.ops._bn_torch import _batch_norm_act_torch
from tfuse.ops._library import compiling

_log = logging.getLogger(__name__)


def batch_norm_act(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "relu",
    negative_slope: float | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(batch_norm(x) + residual)``: ``F.batch_norm`` fused with a residual add and an activation.

    Arguments as for ``F.batch_norm`` (``x`` of shape ``[N, C, ...]``;
    statistics over every dimension but 1, in float32 with Welford/Chan
    merging; biased variance to normalise, unbiased into ``running_var``,
    updated in place with ``momentum`` when ``training``), plus ``act``
    (relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh, relu6, hardtanh, hardswish, hardsigmoid,
    mish, elu, identity),
    ``negative_slope`` (leaky_relu only, default 0.01) and an optional
    ``residual`` of ``x``'s shape added before the activation. NCHW and
    channels_last inputs are read in place; the output has ``x``'s layout,
    and x's dtype promoted with the residual's, as torch's ``+`` does.

    As in ``F.batch_norm``: ``momentum`` is a number (any value; the modules
    turn ``momentum=None``, a cumulative average, into ``1 / num_batches_tracked``);
    ``eps`` is refused where the installed torch refuses it (2.13: not positive
    in training, negative in eval), with torch's words; eval needs
    the running statistics; weight or bias may be given alone; weight, bias
    and the running statistics share one dtype, x's or float32 (torch takes
    float32 with a 16-bit x only; tfuse with a float64 x too, normalising in
    float64). Double backward (``create_graph=True``) is supported.

    Example:
        >>> import torch
        >>> from tfuse.functional import batch_norm_act
        >>> x, skip = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
        >>> mean, var = torch.zeros(3), torch.ones(3)
        >>> y = batch_norm_act(x, mean, var, training=True, residual=skip)
        >>> y.shape
        torch.Size([4, 3, 5, 5])

    Raises:
        TypeError: a non-tensor or non-floating input, a non-number momentum or eps.
        ValueError: x with fewer than 2 dimensions; one value per channel in
            training; eps out of range; per-channel tensors of the wrong size
            (or x with another channel count than they have); a residual of
            another shape; only one of running_mean and running_var; an
            unknown activation, or a slope with one other than leaky_relu.
        RuntimeError: eval without running statistics, mixed parameter
            dtypes, tensors on different devices.
    """
    key = _call_key(x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope)
    checked = _checked_calls.get(key) if key is not None else None
    if checked is None:
        checked = _check_call(
            x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope
        )
        if key is not None:
            if len(_checked_calls) >= MAX_PLANS:
                _checked_calls.clear()
            _checked_calls[key] = checked
    act, negative_slope, channels = checked
    if compiling():
        return _batch_norm_act_traced(
            x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
        )
    backend = select_backend(x.device, "batch_norm_act", x.numel())
    log_backend_once(_log, "batch_norm_act", backend, x.device)
    if backend is Backend.TORCH:
        return _batch_norm_act_torch(
            x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
        )
    if weight is None and bias is not None:
        weight = torch.ones_like(bias)  # torch normalises with weight 1 when only a bias is given
    elif bias is None and weight is not None:
        bias = torch.zeros_like(weight)
    if weight is not None and not (weight.is_contiguous() and bias.is_contiguous()):
        weight, bias = weight.contiguous(), bias.contiguous()  # the kernels index them densely
    if running_mean is not None and not (running_mean.is_contiguous() and running_var.is_contiguous()):
        # The kernels index them densely and update them in place: run on dense copies, then write them back.
        dense_mean, dense_var = running_mean.contiguous(), running_var.contiguous()
        y = _batch_norm_act_triton(
            x, dense_mean, dense_var, weight, bias, training, momentum, eps, act, negative_slope, residual, channels
        )
        if training:
            running_mean.copy_(dense_mean)
            running_var.copy_(dense_var)
        return y
    return _batch_norm_act_triton(
        x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual, channels
    )


def _batch_norm_act_triton(
    x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual, channels
) -> torch.Tensor:
    """The Triton path of :func:`batch_norm_act` (arguments checked; per-channel tensors dense)."""
    if _layout(x) is None:
        x = x.contiguous()  # the output and gradients take x's layout, so it must be one the kernels read
    if residual is not None:
        residual = _in_layout_of(residual, x)
    spec = _spec(
        act,
        negative_slope,
        float(eps),
        float(momentum),
        bool(training),
        bool(training) and running_mean is not None,
        channels,
    )
    plan = _plan_of(spec, x, weight, bias, residual, running_mean, running_var) if x.numel() else None
    tensors = (x, weight, bias, residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        args = (x, weight, bias, residual, running_mean, running_var, training, momentum, eps, act, negative_slope)
        return _batch_norm_act_op.apply(*args, spec=spec, plan=plan)[0]
    return _forward(spec, plan, x, weight, bias, residual, running_mean, running_var)[0]
