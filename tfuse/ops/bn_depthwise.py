"""``batch_norm_act_depthwise_conv2d``: batch norm -> activation -> depthwise convolution, the normalised
activation never written.

The block every MobileNetV2/V3, EfficientNet and MnasNet layer is made of:
``conv2d(act(batch_norm(x)), w, b, groups=C)``. Eager PyTorch writes the
batch norm's output, writes the activation's output, keeps one of them (or
both) for backward and reads them back. Here:

* Triton path, training forward, 2 launches: batch norm's statistics pass
  over ``x`` (its last programs merge the per-channel table [mean, 1/std,
  scale, bias] and update the running statistics; kernels/batch_norm.py),
  then the depthwise kernel, which normalises each value of ``x`` with the
  table as it loads it, applies the activation and convolves
  (kernels/depthwise.py, AFFINE_IN). Eval: the table from the running
  statistics (a few per-channel ops) and the depthwise kernel.
* Triton path, backward, 4 launches: the depthwise weight/bias gradients
  (recomputing ``act(z)`` from ``x`` and the table), the depthwise input
  gradient masked by ``act'(z)`` (writing ``dz``, the gradient at the batch
  norm's output), then batch norm's backward on ``dz`` (its reducing pass,
  whose last programs merge d(weight), d(bias) and the dx coefficients, and
  its dx pass).
* Saved for backward: ``x``, the parameters and the per-channel statistics;
  no activation-sized tensor besides ``x``.
* PyTorch path (CPU; CUDA shape classes where the depthwise rule sends
  cuDNN): ``torch.native_batch_norm``, the activation and ``conv2d``, with
  the normalised and activated tensors freed after forward and recomputed
  in backward, so the memory saving holds on both paths.

Under ``torch.compile`` the call is traced as ``F.batch_norm``, the activation
and ``F.conv2d``, which Inductor compiles itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from tfuse._backend import Backend
from tfuse._kit import acc_dtype
from tfuse.ops._activations import Activation, GradSource
from tfuse.ops._bn_checks import _check_call
from tfuse.ops._bn_geometry import _layout
from tfuse.ops._bn_passes import _backward_kernels, _statistics
from tfuse.ops._bn_plans import _BatchNormSpec, _plan_of, _spec
from tfuse.ops._checks import affine_pair
from tfuse.ops._depthwise_args import (
    ConvSpec,
    _check_output_size,
    _check_tensors,
    _padding,
    _pair,
    autocast_dtype,
)
from tfuse.ops._depthwise_triton import _backward_triton, _forward_triton
from tfuse.ops._library import compiling
from tfuse.ops.depthwise import depthwise_backend

_OP = "batch_norm_act_depthwise_conv2d"


def batch_norm_act_depthwise_conv2d(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "relu",
    negative_slope: float | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
) -> torch.Tensor:
    """``F.conv2d(act(F.batch_norm(x, ...)), conv_weight, conv_bias, stride, padding, dilation, groups=C)``,
    with the normalised activation never written.

    The batch norm arguments are ``F.batch_norm``'s (statistics over N, H, W
    in float32, biased variance to normalise, unbiased into ``running_var``,
    updated in place with ``momentum`` when ``training``); the convolution is
    depthwise with depth multiplier 1 (``conv_weight`` is ``[C, 1, kH, kW]``),
    with ``F.conv2d``'s stride, padding (ints, pairs, ``"same"``, ``"valid"``;
    zeros) and dilation. ``act`` is any of tfuse's activations. Backward keeps
    ``x`` (no normalised or activated tensor) and recomputes the rest.

    Args:
        x: ``[N, C, H, W]``, NCHW or channels_last (the output keeps the
            format), float16/bfloat16/float32/float64.
        running_mean, running_var: ``[C]`` running statistics, or None (batch
            statistics in every mode, as ``track_running_stats=False``).
        bn_weight, bn_bias: ``[C]`` or None (``affine=False``).
        conv_weight: ``[C, 1, kH, kW]``; conv_bias: None or ``[C]``.
        training, momentum, eps: as ``F.batch_norm``.
        act: the activation between them (default relu).
        negative_slope: leaky_relu's slope (default 0.01); an error with another activation.
        stride, padding, dilation: as ``F.conv2d``.

    Under ``torch.autocast`` the block runs in the autocast dtype (``x`` and
    the convolution weights are cast to it, as ``F.conv2d`` casts its input;
    statistics stay float32).

    Example:
        >>> import torch, tfuse
        >>> x, w = torch.randn(4, 8, 10, 10), torch.randn(8, 1, 3, 3)
        >>> mean, var = torch.zeros(8), torch.ones(8)
        >>> y = tfuse.functional.batch_norm_act_depthwise_conv2d(
        ...     x, mean, var, None, None, w, training=True, act="relu6", padding=1)
        >>> eager = torch.nn.functional.conv2d(
        ...     torch.nn.functional.relu6(torch.nn.functional.batch_norm(x, None, None, training=True)),
        ...     w, padding=1, groups=8)
        >>> torch.allclose(y, eager, atol=1e-4)
        True

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`tfuse.functional.batch_norm_act` for the batch norm
            arguments and :func:`tfuse.functional.relu_depthwise_conv2d` for the convolution's, before any
            launch; x that is not 4-D.
    """
    if isinstance(x, torch.Tensor) and x.dim() != 4:
        raise ValueError(f"tfuse.{_OP}: x must be [N, C, H, W], got shape {list(x.shape)}")
    act_member, slope, channels = _check_call(
        x, running_mean, running_var, bn_weight, bn_bias, None, training, momentum, eps, act, negative_slope
    )
    _check_tensors(x, conv_weight, conv_bias)
    kernel = (conv_weight.shape[2], conv_weight.shape[3])
    stride_pair = _pair("stride", stride, minimum=1)
    dilation_pair = _pair("dilation", dilation, minimum=1)
    padding_pair = _padding(padding, kernel, stride_pair, dilation_pair)
    autocast = autocast_dtype(x.device.type)
    if autocast is not None:
        x, conv_weight = x.to(autocast), conv_weight.to(autocast)
        conv_bias = conv_bias.to(autocast) if conv_bias is not None else None
    _check_output_size(x, kernel, stride_pair, padding_pair, dilation_pair)
    bn_args = (running_mean, running_var, bn_weight, bn_bias, bool(training), float(momentum), float(eps))
    if compiling():
        z = F.batch_norm(x, *bn_args)
        return F.conv2d(
            act_member.forward(z, slope), conv_weight, conv_bias, stride_pair, padding_pair, dilation_pair, channels
        )
    backend = depthwise_backend(x, kernel, stride_pair)
    conv = ConvSpec(stride_pair, padding_pair, dilation_pair, act_member, Activation.IDENTITY, slope, backend)
    block = _Block(
        conv,
        _spec(
            Activation.IDENTITY,
            0.0,
            float(eps),
            float(momentum),
            bool(training),
            bool(training) and running_mean is not None,
            channels,
        ),
    )
    if backend is Backend.TRITON and _layout(x) is None:
        x = x.contiguous()  # batch norm's kernels read NCHW-contiguous or channels_last
    args = (block, x, running_mean, running_var, bn_weight, bn_bias, conv_weight, conv_bias)
    if autocast is None:
        return _BatchNormActDepthwiseFunction.apply(*args)
    with torch.autocast(x.device.type, enabled=False):
        return _BatchNormActDepthwiseFunction.apply(*args)


@dataclasses.dataclass(frozen=True)
class _Block:
    conv: ConvSpec  # the convolution and the activation (act_in); act_out is identity
    bn: _BatchNormSpec  # identity activation: the block's activation is applied on the convolution's load


def _eval_table(x, running_mean, running_var, weight, bias, eps: float) -> torch.Tensor:
    """Batch norm's per-channel table [mean, 1/std, scale, bias] from the running statistics (eval)."""
    dtype = acc_dtype(x.dtype)
    mean = running_mean.to(dtype)
    invstd = torch.rsqrt(running_var.to(dtype) + eps)
    scale = invstd * weight.to(dtype) if weight is not None else invstd
    shift = bias.to(dtype) if bias is not None else torch.zeros_like(mean)
    return torch.stack([mean, invstd, scale, shift]).contiguous()


class _BatchNormActDepthwiseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: _Block, x, running_mean, running_var, bn_weight, bn_bias, conv_weight, conv_bias):  # type: ignore[override]
        ctx.block = block
        if block.conv.backend is Backend.TRITON:
            weight, bias = affine_pair(bn_weight, bn_bias)
            if running_mean is not None and not (running_mean.is_contiguous() and running_var.is_contiguous()):
                raise ValueError(f"tfuse.{_OP}: running_mean and running_var must be contiguous")
            y, stats, table = _forward_triton_block(
                block, x, running_mean, running_var, weight, bias, conv_weight, conv_bias
            )
            ctx.save_for_backward(x, running_mean, running_var, weight, bias, conv_weight, conv_bias, stats, table)
            return y
        y, save_mean, save_invstd = _forward_torch_block(
            block, x, running_mean, running_var, bn_weight, bn_bias, conv_weight, conv_bias
        )
        ctx.save_for_backward(
            x, running_mean, running_var, bn_weight, bn_bias, conv_weight, conv_bias, save_mean, save_invstd
        )
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):  # type: ignore[override]
        block: _Block = ctx.block
        need_x, _, _, need_w, need_b, need_cw, need_cb = ctx.needs_input_grad[1:8]
        if block.conv.backend is Backend.TRITON:
            x, running_mean, running_var, weight, bias, conv_weight, conv_bias, stats, table = ctx.saved_tensors
            need_bn = need_x or need_w or need_b
            dz, dcw, dcb = _backward_triton(
                gy, x, conv_weight, conv_bias, None, block.conv, (need_bn, need_cw, need_cb), table=table
            )
            dx = dw = db = None
            if need_bn:
                needs = (need_x, need_w and weight is not None, need_b and bias is not None, False)
                dx, dw, db, _ = _backward_kernels(
                    block.bn,
                    _plan(block, x, weight, bias, running_mean, running_var),
                    dz,
                    x,
                    weight,
                    bias,
                    None,
                    None,
                    stats,
                    (running_mean, running_var),
                    needs,
                    x.dtype,
                )
            return None, dx, None, None, dw, db, dcw, dcb
        x, running_mean, running_var, bn_weight, bn_bias, conv_weight, conv_bias, save_mean, save_invstd = (
            ctx.saved_tensors
        )
        dx, dw, db, dcw, dcb = _backward_torch_block(
            block,
            gy,
            x,
            running_mean,
            running_var,
            bn_weight,
            bn_bias,
            conv_weight,
            conv_bias,
            save_mean,
            save_invstd,
            (need_x, need_w, need_b, need_cw, need_cb),
        )
        return None, dx, None, None, dw, db, dcw, dcb


def _plan(block: _Block, x, weight, bias, running_mean, running_var):  # type: ignore[no-untyped-def]
    return _plan_of(block.bn, x, weight, bias, None, running_mean, running_var)


def _forward_triton_block(block: _Block, x, running_mean, running_var, weight, bias, conv_weight, conv_bias):  # type: ignore[no-untyped-def]
    """(y, the statistics buffer (training) or None, the per-channel table the convolution normalised with)."""
    spec = block.bn
    stats = None
    if x.numel() == 0:
        table = torch.zeros((4, x.shape[1]), dtype=acc_dtype(x.dtype), device=x.device)
    elif spec.use_batch_stats:
        plan = _plan(block, x, weight, bias, running_mean, running_var)
        stats = _statistics(spec, plan, x, weight, bias, running_mean, running_var)
        table = stats  # its first 4 * C elements are the table
    else:
        table = _eval_table(x, running_mean, running_var, weight, bias, spec.eps)
    y, _ = _forward_triton(x, conv_weight, conv_bias, block.conv, table=table)
    return y, stats, table


def _forward_torch_block(block: _Block, x, running_mean, running_var, bn_weight, bn_bias, conv_weight, conv_bias):  # type: ignore[no-untyped-def]
    """(y, batch mean, batch 1/std): torch's batch norm, activation and conv2d; their outputs freed on return."""
    spec, conv = block.bn, block.conv
    z, save_mean, save_invstd = torch.native_batch_norm(
        x, bn_weight, bn_bias, running_mean, running_var, spec.use_batch_stats, spec.momentum, spec.eps
    )
    a = conv.act_in.forward_(z, conv.negative_slope)  # z is ours: the activation overwrites it
    y = F.conv2d(a, conv_weight, conv_bias, conv.stride, conv.padding, conv.dilation, x.shape[1])
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        y = y.contiguous(memory_format=torch.channels_last)
    return y, save_mean, save_invstd


def _backward_torch_block(
    block: _Block,
    gy,
    x,
    running_mean,
    running_var,
    bn_weight,
    bn_bias,
    conv_weight,  # type: ignore[no-untyped-def]
    conv_bias,
    save_mean,
    save_invstd,
    needs,
):
    """(dx, d bn_weight, d bn_bias, d conv_weight, d conv_bias): the normalised activation recomputed from x."""
    spec, conv = block.bn, block.conv
    need_x, need_w, need_b, need_cw, need_cb = needs
    if spec.use_batch_stats:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = running_mean, torch.rsqrt(running_var + spec.eps)
    shape = (1, -1, 1, 1)
    dtype = acc_dtype(x.dtype)
    z = (x.to(dtype) - mean.to(dtype).view(shape)) * invstd.to(dtype).view(shape)
    if bn_weight is not None:
        z = z * bn_weight.to(dtype).view(shape)
    if bn_bias is not None:
        z = z + bn_bias.to(dtype).view(shape)
    z = z.to(x.dtype)
    a = conv.act_in.forward(z, conv.negative_slope)
    need_bn = need_x or need_w or need_b
    da, dcw, dcb = torch.ops.aten.convolution_backward(
        gy,
        a,
        conv_weight,
        [conv_weight.shape[0]] if conv_bias is not None else None,
        conv.stride,
        conv.padding,
        conv.dilation,
        False,
        [0, 0],
        x.shape[1],
        [need_bn, need_cw, need_cb and conv_bias is not None],
    )
    dx = dw = db = None
    if need_bn:
        # The saved value act' reads: z, or act(z) for the activations whose derivative follows from the
        # output (relu and leaky_relu read either: the sign is the same).
        keep = a if conv.act_in.grad_source(conv.negative_slope) is GradSource.OUTPUT else z
        dz = conv.act_in.backward(da, keep, conv.negative_slope)
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            dz,
            x,
            bn_weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            spec.use_batch_stats,
            spec.eps,
            [need_x, need_w and bn_weight is not None, need_b and bn_bias is not None],
        )
    return dx, dw, db, dcw if need_cw else None, dcb if need_cb and conv_bias is not None else None
