"""``torch.ops.tfuse.batch_norm_act`` and ``torch.ops.tfuse.batch_norm_act_backward``, written once as
:class:`tfuse.ops._library.OpDef`: the op ``batch_norm_act`` calls while ``torch.compile`` traces it, and
whose eager autograd Function its Triton path runs.
"""

from __future__ import annotations

import torch

from tfuse._backend import Backend
from tfuse.ops._activations import Activation
from tfuse.ops._bn_geometry import _in_layout_of, _layout
from tfuse.ops._bn_passes import _backward_kernels, _forward
from tfuse.ops._bn_plans import _BatchNormSpec, _ForwardPlan, _plan_of, _spec
from tfuse.ops._bn_torch import _backward_differentiable, _batch_norm_act_torch, _stats_table_torch
from tfuse.ops._library import DTYPES, compiling, dtype_code, op_backend, tfuse_op


def _batch_norm_act_traced(
    x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
) -> torch.Tensor:
    """What :func:`batch_norm_act` is under ``torch.compile``: the registered op, which returns the
    updated running statistics (an op with a derivative may not mutate its inputs); they are copied
    into the buffers here, which Inductor turns into one in-place write."""
    y, _, new_mean, new_var = torch.ops.tfuse.batch_norm_act(
        x,
        weight,
        bias,
        residual,
        running_mean,
        running_var,
        bool(training),
        float(momentum),
        float(eps),
        int(act),
        float(negative_slope),
    )
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
    return y


def _batch_norm_act_setup(ctx, inputs, output, spec=None, plan=None) -> None:  # type: ignore[no-untyped-def]
    """Keeps what backward reads: x, the affine parameters, the output (activations whose derivative
    follows from it) or the residual, the forward's statistics table (training) or the running
    statistics (eval). ``spec``, ``plan``: the eager Triton caller's, whose backward reuses the plan."""
    x, weight, bias, residual, running_mean, running_var, training, _, eps, act, negative_slope = inputs
    y = output[0]
    stats = output[1] if len(output) > 1 else None
    ctx.set_materialize_grads(False)  # the statistics outputs get no gradient: no zero tensors for them
    ctx.mark_non_differentiable(*output[1:])
    ctx.eager = spec is not None
    if spec is None:
        spec = _spec(Activation(act), negative_slope, eps, 0.0, training, False, int(x.shape[1]))
    ctx.spec, ctx.plan = spec, plan
    ctx.has_residual = residual is not None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    src = y if spec.from_output else residual
    running = (running_mean, running_var) if not spec.use_batch_stats else ()
    if ctx.eager:
        # The eager statistics buffer ([4, C] table + the forward's partials) is this op's intermediate:
        # kept on ctx, not among the saved tensors (which hold only x-sized and per-channel tensors).
        ctx.stats = stats
        ctx.save_for_backward(x, weight, bias, src, *running)
    else:
        ctx.save_for_backward(x, weight, bias, src, stats, *running)


def _batch_norm_act_backward(ctx, dy, *_):  # type: ignore[no-untyped-def]
    """(dx, dweight, dbias, dresidual): differentiable torch ops under ``create_graph=True``; the eager
    caller's plan straight from Python; the backward op when traced (or for the registered op)."""
    if dy is None:  # no gradient reached y (grads are not materialised): none for the inputs either
        return (None,) * 11
    if ctx.eager:
        x, weight, bias, src, *running = ctx.saved_tensors
        stats = ctx.stats
    else:
        x, weight, bias, src, stats, *running = ctx.saved_tensors
    spec = ctx.spec
    needs = tuple(ctx.needs_input_grad[:4])
    if torch.is_grad_enabled():  # create_graph=True: gradients that can be differentiated again
        filled = _affine(weight, bias)
        grads = _backward_differentiable(spec, dy, x, *filled, src, tuple(running), ctx.residual_dtype, needs)
    elif ctx.eager and not compiling():
        residual = src if (ctx.has_residual and not spec.from_output) else None
        grads = _backward_kernels(
            spec, ctx.plan, dy, x, weight, bias, src, residual, stats, running, needs, ctx.residual_dtype
        )
    else:  # the op's gradients are empty tensors where not needed
        grads = _batch_norm_act_backward_op.call(
            dy,
            x,
            weight,
            bias,
            src,
            stats if stats is not None else x.new_empty(0, dtype=torch.float32),
            running[0] if running else None,
            running[1] if running else None,
            spec.use_batch_stats,
            spec.eps,
            int(spec.act),
            spec.negative_slope,
            -1 if ctx.residual_dtype is None else dtype_code(ctx.residual_dtype),
            list(needs),
        )
        grads = tuple(g if need else None for g, need in zip(grads, needs))
    return (*grads, None, None, None, None, None, None, None)


@tfuse_op("tfuse::batch_norm_act", setup_context=_batch_norm_act_setup, backward=_batch_norm_act_backward)
def _batch_norm_act_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    act: int,
    negative_slope: float,
    *,
    spec: _BatchNormSpec | None = None,
    plan: _ForwardPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.tfuse.batch_norm_act``: :func:`batch_norm_act` as a functional op (arguments checked
    by the caller).

    Returns ``(y, stats, new_running_mean, new_running_var)``: ``stats`` is
    what backward reads on the Triton path in training (the statistics
    table; empty otherwise); the running statistics updated with
    ``momentum`` in training with running statistics (empty otherwise),
    new tensors, for the caller to copy into its buffers.

    The eager Triton path passes its ``spec`` and ``plan`` (inputs already dense, in a layout the kernels
    read): the running statistics are then updated in place, as ``F.batch_norm`` does, and the outputs
    are ``(y, stats)`` in training, ``(y,)`` in eval.
    """
    if spec is not None:
        y, stats = _forward(spec, plan, x, weight, bias, residual, running_mean, running_var)
        return (y,) if stats is None else (y, stats)  # type: ignore[return-value]
    activation = Activation(act)
    backend = op_backend(x.device, "batch_norm_act", x)
    update = training and running_mean is not None
    nothing = x.new_empty(0, dtype=torch.float32)
    new_mean = running_mean.clone(memory_format=torch.contiguous_format) if update else nothing.clone()
    new_var = running_var.clone(memory_format=torch.contiguous_format) if update else nothing.clone()
    mean, var = (new_mean, new_var) if update else (running_mean, running_var)
    if backend is Backend.TORCH:
        if not training:
            y = _batch_norm_act_torch(
                x, mean, var, weight, bias, False, momentum, eps, activation, negative_slope, residual
            )
            return y, nothing, new_mean, new_var
        # Nothing mutated inside the op: F.batch_norm with batch statistics, the running ones computed from
        # the same statistics (updating a clone in place inside the op broke Inductor's functionalisation
        # on CUDA with torch 2.11: "copy_ ... clone" in the joint graph).
        y = _batch_norm_act_torch(
            x, None, None, weight, bias, True, momentum, eps, activation, negative_slope, residual
        )
        table, batch_mean, batch_var = _stats_table_torch(x, weight, bias, eps, residual)
        if update:
            count = x.numel() // x.shape[1]
            unbiased = batch_var * (count / (count - 1))
            new_mean = (running_mean.to(batch_mean.dtype) * (1.0 - momentum) + batch_mean * momentum).to(new_mean.dtype)
            new_var = (running_var.to(unbiased.dtype) * (1.0 - momentum) + unbiased * momentum).to(new_var.dtype)
        return y, table, new_mean, new_var
    weight, bias = _affine(weight, bias)
    if mean is not None and not (mean.is_contiguous() and var.is_contiguous()):
        mean, var = mean.contiguous(), var.contiguous()  # read only (eval): dense copies
    if _layout(x) is None:
        x = x.contiguous()
    if residual is not None:
        residual = _in_layout_of(residual, x)
    spec = _spec(activation, negative_slope, eps, momentum, training, update, int(x.shape[1]))
    plan = _plan_of(spec, x, weight, bias, residual, mean, var) if x.numel() else None
    y, stats = _forward(spec, plan, x, weight, bias, residual, mean, var)
    if stats is None:
        return y, nothing, new_mean, new_var
    return y, stats[: 4 * x.shape[1]], new_mean, new_var  # the table; the partials after it are the forward's own


def _affine(weight: torch.Tensor | None, bias: torch.Tensor | None) -> tuple:
    """Weight and bias as the kernels take them: both or neither, dense (one alone: torch's 1 or 0 for the other)."""
    if weight is None and bias is not None:
        weight = torch.ones_like(bias)
    elif bias is None and weight is not None:
        bias = torch.zeros_like(weight)
    if weight is not None and not (weight.is_contiguous() and bias.is_contiguous()):
        weight, bias = weight.contiguous(), bias.contiguous()
    return weight, bias


@tfuse_op("tfuse::batch_norm_act_backward")
def _batch_norm_act_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    src: torch.Tensor | None,
    stats: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    eps: float,
    act: int,
    negative_slope: float,
    residual_dtype: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.tfuse.batch_norm_act_backward``: ``(dx, dweight, dbias, dresidual)`` of
    ``torch.ops.tfuse.batch_norm_act``, empty where ``needs`` (x, weight, bias, residual) says no.

    ``src``: the forward's output for activations whose derivative follows from
    it (relu, leaky_relu >= 0, sigmoid, tanh, identity), else the residual;
    ``stats``: the forward's second output; ``residual_dtype``: a code of
    :data:`tfuse.ops._library.DTYPES`, or -1 without a residual.
    """
    activation = Activation(act)
    backend = op_backend(x.device, "batch_norm_act", x)
    has_residual = residual_dtype >= 0
    res_dtype = DTYPES[residual_dtype] if has_residual else None
    filled_weight, filled_bias = _affine(weight, bias)
    running = (running_mean, running_var) if not training else ()
    spec = _spec(activation, negative_slope, eps, 0.0, training, False, int(x.shape[1]))
    needs = tuple(needs)
    if backend is Backend.TORCH:
        grads = _backward_differentiable(spec, dy, x, filled_weight, filled_bias, src, running, res_dtype, needs)
    else:
        if _layout(x) is None:
            x = x.contiguous()
        if src is not None:
            src = _in_layout_of(src, x)
        residual = src if has_residual and not spec.from_output else None
        stand_in = None if not has_residual else (residual if residual is not None else x.new_empty(0, dtype=res_dtype))
        if running and not (running_mean.is_contiguous() and running_var.is_contiguous()):
            running = (running_mean.contiguous(), running_var.contiguous())
        plan = _plan_of(spec, x, filled_weight, filled_bias, stand_in, *(running or (None, None)))
        grads = _backward_kernels(
            spec,
            plan,
            dy,
            x,
            filled_weight,
            filled_bias,
            src,
            residual,
            stats if training else None,
            running,
            needs,
            res_dtype,
        )
    return tuple(g if g is not None else x.new_empty(0) for g in grads)  # type: ignore[return-value]
