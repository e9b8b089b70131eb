"""The activations tfuse fuses: names, kernel codes, and their PyTorch path.

The PyTorch path mirrors the kernel helpers of kernels/activations.py in
whole-tensor torch ops, on float32 (float64) tensors.
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


def check_activation(op: str, act: object, negative_slope: object) -> tuple[str, float]:
    """Validates ``act`` and ``negative_slope``; returns them normalised.

    Raises:
        ValueError: an unknown activation name, or a non-finite slope.
        TypeError: a non-string ``act`` or a non-number ``negative_slope``.
    """
    if not isinstance(act, str):
        raise TypeError(f"tfuse.{op}: act must be a string naming the activation, got {type(act).__name__}")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"tfuse.{op}: unknown activation {act!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise TypeError(f"tfuse.{op}: negative_slope must be a number, got {type(negative_slope).__name__}")
    slope = float(negative_slope)
    if slope != slope or slope in (float("inf"), float("-inf")):
        raise ValueError(f"tfuse.{op}: negative_slope must be finite, got {slope}")
    return act, slope


def grad_from_output(act: str, negative_slope: float) -> bool:
    """True when act'(z) follows from y = act(z), so backward needs only the output.

    relu, sigmoid, tanh and leaky_relu with a non-negative slope qualify
    (y > 0 exactly when z > 0); gelu, gelu_tanh, silu and leaky_relu with a
    negative slope need z, which is recomputed from the saved inputs.
    """
    return act in ("relu", "sigmoid", "tanh") or (act == "leaky_relu" and negative_slope >= 0)


def torch_act(z: torch.Tensor, act: str, negative_slope: float) -> torch.Tensor:
    """act(z) with torch.nn.functional."""
    if act == "identity":
        return z
    if act == "relu":
        return F.relu(z)
    if act == "leaky_relu":
        return F.leaky_relu(z, negative_slope)
    if act == "gelu":
        return F.gelu(z)
    if act == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if act == "silu":
        return F.silu(z)
    if act == "sigmoid":
        return torch.sigmoid(z)
    return torch.tanh(z)


def torch_act_grad(z: torch.Tensor, act: str, negative_slope: float) -> torch.Tensor:
    """d act / d z at the pre-activation ``z``."""
    if act == "identity":
        return torch.ones_like(z)
    if act == "relu":
        return (z > 0).to(z.dtype)
    if act == "leaky_relu":
        return torch.where(z > 0, 1.0, negative_slope).to(z.dtype)
    if act == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * 0.7071067811865476))
        return cdf + z * torch.exp(-0.5 * z * z) * 0.3989422804014327
    if act == "gelu_tanh":
        k, c = 0.7978845608028654, 0.044715
        t = torch.tanh(k * (z + c * z**3))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * c * z * z)
    if act == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if act == "sigmoid":
        s = torch.sigmoid(z)
        return s * (1.0 - s)
    return 1.0 - torch.tanh(z) ** 2


def torch_act_grad_from_output(y: torch.Tensor, act: str, negative_slope: float) -> torch.Tensor:
    """d act / d z from the output ``y`` (the activations of :func:`grad_from_output`)."""
    if act == "relu":
        return (y > 0).to(y.dtype)
    if act == "leaky_relu":
        return torch.where(y > 0, 1.0, negative_slope).to(y.dtype)
    if act == "sigmoid":
        return y * (1.0 - y)
    if act == "tanh":
        return 1.0 - y * y
    raise ValueError(f"the derivative of {act} does not follow from its output")
