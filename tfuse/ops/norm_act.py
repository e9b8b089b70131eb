"""``group_norm_act`` and ``layer_norm_act``: group norm / layer norm (+ residual) + activation, fused.

``act(F.group_norm(x, ...) + residual)`` and ``act(F.layer_norm(x, ...) +
residual)`` in one pass over x forward (two when a group norm's few large
groups are split across the device) and one backward (two when split), with
float32 statistics (float64 for float64 inputs) and the pre-activation
recomputed in backward, never stored: eager keeps the normalised tensor and
the activation's input or output, tfuse keeps x (and the output or residual
where the activation's derivative needs it). The Triton path is in
``_norm_act_triton`` (kernels/norm_act.py); the PyTorch path is torch's own
composition, which is also what ``torch.compile`` traces. On CUDA the
kernels serve every shape but the classes of :data:`EAGER_SHAPE_CLASSES`
(empty until a GPU run measures one slower than eager).

Under CUDA ``torch.autocast`` the result of a 16-bit x is float32, as
torch's group_norm and layer_norm (which CUDA autocast runs in float32) give
it; the kernels read the 16-bit x directly rather than a float32 copy. CPU
autocast leaves both ops in x's dtype, and so does tfuse.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tfuse._backend import Backend, log_backend_once, requested_backend, select_backend
from tfuse.ops._checks import affine_pair
from tfuse.ops._depthwise_args import autocast_dtype
from tfuse.ops._library import compiling
from tfuse.ops._norm_act_checks import NormActCall, checked_call
from tfuse.ops._norm_act_triton import NormActFunction, forward, grad_needed

_log = logging.getLogger(__name__)


def group_norm_act(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    act: str = "relu",
    negative_slope: float | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.group_norm(x, num_groups, weight, bias, eps) + residual)``, fused.

    Statistics per (sample, group) over the group's channels and every
    spatial position, in float32 (float64 for a float64 x), biased variance,
    as ``F.group_norm``. NCHW and channels_last (any channels-innermost
    layout) are read in place and the output keeps x's layout.

    Args:
        x: ``[N, C, *]``, float16/bfloat16/float32/float64.
        num_groups: groups C is divided into (must divide C).
        weight, bias: ``[C]`` or None; x's dtype or float32.
        eps: added to the variance.
        act: any of tfuse's activations (relu, leaky_relu, gelu, gelu_tanh,
            silu, sigmoid, tanh, relu6, hardtanh, hardswish, hardsigmoid, mish, elu, identity).
        negative_slope: leaky_relu's slope (default 0.01); an error with another activation.
        residual: None, or a tensor of x's shape added before the activation.

    Example:
        >>> import torch
        >>> from tfuse.functional import group_norm_act
        >>> x = torch.randn(2, 8, 4, 4)
        >>> y = group_norm_act(x, 4, act="silu")
        >>> torch.allclose(y, torch.nn.functional.silu(torch.nn.functional.group_norm(x, 4)), atol=1e-5)
        True

    Raises:
        TypeError: a non-tensor or non-floating input, a non-int num_groups,
            a non-number eps, weight/bias of another dtype than x's or float32.
        ValueError: x with fewer than 2 dimensions, num_groups not dividing C,
            weight/bias not of shape [C], a residual of another shape, a
            negative or non-finite eps, an unknown activation or a slope with one other than leaky_relu.
        RuntimeError: tensors on different devices.
    """
    call = checked_call("group_norm_act", x, num_groups, weight, bias, residual, eps, act, negative_slope)
    return _run(call, x, weight, bias, residual)


def layer_norm_act(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    act: str = "relu",
    negative_slope: float | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.layer_norm(x, normalized_shape, weight, bias, eps) + residual)``, fused.

    Statistics per row (the trailing ``normalized_shape`` dimensions) in
    float32 (float64 for a float64 x), biased variance, as ``F.layer_norm``.

    Args:
        x: ``[*, *normalized_shape]``, float16/bfloat16/float32/float64.
        normalized_shape: an int or the trailing dimensions normalised over.
        weight, bias: of ``normalized_shape``, or None; x's dtype or float32.
        eps, act, negative_slope, residual: as :func:`group_norm_act`.

    Example:
        >>> import torch
        >>> from tfuse.functional import layer_norm_act
        >>> x = torch.randn(4, 16, 32)
        >>> y = layer_norm_act(x, 32, act="gelu")
        >>> torch.allclose(y, torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (32,))), atol=1e-5)
        True

    Raises:
        TypeError: a non-tensor or non-floating input, a normalized_shape
            that is not ints, a non-number eps, weight/bias of another dtype than x's or float32.
        ValueError: x whose trailing dimensions are not normalized_shape, an
            empty normalized_shape, weight/bias not of that shape, and the
            errors of :func:`group_norm_act`.
        RuntimeError: tensors on different devices.
    """
    call = checked_call("layer_norm_act", x, normalized_shape, weight, bias, residual, eps, act, negative_slope)
    return _run(call, x, weight, bias, residual)


def _torch_path(call: NormActCall, x, weight, bias, residual) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """torch's own composition: F.group_norm / F.layer_norm, the residual add, the activation."""
    if call.normalized_ndim:
        z = F.layer_norm(x, call.normalized_shape, weight, bias, call.eps)
    else:
        # torch 2.13's group norm backward fails ("tensor does not have a device") for a bias without a
        # weight; a weight of ones computes the same.
        w = torch.ones_like(bias) if weight is None and bias is not None else weight
        if _cpu_backward_would_crash(x, w, bias):
            layout = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else None
            z = F.group_norm(x.contiguous(), call.groups, w, bias, call.eps)
            z = z.contiguous(memory_format=layout) if layout else z
        else:
            z = F.group_norm(x, call.groups, w, bias, call.eps)
    return _finish(z, residual, call)


def _cpu_backward_would_crash(x: torch.Tensor, weight, bias) -> bool:  # type: ignore[no-untyped-def]
    """torch 2.13's CPU group norm backward crashes the process (a segmentation fault) for a
    non-contiguous (channels_last) x that needs no gradient while weight or bias does; a contiguous x
    computes the same."""
    return (
        x.device.type == "cpu"
        and not x.is_contiguous()
        and torch.is_grad_enabled()
        and not x.requires_grad
        and any(t is not None and t.requires_grad for t in (weight, bias))
    )


def _finish(z: torch.Tensor, residual: torch.Tensor | None, call: NormActCall) -> torch.Tensor:
    """The PyTorch path's residual add and activation."""
    if residual is not None:
        z = z + residual
    return call.act.forward(z, call.negative_slope)


def _out_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """x's dtype, float32 for a 16-bit x under CUDA autocast (which runs group_norm and layer_norm in
    float32; CPU autocast does not), promoted with the residual's as torch's ``+``."""
    dtype = x.dtype
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda") and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    return torch.promote_types(dtype, residual.dtype) if residual is not None else dtype


#: Shape classes (:func:`shape_class`) where the benchmark (``python -m benchmarks --only group_norm_act
#: --only layer_norm_act`` on a GPU) measured eager torch faster than the fused kernel, so that CUDA calls of
#: them take the PyTorch path. Empty: no GPU has run the kernels yet; the benchmark prints the classes that
#: belong here.
EAGER_SHAPE_CLASSES: frozenset[tuple] = frozenset()
_announced_classes: set[tuple] = set()


def shape_class(op: str, x: torch.Tensor, call: NormActCall) -> tuple:
    """The key of :data:`EAGER_SHAPE_CLASSES`: (op, channels innermost, dtype, row length class).

    A row is what one mean and variance cover (a sample's group, a token's
    features); its length is rounded up to a power of 4, so neighbouring
    stages of a network share a class.

    Example:
        >>> import torch
        >>> from tfuse.ops.norm_act import shape_class
        >>> from tfuse.ops._norm_act_checks import check_layer_norm_call
        >>> x = torch.randn(8, 197, 768)
        >>> shape_class("layer_norm_act", x, check_layer_norm_call(x, 768, None, None, None, 1e-5, "gelu", None))
        ('layer_norm_act', False, torch.float32, 1024)
    """
    if call.normalized_ndim:
        row, innermost = call.channels, False
    else:
        row = x.numel() // max(1, x.shape[0] * call.groups)
        innermost = not x.is_contiguous() and x.dim() >= 3 and x.permute(0, *range(2, x.dim()), 1).is_contiguous()
    return (op, innermost, x.dtype, 4 ** math.ceil(math.log(max(row, 1), 4)))


def _eager_class(op: str, x: torch.Tensor, call: NormActCall) -> bool:
    """On CUDA with no backend forced: whether x's shape class is one of :data:`EAGER_SHAPE_CLASSES` (logged
    once per class at INFO)."""
    if not EAGER_SHAPE_CLASSES or x.device.type != "cuda" or requested_backend() is not None:
        return False
    key = shape_class(op, x, call)
    if key not in EAGER_SHAPE_CLASSES:
        return False
    if key not in _announced_classes:
        _announced_classes.add(key)
        _log.info("tfuse.%s: eager torch for shape class %s (measured faster there)", op, key)
    return True


def _run(call: NormActCall, x, weight, bias, residual) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The Triton path, or torch's (compiling, the PyTorch backend, an eager shape class, or an empty x)."""
    op = call.op
    if compiling() or x.numel() == 0:
        return _torch_path(call, x, weight, bias, residual)
    backend = select_backend(x.device, op, x.numel())
    log_backend_once(_log, op, backend, x.device)
    if backend is Backend.TORCH or _eager_class(op, x, call):
        return _torch_path(call, x, weight, bias, residual)
    out_dtype = _out_dtype(x, residual)
    args = (call, out_dtype, x, weight, bias, residual)
    if grad_needed(x, weight, bias, residual):
        if autocast_dtype(x.device.type) is None:
            return NormActFunction.apply(*args)
        with torch.autocast(x.device.type, enabled=False):
            return NormActFunction.apply(*args)
    weight, bias = affine_pair(weight, bias)
    return forward(x, weight, bias, residual, call, out_dtype)[0]
