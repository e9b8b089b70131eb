"""The PyTorch path of ``batch_norm_act``, in torch ops: the forward, the statistics table the Triton forward
hands its backward, and the backward in differentiable ops (for ``create_graph=True``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tfuse._kit import acc_dtype
from tfuse.ops._activations import GradSource
from tfuse.ops._bn_plans import _out_dtype


def _batch_norm_act_torch(
    x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
) -> torch.Tensor:
    """The PyTorch path: F.batch_norm, the residual add and the activation (in place on a fresh tensor)."""
    stats = (running_mean, running_var)
    if x.dtype == torch.float64 and any(t is not None and t.dtype == torch.float32 for t in (*stats, weight, bias)):
        # float32 parameters with a float64 x (which torch does not take): in float64, statistics written back.
        weight, bias = (t.double() if t is not None else None for t in (weight, bias))
        running_mean, running_var = (t.double() if t is not None else None for t in stats)
    elif training and running_mean is not None and not (running_mean.is_contiguous() and running_var.is_contiguous()):
        # cuDNN's batch norm updates dense copies of non-contiguous running statistics and drops them
        # (pytorch#33867): run on dense copies here and write them back below, on every device.
        running_mean, running_var = running_mean.contiguous(), running_var.contiguous()
    if weight is None and bias is not None:
        # torch's weight 1, said explicitly: torch 2.11's CUDA backward of a bias-only batch norm raises
        # "tensor does not have a device".
        weight = torch.ones_like(bias)
    y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    if training and stats[0] is not None and stats[0] is not running_mean:
        stats[0].copy_(running_mean)
        stats[1].copy_(running_var)
    if residual is not None:
        y = y + residual
    return act.forward_(y, negative_slope)  # y is a fresh tensor: in place is safe


def _stats_table_torch(x, weight, bias, eps: float, residual) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics table the Triton forward hands its backward, [mean, 1/std, weight/std, bias] per
    channel (flattened), in torch ops (the PyTorch path's op output has the Triton path's shape), with
    the batch mean and (biased) variance it was made of."""
    acc = acc_dtype(_out_dtype(x, residual))
    dims = [0, *range(2, x.dim())]
    xa = x.to(acc)
    var, mean = torch.var_mean(xa, dims, correction=0)
    invstd = torch.rsqrt(var + eps)
    scale = invstd if weight is None else weight.to(acc) * invstd
    shift = torch.zeros_like(mean) if bias is None else bias.to(acc)
    return torch.stack([mean, invstd, scale, shift]).flatten(), mean, var


def _backward_differentiable(spec, dy, x, weight, bias, src, running, residual_dtype, needs) -> tuple:
    """The backward in differentiable torch ops, for ``create_graph=True`` (double backward).

    The same maths as the kernels, in float32 (float64 for float64): dz =
    dy * act'(.) from the saved output or the recomputed pre-activation, then
    batch norm's backward with the statistics recomputed from x (or the
    running ones in eval). A saved output leads back to this op's Function,
    so every dependency is in the graph.
    """
    need_x, need_weight, need_bias, need_res = needs
    acc = acc_dtype(dy.dtype)
    dims = [0, *range(2, x.dim())]
    view = (1, -1) + (1,) * (x.dim() - 2)
    xa = x.to(acc)
    if spec.use_batch_stats:
        mean = xa.mean(dims, keepdim=True)
        var = (xa - mean).square().mean(dims, keepdim=True)
    else:
        mean, var = (t.to(acc).view(view) for t in running)
    invstd = torch.rsqrt(var + spec.eps)
    xhat = (xa - mean) * invstd
    g = dy.to(acc)
    source = spec.act.grad_source(spec.negative_slope)
    if source is GradSource.INPUT:
        saved = xhat if weight is None else xhat * weight.to(acc).view(view) + bias.to(acc).view(view)
        if src is not None:
            saved = saved + src.to(acc)
    else:
        saved = src.to(acc) if source is GradSource.OUTPUT else None
    dz = spec.act.backward(g, saved, spec.negative_slope)
    dres = dz.to(residual_dtype) if need_res else None
    dbias = dz.sum(dims).to(bias.dtype) if need_bias else None
    dweight = (dz * xhat).sum(dims).to(weight.dtype) if need_weight else None
    dx = None
    if need_x:
        dxhat = dz if weight is None else dz * weight.to(acc).view(view)
        if spec.use_batch_stats:
            dxhat = dxhat - dxhat.mean(dims, keepdim=True) - xhat * (dxhat * xhat).mean(dims, keepdim=True)
        dx = (dxhat * invstd).to(x.dtype)
    return dx, dweight, dbias, dres
