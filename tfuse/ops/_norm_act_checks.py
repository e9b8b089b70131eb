"""The argument checks of ``group_norm_act`` and ``layer_norm_act`` (tfuse/ops/norm_act.py).

Every bad argument is refused here, before any launch, with a message that
names the op and the argument. What passes is returned as a
:class:`NormActCall`: the resolved activation, the normalised extent and the
per-channel count the launcher needs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import torch

from tfuse.ops._activations import Activation, check_activation
from tfuse.ops._checks import check_float_dtype


@dataclasses.dataclass(frozen=True)
class NormActCall:
    """A checked call: the op, the activation, its slope, eps, and the shape of what is normalised."""

    op: str
    act: Activation
    negative_slope: float
    eps: float
    channels: int  # elements of weight and bias (C for group norm, prod(normalized_shape) for layer norm)
    groups: int  # group norm's num_groups; 1 for layer norm
    normalized_ndim: int  # layer norm's trailing dimensions; 0 for group norm
    normalized_shape: tuple[int, ...]  # layer norm's; () for group norm


def _check_eps(op: str, eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"tfuse.{op}: eps must be a number, got {type(eps).__name__}")
    value = float(eps)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"tfuse.{op}: eps must be finite and non-negative, got {value}")
    return value


def _check_tensor(op: str, name: str, t: object, x: torch.Tensor, shape: Sequence[int] | None) -> None:
    """``t`` is a floating tensor on x's device, of ``shape`` when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tfuse.{op}: {name} must be a tensor or None, got {type(t).__name__}")
    check_float_dtype(op, name, t.dtype)
    if t.device != x.device:
        raise RuntimeError(f"tfuse.{op}: {name} is on {t.device} but x is on {x.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"tfuse.{op}: {name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_common(op: str, x: object, weight, bias, residual, eps, act, negative_slope, affine_shape):  # type: ignore[no-untyped-def]
    """Checks shared by both ops; returns (activation, slope, eps)."""
    activation, slope = check_activation(op, act, negative_slope, strict=True)
    value = _check_eps(op, eps)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            _check_tensor(op, name, t, x, affine_shape)
            if t.dtype not in (x.dtype, torch.float32):
                raise TypeError(
                    f"tfuse.{op}: {name} has dtype {t.dtype}; it must be x's dtype ({x.dtype}) or torch.float32"
                )
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"tfuse.{op}: weight ({weight.dtype}) and bias ({bias.dtype}) must have one dtype")
    if residual is not None:
        _check_tensor(op, "residual", residual, x, x.shape)
    return activation, slope, value


def _check_x(op: str, x: object, min_dims: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tfuse.{op}: x must be a tensor, got {type(x).__name__}")
    check_float_dtype(op, "x", x.dtype)
    if x.dim() < min_dims:
        raise ValueError(f"tfuse.{op}: x must have at least {min_dims} dimensions, got shape {list(x.shape)}")
    return x


def check_group_norm_call(x, num_groups, weight, bias, residual, eps, act, negative_slope) -> NormActCall:  # type: ignore[no-untyped-def]
    """All checks of :func:`tfuse.functional.group_norm_act`, in torch's terms where it has them."""
    op = "group_norm_act"
    x = _check_x(op, x, 2)
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral):
        raise TypeError(f"tfuse.{op}: num_groups must be an int, got {type(num_groups).__name__}")
    channels = x.shape[1]
    if num_groups < 1 or channels % num_groups:
        raise ValueError(
            f"tfuse.{op}: num_groups={num_groups} must be positive and divide the {channels} channels of x "
            f"(shape {list(x.shape)})"
        )
    activation, slope, value = _check_common(op, x, weight, bias, residual, eps, act, negative_slope, (channels,))
    return NormActCall(op, activation, slope, value, channels, int(num_groups), 0, ())


def normalized_shape_of(op: str, normalized_shape: object) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of ints (an int is one dimension), as ``F.layer_norm`` takes it."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        return (int(normalized_shape),)
    if isinstance(normalized_shape, (Sequence, torch.Size)) and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in normalized_shape
    ):
        return tuple(int(d) for d in normalized_shape)
    raise TypeError(f"tfuse.{op}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")


def check_layer_norm_call(x, normalized_shape, weight, bias, residual, eps, act, negative_slope) -> NormActCall:  # type: ignore[no-untyped-def]
    """All checks of :func:`tfuse.functional.layer_norm_act`, in torch's terms where it has them."""
    op = "layer_norm_act"
    shape = normalized_shape_of(op, normalized_shape)
    if not shape:
        raise ValueError(f"tfuse.{op}: normalized_shape must name at least one dimension, got ()")
    x = _check_x(op, x, len(shape))
    if tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"tfuse.{op}: x of shape {list(x.shape)} does not end in normalized_shape {list(shape)}")
    activation, slope, value = _check_common(op, x, weight, bias, residual, eps, act, negative_slope, shape)
    return NormActCall(op, activation, slope, value, math.prod(shape), 1, len(shape), shape)


_CHECKS = {"group_norm_act": check_group_norm_call, "layer_norm_act": check_layer_norm_call}
#: Calls whose arguments passed the checks, by :func:`_call_key`: a layer calls with the same shapes, dtypes
#: and options step after step, so its checks run once (the PyTorch path then costs about what eager does).
_checked: dict[tuple, NormActCall] = {}
_MAX_CHECKED = 256


def _tensor_key(t: object) -> tuple | None:
    if t is None:
        return None
    if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
        raise TypeError  # not cacheable: the checks run and say what is wrong
    return (t.dtype, t.shape, t.device)


def checked_call(op: str, x, groups_or_shape, weight, bias, residual, eps, act, negative_slope) -> NormActCall:  # type: ignore[no-untyped-def]
    """The checks of ``op`` (``"group_norm_act"`` or ``"layer_norm_act"``), run once per distinct call."""
    try:
        shape_key = (
            tuple(groups_or_shape) if isinstance(groups_or_shape, (list, tuple, torch.Size)) else groups_or_shape
        )
        key = (
            op,
            *map(_tensor_key, (x, weight, bias, residual)),
            type(groups_or_shape),
            shape_key,
            type(eps),
            eps,
            act,
            type(negative_slope),
            negative_slope,
        )
        call = _checked.get(key)
    except TypeError:  # a non-tensor or an unhashable argument: checked every call
        key = call = None
    if call is None:
        call = _CHECKS[op](x, groups_or_shape, weight, bias, residual, eps, act, negative_slope)
        if key is not None:
            if len(_checked) >= _MAX_CHECKED:
                _checked.clear()
            _checked[key] = call
    return call
