"""The activations tfuse fuses: names, kernel codes, and their PyTorch path.

The PyTorch path uses torch's own activation kernels and their fused backward
kernels, on float32 (float64) tensors.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from tfuse import kernels

#: Activation name -> constexpr code of kernels/activations.py.
ACTIVATIONS: dict[str, int] = {
    "relu": kernels.activations.RELU.value,
    "leaky_relu": kernels.activations.LEAKY_RELU.value,
    "gelu": kernels.activations.GELU.value,
    "gelu_tanh": kernels.activations.GELU_TANH.value,
    "silu": kernels.activations.SILU.value,
    "sigmoid": kernels.activations.SIGMOID.value,
    "tanh": kernels.activations.TANH.value,
    "identity": kernels.activations.IDENTITY.value,
}


#: Math modes of kernels/activations.py as plain ints.
MATH_PORTABLE, MATH_GPU, MATH_GPU_TANH_APPROX = (
    mode.value for mode in (kernels.activations.PORTABLE, kernels.activations.GPU, kernels.activations.GPU_TANH_APPROX)
)
#: Output dtypes whose rounding hides tanh.approx.f32's error (about 2**-11 relative):
#: a quarter of a bfloat16 ulp. (A float16 ulp is 2**-10: the error would show.)
_TANH_APPROX_DTYPES = (torch.bfloat16,)


def math_mode(out_dtype: torch.dtype, interpreted: bool) -> int:
    """The MATH constexpr of the activation kernels for a result of ``out_dtype``.

    Under Triton's interpreter (``interpreted``), the portable formulas;
    compiled, libdevice's tanh and approximate float32 division, plus the
    hardware tanh.approx.f32 where the result is stored as bfloat16 (see
    kernels/activations.py for the error of each).
    """
    if interpreted:
        return MATH_PORTABLE
    return MATH_GPU_TANH_APPROX if out_dtype in _TANH_APPROX_DTYPES else MATH_GPU


#: The slope of leaky_relu when none is given (torch's default).
DEFAULT_NEGATIVE_SLOPE = 0.01


def check_activation(op: str, act: object, negative_slope: object = None, *, strict: bool = False) -> tuple[str, float]:
    """Validates ``act`` and ``negative_slope``; returns them normalised (the slope as a float).

    ``negative_slope`` applies to leaky_relu only: None means the default
    (0.01). With any other activation a slope has no effect, which is an
    error rather than an argument silently ignored: with ``strict`` (the
    functional ops) any slope given is, otherwise (callers that hold the
    default slope whatever the activation) any slope but the default.

    Raises:
        ValueError: an unknown activation name, a non-finite slope, or a
            slope given with an activation other than leaky_relu.
        TypeError: a non-string ``act`` or a non-number ``negative_slope``.
    """
    if not isinstance(act, str):
        raise TypeError(f"tfuse.{op}: act must be a string naming the activation, got {type(act).__name__}")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"tfuse.{op}: unknown activation {act!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    if negative_slope is None:
        return act, DEFAULT_NEGATIVE_SLOPE
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise TypeError(f"tfuse.{op}: negative_slope must be a number, got {type(negative_slope).__name__}")
    slope = float(negative_slope)
    if slope != slope or slope in (float("inf"), float("-inf")):
        raise ValueError(f"tfuse.{op}: negative_slope must be finite, got {slope}")
    if act != "leaky_relu" and (strict or slope != DEFAULT_NEGATIVE_SLOPE):
        raise ValueError(
            f"tfuse.{op}: negative_slope={slope} has no effect with act={act!r}; "
            "it is the slope of act='leaky_relu' only"
        )
    return act, slope


def grad_from_output(act: str, negative_slope: float) -> bool:
    """True when act'(z) follows from y = act(z), so backward needs only the output.

    relu, sigmoid, tanh and leaky_relu with a non-negative slope qualify
    (y > 0 exactly when z > 0); gelu, gelu_tanh, silu and leaky_relu with a
    negative slope need z, which is recomputed from the saved inputs.
    """
    return act in ("relu", "sigmoid", "tanh") or (act == "leaky_relu" and negative_slope >= 0)


def torch_act_(z: torch.Tensor, act: str, negative_slope: float) -> torch.Tensor:
    """act(z), in place on ``z`` where torch has an in-place form (gelu has none)."""
    if act == "identity":
        return z
    if act == "relu":
        return torch.relu_(z)
    if act == "leaky_relu":
        return F.leaky_relu_(z, negative_slope)
    if act == "gelu":
        return F.gelu(z)
    if act == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if act == "silu":
        return F.silu(z, inplace=True)
    if act == "sigmoid":
        return z.sigmoid_()
    return z.tanh_()


def torch_act_backward(dy: torch.Tensor, saved: torch.Tensor, act: str, negative_slope: float) -> torch.Tensor:
    """dy * act'(.) with torch's fused backward kernels (differentiable under grad mode, for double backward).

    ``saved`` is the output y for the activations of :func:`grad_from_output`
    and the pre-activation z for the others (never called for identity).
    """
    aten = torch.ops.aten
    if act == "relu":
        return aten.threshold_backward(dy, saved, 0.0)
    if act == "leaky_relu":
        return aten.leaky_relu_backward(dy, saved, negative_slope, grad_from_output(act, negative_slope))
    if act == "sigmoid":
        return aten.sigmoid_backward(dy, saved)
    if act == "tanh":
        return aten.tanh_backward(dy, saved)
    if act == "gelu":
        return aten.gelu_backward(dy, saved, approximate="none")
    if act == "gelu_tanh":
        return aten.gelu_backward(dy, saved, approximate="tanh")
    if act == "silu":
        if torch.is_grad_enabled():  # double backward: aten.silu_backward has no derivative (torch's own choice)
            s = torch.sigmoid(saved)
            return dy * s * (1 + saved * (1 - s))
        return aten.silu_backward(dy, saved)
    raise ValueError(f"no backward needed for {act}")
