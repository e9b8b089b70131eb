"""Activations as pairs of jit helpers (value, derivative) chosen by a constexpr.

One kernel body serves every activation: ``_act(z, ACT, slope)`` gives the
value, ``_act_grad(z, ACT, slope)`` the derivative from the pre-activation,
``_act_grad_from_output(y, ACT, slope)`` the derivative from the output for
the activations where that is possible (identity, relu, leaky_relu with a
non-negative slope, sigmoid, tanh). Formulas follow torch.nn.functional.
Inputs are float32 (or float64) tiles. (Module constants are tl.constexpr,
which kernels may read; keep them right of a tensor in products.)
"""

import triton
import triton.language as tl

IDENTITY = tl.constexpr(0)
RELU = tl.constexpr(1)
LEAKY_RELU = tl.constexpr(2)
GELU = tl.constexpr(3)  # erf form
GELU_TANH = tl.constexpr(4)  # tanh approximation
SILU = tl.constexpr(5)
SIGMOID = tl.constexpr(6)
TANH = tl.constexpr(7)

_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_TANH_C = tl.constexpr(0.044715)


@triton.jit
def _expm1(x):
    """exp(x) - 1 accurate near 0 (Kahan's trick: the error of exp cancels)."""
    u = tl.exp(x)
    u_minus_1 = u - 1.0
    # log(u) is 0 at u == 1 and -inf at u == 0; those lanes take other values
    # below, so feed log a harmless 2 there instead of dividing 0 by 0.
    safe_u = tl.where((u == 1.0) | (u == 0.0), 2.0, u)
    result = u_minus_1 * x / tl.log(safe_u)
    result = tl.where(u == 1.0, x, result)
    return tl.where(u_minus_1 == -1.0, -1.0, result)


@triton.jit
def _tanh(x):
    """tanh from expm1 of -2|x|: no overflow, and accurate near 0 where
    1 - 2 / (exp(2x) + 1) would cancel. (libdevice.tanh would not run under
    the interpreter, and one formula on both keeps the tests meaningful.)"""
    t = _expm1(-2.0 * tl.abs(x))
    magnitude = -t / (t + 2.0)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def _act(z, ACT: tl.constexpr, negative_slope):
    """act(z)."""
    if ACT == IDENTITY:
        y = z
    elif ACT == RELU:
        y = tl.where(z < 0, 0.0, z)  # NaN stays NaN, as in torch
    elif ACT == LEAKY_RELU:
        y = tl.where(z > 0, z, z * negative_slope)
    elif ACT == GELU:
        y = 0.5 * z * (1.0 + tl.erf(z * _SQRT_HALF))
    elif ACT == GELU_TANH:
        y = 0.5 * z * (1.0 + _tanh((z + z * z * z * _GELU_TANH_C) * _SQRT_2_OVER_PI))
    elif ACT == SILU:
        y = z * tl.sigmoid(z)
    elif ACT == SIGMOID:
        y = tl.sigmoid(z)
    else:
        y = _tanh(z)
    return y


@triton.jit
def _act_grad(z, ACT: tl.constexpr, negative_slope):
    """d act / d z at the pre-activation ``z``."""
    if ACT == IDENTITY:
        d = tl.full(z.shape, 1.0, z.dtype)
    elif ACT == RELU:
        d = tl.where(z > 0, 1.0, 0.0).to(z.dtype)
    elif ACT == LEAKY_RELU:
        d = tl.where(z > 0, 1.0, negative_slope).to(z.dtype)
    elif ACT == GELU:
        cdf = 0.5 * (1.0 + tl.erf(z * _SQRT_HALF))
        pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        d = cdf + z * pdf
    elif ACT == GELU_TANH:
        t = _tanh((z + z * z * z * _GELU_TANH_C) * _SQRT_2_OVER_PI)
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + z * z * (3.0 * _GELU_TANH_C))
    elif ACT == SILU:
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    elif ACT == SIGMOID:
        s = tl.sigmoid(z)
        d = s * (1.0 - s)
    else:
        t = _tanh(z)
        d = 1.0 - t * t
    return d


@triton.jit
def _act_grad_from_output(y, ACT: tl.constexpr, negative_slope):
    """d act / d z from the output ``y`` (identity, relu, leaky_relu with slope >= 0, sigmoid, tanh)."""
    if ACT == IDENTITY:
        d = tl.full(y.shape, 1.0, y.dtype)
    elif ACT == RELU:
        d = tl.where(y > 0, 1.0, 0.0).to(y.dtype)
    elif ACT == LEAKY_RELU:
        d = tl.where(y > 0, 1.0, negative_slope).to(y.dtype)
    elif ACT == SIGMOID:
        d = y * (1.0 - y)
    else:
        tl.static_assert(ACT == TANH, "this activation's derivative needs its input, not its output")
        d = 1.0 - y * y
    return d
