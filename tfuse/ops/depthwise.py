"""``tfuse.functional.relu_depthwise_conv2d``: ``act_out(conv2d(act_in(x), w, b, groups=C))`` without storing act_in(x).

PaddlePaddle's ``fuse_relu_depthwise_conv`` pass: in a MobileNet block (BN -> ReLU ->
depthwise conv) the ReLU output exists only to be read by the convolution
and kept for its weight gradient. Here it is never kept:

* what backward saves: ``x`` and ``weight`` (plus, with an ``act_out`` whose
  derivative needs it, the output or the pre-activation); ``act_in(x)`` is
  recomputed in backward, and ``act_in'`` comes from ``x``;
* Triton backend: the activation is applied to each input value as the
  convolution loads it (kernels/depthwise.py): one launch forward, and in
  backward one launch for dx plus one for dw/db (a deterministic reduction
  whose last programs merge the partials);
* PyTorch path (CPU, and GPU shape classes where cuDNN is faster, see
  ``depthwise_backend``): torch's activation and ``conv2d``, the
  activation output freed after forward and recomputed in backward (one
  extra elementwise pass), so the memory saving holds on both paths.

Under ``torch.compile`` the call is traced as torch's activation + conv2d,
which Inductor compiles and schedules itself.

Inside: this module holds the entry point, the dispatch rule and the
autograd Function; ``_depthwise_args`` checks the arguments (and defines
:class:`ConvSpec`), ``_depthwise_triton`` and ``_depthwise_torch`` are the
two paths.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from tfuse._backend import Backend, log_backend_once, requested_backend, select_backend
from tfuse.ops._depthwise_args import (
    _OP,
    ConvSpec,
    _check_activations,
    _check_output_size,
    _check_tensors,
    _is_channels_last,
    _padding,
    _pair,
    autocast_dtype,
)
from tfuse.ops._depthwise_torch import _backward_torch, _composite, _forward_torch
from tfuse.ops._depthwise_triton import _backward_triton, _forward_triton
from tfuse.ops._library import compiling

_log = logging.getLogger(__name__)

#: Most taps (KH * KW) the Triton kernels unroll; larger kernels take the PyTorch path on a GPU.
MAX_TRITON_TAPS = 49

#: Shape classes (see :func:`shape_class`) where a GPU measurement showed the
#: Triton kernel slower than eager activation + cuDNN depthwise convolution
#: (forward + backward); those go to the PyTorch path on CUDA. Filled from
#: ``python -m benchmarks --only depthwise`` on a GPU; empty until one has run.
EAGER_SHAPE_CLASSES: frozenset[tuple] = frozenset()


def relu_depthwise_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    act_in: str = "relu",
    act_out: str | None = None,
    negative_slope: float | None = None,
) -> torch.Tensor:
    """``act_out(F.conv2d(act_in(x), weight, bias, stride, padding, dilation, groups=C))``, act_in(x) never stored.

    A depthwise convolution (depth multiplier 1: ``weight`` is ``[C, 1, kH,
    kW]`` for ``x`` of ``C`` channels) whose input activation is fused into
    its input read, PaddlePaddle's ``fuse_relu_depthwise_conv`` pass. Backward keeps
    ``x`` and ``weight`` only and recomputes the activation, so a BN -> ReLU
    -> depthwise conv block holds one activation-sized tensor less between
    forward and backward than ``F.relu`` + ``F.conv2d``.

    Args:
        x: ``[N, C, H, W]`` or ``[C, H, W]``, NCHW or channels_last (the
            output keeps the memory format), float16/bfloat16/float32/float64.
        weight: ``[C, 1, kH, kW]``, any kernel size; the dtype of ``x``.
        bias: None or ``[C]``.
        stride, padding, dilation: as ``F.conv2d`` (ints or pairs; padding
            also ``"valid"`` or ``"same"``, zeros only).
        act_in: the activation applied to ``x`` (default relu): any of tfuse's
            activations (``identity`` for a plain depthwise convolution).
        act_out: None (default) or an activation applied to the result, as an
            epilogue; its derivative needs the output (relu, sigmoid, tanh,
            leaky_relu) or the pre-activation (the others), which backward keeps.
        negative_slope: leaky_relu's slope (default 0.01), for whichever of
            ``act_in``/``act_out`` is leaky_relu; an error when neither is.

    Computation is float32 (float64 for float64) with one rounding to the
    output dtype; under ``torch.autocast`` the call runs in the autocast
    dtype, as ``F.conv2d`` does. On a CPU it runs the PyTorch path (torch's
    activation and conv2d); on CUDA the Triton kernels, except for the shape
    classes where cuDNN measured faster (``depthwise_backend``).

    Example:
        >>> import torch, tfuse
        >>> x, w = torch.randn(2, 8, 10, 10), torch.randn(8, 1, 3, 3)
        >>> y = tfuse.functional.relu_depthwise_conv2d(x, w, padding=1)
        >>> ref = torch.nn.functional.conv2d(torch.relu(x), w, padding=1, groups=8)
        >>> torch.allclose(y, ref, atol=1e-5)
        True

    Raises:
        TypeError: a non-tensor or non-floating input, mismatched dtypes, a
            non-string activation, a non-integer stride/padding/dilation.
        ValueError: a weight that is not ``[C, 1, kH, kW]`` for the channels
            of ``x`` (another groups or depth multiplier), a bias that is not
            ``[C]``, bad stride/padding/dilation, an input smaller than the
            dilated kernel, an unknown activation or a misplaced slope.
        RuntimeError: tensors on different devices.
    """
    act_in_member, act_out_member, slope = _check_activations(act_in, act_out, negative_slope)
    unbatched = _check_tensors(x, weight, bias)
    kernel = (weight.shape[2], weight.shape[3])
    stride_pair = _pair("stride", stride, minimum=1)
    dilation_pair = _pair("dilation", dilation, minimum=1)
    padding_pair = _padding(padding, kernel, stride_pair, dilation_pair)
    if unbatched:
        x = x.unsqueeze(0)
    autocast = autocast_dtype(x.device.type)
    if autocast is not None:
        # conv2d is on autocast's lower-precision list: compute in the autocast dtype, as F.conv2d does.
        x, weight = x.to(autocast), weight.to(autocast)
        bias = bias.to(autocast) if bias is not None else None
    _check_output_size(x, kernel, stride_pair, padding_pair, dilation_pair)
    if compiling():
        y = _composite(x, weight, bias, stride_pair, padding_pair, dilation_pair, act_in_member, act_out_member, slope)
        return y.squeeze(0) if unbatched else y
    backend = depthwise_backend(x, kernel, stride_pair)
    spec = ConvSpec(stride_pair, padding_pair, dilation_pair, act_in_member, act_out_member, slope, backend)
    if autocast is None:
        y = _ActDepthwiseConvFunction.apply(spec, x, weight, bias)
    else:
        with torch.autocast(x.device.type, enabled=False):
            y = _ActDepthwiseConvFunction.apply(spec, x, weight, bias)
    return y.squeeze(0) if unbatched else y


def shape_class(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int]) -> tuple:
    """The key of :data:`EAGER_SHAPE_CLASSES`: (kernel, stride, channels_last, dtype, spatial size class).

    The spatial class is the input's ``H * W`` rounded up to a power of 4
    (7x7 and 14x14 maps behave alike, 56x56 and 112x112 alike), so a
    measurement at one MobileNet/EfficientNet stage covers its neighbours.
    """
    pixels = max(1, x.shape[-2] * x.shape[-1])
    spatial = 4 ** math.ceil(math.log(pixels, 4))
    return (kernel, stride, _is_channels_last(x), x.dtype, spatial)


def depthwise_backend(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int]) -> Backend:
    """The dispatch rule: which implementation serves a call.

    tfuse's backend rules (:func:`tfuse.select_backend`) first: the PyTorch
    path on a CPU unless Triton's interpreter is on, and whatever
    ``TFUSE_BACKEND``/``use_backend`` forces. On CUDA, when nothing is forced,
    the PyTorch path (eager activation + cuDNN, activation recomputed in
    backward) serves kernels of more than :data:`MAX_TRITON_TAPS` taps and the
    shape classes of :data:`EAGER_SHAPE_CLASSES`, and says so once per class
    in the log; the Triton kernels serve the rest.
    """
    backend = select_backend(x.device, _OP, x.numel())
    if backend is Backend.TRITON and x.device.type == "cuda" and requested_backend() is None:
        key = shape_class(x, kernel, stride)
        reason = eager_reason(key)
        if reason is not None:
            if key not in _announced_classes:
                _announced_classes.add(key)
                _log.info(
                    "tfuse.%s: eager activation + cuDNN for shape class %s (%s); the activation is still "
                    "recomputed in backward rather than stored",
                    _OP,
                    key,
                    reason,
                )
            return Backend.TORCH
    log_backend_once(_log, _OP, backend, x.device)
    return backend


def eager_reason(key: tuple) -> str | None:
    """Why the shape class ``key`` (:func:`shape_class`) goes to eager activation + cuDNN on CUDA; None: Triton."""
    kernel = key[0]
    if kernel[0] * kernel[1] > MAX_TRITON_TAPS:
        return f"a {kernel[0]}x{kernel[1]} kernel has more than {MAX_TRITON_TAPS} taps"
    if key in EAGER_SHAPE_CLASSES:
        return "the depthwise benchmark measured the Triton kernel slower than cuDNN for this shape class"
    return None


_announced_classes: set[tuple] = set()


# --------------------------------------------------------------------------------------------- autograd


class _ActDepthwiseConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: ConvSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):  # type: ignore[override]
        if spec.backend is Backend.TRITON:
            y, saved_out = _forward_triton(x, weight, bias, spec)
        else:
            y, saved_out = _forward_torch(x, weight, bias, spec)
        ctx.spec = spec
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, bias, saved_out)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, weight, bias, saved_out = ctx.saved_tensors
        needed = tuple(ctx.needs_input_grad[1:4])
        spec: ConvSpec = ctx.spec
        if spec.backend is Backend.TRITON and not torch.is_grad_enabled():
            dx, dw, db = _backward_triton(gy, x, weight, bias, saved_out, spec, needed)
        else:
            dx, dw, db = _backward_torch(gy, x, weight, bias, saved_out, spec, needed)
        return None, dx, dw, db
