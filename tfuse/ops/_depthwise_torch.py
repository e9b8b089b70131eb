"""The PyTorch path of ``relu_depthwise_conv2d``: torch's activation and ``conv2d``, act_in(x) never kept.

Forward frees the activation output on return and backward recomputes it
(one extra elementwise pass), so the memory saving of the Triton path holds
here too. The backward is differentiable: it also serves
``create_graph=True`` on every backend. :func:`_composite` is the
computation in torch ops, traced under ``torch.compile``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tfuse.ops._activations import Activation, GradSource
from tfuse.ops._depthwise_args import ConvSpec, _is_channels_last


def _composite(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    act_in: Activation,
    act_out: Activation,
    slope: float,
) -> torch.Tensor:
    """The computation in torch ops (traced by torch.compile; the reference of every path)."""
    z = F.conv2d(act_in.forward(x, slope), weight, bias, stride, padding, dilation, x.shape[1])
    return act_out.forward(z, slope)


def _forward_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, what act_out's backward needs); act_in(x) is a temporary freed on return."""
    a = spec.act_in.forward(x, spec.negative_slope)
    z = F.conv2d(a, weight, bias, spec.stride, spec.padding, spec.dilation, x.shape[1])
    del a
    if _is_channels_last(x) and not z.is_contiguous(memory_format=torch.channels_last):
        # The output keeps x's format; torch's CUDA conv2d returns float64 channels_last input as NCHW.
        z = z.contiguous(memory_format=torch.channels_last)
    source = spec.saved_output
    if source is GradSource.NONE:
        return z, None
    if source is GradSource.OUTPUT:
        y = spec.act_out.forward_(z, spec.negative_slope)  # z is ours: overwrite it
        return y, y
    return spec.act_out.forward(z, spec.negative_slope), z


def _backward_torch(
    gy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved_out: torch.Tensor | None,
    spec: ConvSpec,
    needed: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dx, dw, db with torch ops: differentiable, so it also serves ``create_graph=True`` on every backend."""
    slope = spec.negative_slope
    gz = gy
    if spec.saved_output is not GradSource.NONE:
        if torch.is_grad_enabled() and spec.saved_output is GradSource.INPUT:
            # Double backward: z must lead back to x and weight, so it is recomputed on the graph.
            a = spec.act_in.forward(x, slope)
            saved_out = F.conv2d(a, weight, bias, spec.stride, spec.padding, spec.dilation, x.shape[1])
        gz = spec.act_out.backward(gy, saved_out, slope)
    in_source = spec.act_in.grad_source(slope)
    needs_a = needed[1] or (needed[0] and in_source is GradSource.OUTPUT and spec.act_in not in _SIGN_ACTIVATIONS)
    a = spec.act_in.forward(x, slope) if needs_a else x
    da, dw, db = torch.ops.aten.convolution_backward(
        gz,
        a,
        weight,
        [weight.shape[0]] if bias is not None else None,
        spec.stride,
        spec.padding,
        spec.dilation,
        False,
        [0, 0],
        x.shape[1],
        [needed[0], needed[1], needed[2] and bias is not None],
    )
    dx = None
    if needed[0]:
        if in_source is GradSource.NONE:
            dx = da
        else:
            # relu and leaky_relu (slope >= 0) read their derivative off the sign, which x has as act(x) has.
            keep = x if in_source is GradSource.INPUT or spec.act_in in _SIGN_ACTIVATIONS else a
            dx = spec.act_in.backward(da, keep, slope)
    return dx, dw if needed[1] else None, db if needed[2] and bias is not None else None


#: Activations whose derivative follows from the sign of their input as well as from their output.
_SIGN_ACTIVATIONS = (Activation.RELU, Activation.LEAKY_RELU)
