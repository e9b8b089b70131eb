"""The backward of ``tfuse.add_act`` on both backends: the gradients of its inputs.

* Triton (:func:`_backward_triton`): one launch of the backward kernel for
  every input that needs a gradient, plus one small launch that finishes the
  float32 reductions of broadcast inputs; the launch plan comes from
  :mod:`tfuse.ops._add_act_plan`.
* PyTorch (:func:`_backward_torch`): torch's activation backward and
  ``sum_to_size``; differentiable, so it also serves ``create_graph=True``.

Both read what :func:`tfuse.ops.add_act._add_act_setup` put on the autograd
ctx (or the backward op's :class:`~tfuse.ops.add_act._BackwardArgs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tfuse import kernels
from tfuse._backend import interpreter_active
from tfuse._kit import acc_dtype, split_float
from tfuse._launch import gpu_sm_count, launch, target_programs
from tfuse.ops._activations import GradSource
from tfuse.ops._add_act_forward import _sum_torch
from tfuse.ops._add_act_plan import _backward_plan


def _backward_torch(ctx, grad_out: torch.Tensor, saved: Sequence[torch.Tensor], needed: Sequence[bool]) -> list:
    """The PyTorch path's backward, and every backward under ``create_graph=True``.

    Under ``create_graph`` (grad mode on in backward) every step is a
    differentiable torch op (torch's activation backward kernels have
    derivatives of their own, and a saved output leads back to this
    Function), so the gradients can be differentiated again.
    """
    spec = ctx.spec
    acc = acc_dtype(grad_out.dtype, *(d for _, d in ctx.input_meta))
    dy = grad_out.to(acc)
    if ctx.grad_source is GradSource.NONE:
        source = None
    elif ctx.grad_source is GradSource.OUTPUT:
        source = saved[0].to(acc)
    elif torch.is_grad_enabled():
        source = saved[0].to(acc)
        for tensor in saved[1:]:
            source = source + tensor.to(acc)
    else:
        source = _sum_torch(saved, acc)
    dz = spec.act.backward(dy, source, spec.negative_slope)
    grads = []
    for (shape, dtype), need in zip(ctx.input_meta, needed):
        if not need:
            grads.append(None)
            continue
        grad = dz if shape == dz.shape else dz.sum_to_size(shape)
        grads.append(grad.to(dtype))
    return grads


def _backward_triton(ctx, grad_out: torch.Tensor, saved: Sequence[torch.Tensor], needed: Sequence[bool]) -> list:
    spec = ctx.spec
    out_shape, out_strides = ctx.out_layout
    device = grad_out.device
    if math.prod(out_shape) == 0:
        return [
            torch.zeros(shape, dtype=dtype, device=device) if need else None
            for (shape, dtype), need in zip(ctx.input_meta, needed)
        ]

    sources = () if ctx.grad_source is GradSource.NONE else tuple(saved)
    bwd = _backward_plan(
        tuple(out_shape),
        tuple(out_strides),
        tuple(ctx.input_meta),
        tuple(bool(n) for n in needed),
        (tuple(grad_out.shape), grad_out.stride(), grad_out.dtype),
        tuple((tuple(t.shape), t.stride()) for t in sources),
        spec.act.code,
        ctx.grad_source is GradSource.OUTPUT,
        gpu_sm_count(device),
        target_programs(device),
        interpreter_active(),
    )
    grads = [torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype, _ in bwd.slots]
    partials = [
        grad if n_partials is None else torch.empty(n_partials * grad.numel(), dtype=bwd.acc_dtype, device=device)
        for grad, n_partials in zip(grads, bwd.n_partials)
    ]
    launch(
        kernels._add_act_bwd_kernel,
        bwd.grid,
        (
            grad_out,
            bwd.dy_strides,
            sources,
            bwd.src_strides,
            tuple(partials),
            *bwd.static_args,
            *split_float(spec.negative_slope),
        ),
        bwd.meta,
        device,
    )
    if bwd.reduced:
        launch(
            kernels._sum_partials_kernel,
            bwd.sum_grid,
            (
                tuple(partials[i] for i in bwd.reduced),
                tuple(grads[i] for i in bwd.reduced),
                tuple(bwd.n_partials[i] for i in bwd.reduced),
                tuple(grads[i].numel() for i in bwd.reduced),
            ),
            bwd.sum_meta,
            device,
        )

    result: list[torch.Tensor | None] = [None] * len(ctx.input_meta)
    for grad, (_, _, _, indices) in zip(grads, bwd.slots):
        for index in indices:
            result[index] = grad
    return result


def _empty_grad(shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A gradient buffer; every element is written by the backward kernels."""
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype, device=device)
