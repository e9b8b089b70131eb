"""Activations as pairs of jit helpers (value, derivative) chosen by a constexpr.

One kernel body serves every activation: ``_act(z, ACT, slope)`` gives the
value, ``_act_grad(z, ACT, slope)`` the derivative from the pre-activation,
``_act_grad_from_output(y, ACT, slope)`` the derivative from the output for
the activations where that is possible (identity, relu, leaky_relu with a
non-negative slope, sigmoid, tanh). Backward passes use ``_act_backward``,
``_activation_backward`` and ``_act_backward_from_output``, which give
``dy * act'`` with torch's semantics (see below). Formulas follow
torch.nn.functional. Inputs are float32 (or float64) tiles. (Module
constants are tl.constexpr, which kernels may read; keep them right of a
tensor in products.)

Special values, as torch (every math mode: the choices below are selects
and comparisons, the same in the PORTABLE and GPU formulas):

* NaN in, NaN out, forward and backward, except where torch's backward
  selects rather than multiplies: relu's backward is torch's
  threshold_backward, ``0 where z <= 0, else dy`` (so dy passes where z is
  NaN, and a NaN or infinite dy gives 0 where z < 0); leaky_relu's is
  ``dy * slope`` where z is NaN. relu6, hardtanh and hardsigmoid select
  ``dy`` (``dy / 6``) strictly inside their linear range and 0 elsewhere,
  NaN included, and hardswish 0 at z <= -3 whatever dy; hardswish and elu
  give NaN at a NaN z. (torch's vectorised
  CPU kernels do the same; its scalar loops, which serve the last few
  elements of a tensor, pass dy at a NaN z instead.)
* +-0: the sign of a zero result is torch's (relu(-0) = -0, tanh(-0) = -0).
* +-inf: where the derivative is ``z * 0`` in the limit (gelu, gelu_tanh and
  silu at +-inf) it is NaN, as in torch; values at +-inf are torch's
  (gelu(-inf), silu(-inf), gelu_tanh(-inf) are NaN there too).
* Huge finite z: the value and derivative torch gives in float64. torch's
  float32 CPU formulas overflow in a few places where these do not: gelu
  past |z| = 1.7e38 (inf instead of z), gelu(+inf) in its vectorised loop
  (NaN), gelu_tanh's derivative past |z| = 1e13 (NaN instead of 1 or 0).

Math modes. ``_activation``/``_activation_grad`` take a MATH constexpr that
the launcher sets (``_act``/``_act_grad`` are the PORTABLE mode):

* PORTABLE: only operations the interpreter evaluates as written (numpy,
  correctly rounded), so CPU tests check the formulas themselves.
* GPU: compiled code. tanh is libdevice's (within 2 ulp), float32 divisions in
  sigmoid/silu/gelu_tanh are ``div.approx.f32`` (within 2 ulp); exp is
  Triton's ``ex2.approx``-based exp either way.
* GPU_TANH_APPROX: GPU, and the result is stored as bfloat16: tanh is the
  hardware ``tanh.approx.f32`` (one MUFU instruction; relative error about
  2**-11, a quarter of a bfloat16 ulp).

gelu_tanh is computed as ``z * sigmoid(2u)`` with ``u = sqrt(2/pi) (z +
0.044715 z**3)``, which equals ``0.5 z (1 + tanh(u))`` exactly and has no
cancellation where tanh(u) is near -1 (the same formula in every mode).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import codes

IDENTITY = tl.constexpr(codes.IDENTITY)
RELU = tl.constexpr(codes.RELU)
LEAKY_RELU = tl.constexpr(codes.LEAKY_RELU)
GELU = tl.constexpr(codes.GELU)  # erf form
GELU_TANH = tl.constexpr(codes.GELU_TANH)  # tanh approximation
SILU = tl.constexpr(codes.SILU)
SIGMOID = tl.constexpr(codes.SIGMOID)
TANH = tl.constexpr(codes.TANH)
RELU6 = tl.constexpr(codes.RELU6)
HARDTANH = tl.constexpr(codes.HARDTANH)
HARDSWISH = tl.constexpr(codes.HARDSWISH)
HARDSIGMOID = tl.constexpr(codes.HARDSIGMOID)
MISH = tl.constexpr(codes.MISH)
ELU = tl.constexpr(codes.ELU)

PORTABLE = tl.constexpr(codes.PORTABLE)
GPU = tl.constexpr(codes.GPU)
GPU_TANH_APPROX = tl.constexpr(codes.GPU_TANH_APPROX)

_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_TANH_C = tl.constexpr(0.044715)
_GELU_TANH_K0 = tl.constexpr(1.5957691216057308)  # 2 sqrt(2/pi): a = 2u = z (K0 + K1 z^2)
_GELU_TANH_K1 = tl.constexpr(0.07135481627260025)  # 2 sqrt(2/pi) 0.044715
_GELU_TANH_K1x3 = tl.constexpr(0.21406444881780076)  # da/dz = K0 + 3 K1 z^2
_EXP_ARG_MAX = tl.constexpr(80.0)  # exp(80) is finite in float32, and 1 / (1 + exp(80)) still normal
_INF = tl.constexpr(float("inf"))


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
def _log1p(x):
    """log(1 + x) accurate near 0 (Kahan's trick: the rounding of 1 + x cancels)."""
    u = 1.0 + x
    safe_u = tl.where((u == 1.0) | (u == _INF), 2.0, u)  # 0 / 0 and inf / inf below: those lanes take x
    return tl.where((u == 1.0) | (u == _INF), x, tl.log(safe_u) * x / (safe_u - 1.0))


@triton.jit
def _tanh(x):
    """tanh from expm1 of -2|x|: no overflow, and accurate near 0 where
    1 - 2 / (exp(2x) + 1) would cancel. (libdevice.tanh would not run under
    the interpreter, and one formula on both keeps the tests meaningful.)"""
    t = _expm1(-2.0 * tl.abs(x))
    magnitude = -t / (t + 2.0)
    return tl.where(x > 0, magnitude, tl.where(x < 0, -magnitude, x))  # x itself at +-0 (its sign) and NaN


@triton.jit
def _tanh_approx_f32(x):
    """The hardware tanh.approx.f32 (sm_75+): one MUFU.TANH, relative error about 2**-11."""
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x.to(tl.float32)], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _tanh_m(x, MATH: tl.constexpr):
    """tanh(x) in math mode MATH."""
    if MATH == GPU_TANH_APPROX and x.dtype == tl.float32:
        t = _tanh_approx_f32(x)
    elif MATH == PORTABLE:
        t = _tanh(x)
    else:
        t = libdevice.tanh(x)
    return t


@triton.jit
def _div(a, b, MATH: tl.constexpr):
    """a / b; float32 on a GPU as div.approx.f32 (2 ulp; 0 when |b| > 2**126, where a / b is below 2**-126 |a|)."""
    if MATH != PORTABLE and b.dtype == tl.float32:
        q = libdevice.fast_dividef(a, b)
    else:
        q = a / b
    return q


@triton.jit
def _sigmoid_m(z, MATH: tl.constexpr):
    """1 / (1 + exp(-z)) (exp(-z) = inf for very negative z gives 0)."""
    return _div(1.0, 1.0 + tl.exp(-z), MATH)


@triton.jit
def _gelu_tanh_parts(z, MATH: tl.constexpr):
    """a = 2 sqrt(2/pi) (z + 0.044715 z^3) = 2u, e = exp(-a) (argument capped at 80), s = sigmoid(a)."""
    z2 = z * z
    a = z * (_GELU_TANH_K0 + z2 * _GELU_TANH_K1)
    neg_a = tl.where(a < -_EXP_ARG_MAX, _EXP_ARG_MAX, -a)  # NaN stays NaN
    e = tl.exp(neg_a)
    s = _div(1.0, 1.0 + e, MATH)
    return a, z2, e, s


@triton.jit
def _relu6_shifted(z):
    """min(max(z + 3, 0), 6), NaN kept (hardswish and hardsigmoid).

    ``tl.PropagateNan.ALL`` is written at each use: Triton 3.6 cannot bind it to a local name (it tries to
    make a tensor of it), which made every hardswish/hardsigmoid kernel fail to compile on the GPU.
    """
    return tl.minimum(
        tl.maximum(z + 3.0, 0.0, propagate_nan=tl.PropagateNan.ALL), 6.0, propagate_nan=tl.PropagateNan.ALL
    )


@triton.jit
def _softplus(z):
    """log(1 + exp(z)), as torch's mish computes it (log1p(exp(z))): exp overflows to inf past 88 (float32),
    and then so does the result, whose tanh is 1."""
    return _log1p(tl.exp(z))


@triton.jit
def _activation(z, ACT: tl.constexpr, negative_slope, MATH: tl.constexpr):
    """act(z) in math mode MATH."""
    if ACT == IDENTITY:
        y = z
    elif ACT == RELU:
        y = tl.where(z < 0, 0.0, z)  # NaN stays NaN, as in torch
    elif ACT == LEAKY_RELU:
        y = tl.where(z > 0, z, z * negative_slope)
    elif ACT == GELU:
        y = 0.5 * z * (1.0 + tl.erf(z * _SQRT_HALF))
    elif ACT == GELU_TANH:
        # z * sigmoid(a); below a = -80 the result (under 1e-33 |z|) is a signed 0, as tanh(u) == -1 gives in torch.
        a, _z2, _e, s = _gelu_tanh_parts(z, MATH)
        y = tl.where(a < -_EXP_ARG_MAX, z * 0.0, z * s)
    elif ACT == SILU:
        y = z * _sigmoid_m(z, MATH)
    elif ACT == SIGMOID:
        y = _sigmoid_m(z, MATH)
    elif ACT == RELU6:
        y = tl.minimum(tl.where(z < 0, 0.0, z), 6.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN
    elif ACT == HARDTANH:
        y = tl.where(z < -1.0, -1.0, tl.where(z > 1.0, 1.0, z))
    elif ACT == HARDSWISH:
        y = z * (_relu6_shifted(z) / 6.0)  # not (z * 6) / 6: that overflows past 5.7e37 in float32
    elif ACT == HARDSIGMOID:
        y = _relu6_shifted(z) / 6.0
    elif ACT == MISH:
        y = z * _tanh_m(_softplus(z), MATH)
    elif ACT == ELU:
        y = tl.where(z > 0, z, _expm1(z))
    else:
        y = _tanh_m(z, MATH)
    return y


@triton.jit
def _activation_grad(z, ACT: tl.constexpr, negative_slope, MATH: tl.constexpr):
    """d act / d z at the pre-activation ``z``, in math mode MATH."""
    if ACT == IDENTITY:
        d = tl.full(z.shape, 1.0, z.dtype)
    elif ACT == RELU:
        d = tl.where(z <= 0, 0.0, 1.0).to(z.dtype)  # 1 at NaN: torch passes the gradient through there
    elif ACT == LEAKY_RELU:
        d = tl.where(z > 0, 1.0, negative_slope).to(z.dtype)
    elif ACT == GELU:
        cdf = 0.5 * (1.0 + tl.erf(z * _SQRT_HALF))
        pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        d = cdf + z * pdf
    elif ACT == GELU_TANH:
        # d/dz z sigmoid(a) = s + z a' s (1 - s), with 1 - s = e s; 0 below a = -80 (under 1e-32 there).
        # Past |z| = 10 either s = 0 (below) or e s < 2e-35 (above): z is clamped there so that
        # z a' stays finite for any finite z (NaN still propagates through s); +-inf is kept,
        # so that the derivative there is inf * 0 = NaN, as torch's (and as gelu's and silu's).
        a, _z2, e, s = _gelu_tanh_parts(z, MATH)
        s = tl.where(a < -_EXP_ARG_MAX, 0.0, s)
        zc = tl.where(tl.abs(z) == _INF, z, tl.minimum(tl.maximum(z, -10.0), 10.0))
        d = s * (1.0 + zc * (_GELU_TANH_K0 + zc * zc * _GELU_TANH_K1x3) * (e * s))
    elif ACT == SILU:
        s = _sigmoid_m(z, MATH)
        d = s * (1.0 + z * (1.0 - s))
    elif ACT == SIGMOID:
        s = _sigmoid_m(z, MATH)
        d = s * (1.0 - s)
    elif ACT == RELU6:
        d = tl.where((z > 0) & (z < 6.0), 1.0, 0.0).to(z.dtype)
    elif ACT == HARDTANH:
        d = tl.where((z > -1.0) & (z < 1.0), 1.0, 0.0).to(z.dtype)
    elif ACT == HARDSWISH:
        d = tl.where(z <= -3.0, 0.0, tl.where(z >= 3.0, 1.0, z / 3.0 + 0.5))  # NaN at a NaN z
    elif ACT == HARDSIGMOID:
        d = tl.where((z > -3.0) & (z < 3.0), 1.0 / 6.0, 0.0).to(z.dtype)
    elif ACT == MISH:
        t = _tanh_m(_softplus(z), MATH)
        d = t + z * _sigmoid_m(z, MATH) * (1.0 - t * t)
    elif ACT == ELU:
        d = tl.where(z > 0, 1.0, tl.exp(z))  # NaN at a NaN z
    else:
        t = _tanh_m(z, MATH)
        d = 1.0 - t * t
    return d


@triton.jit
def _act(z, ACT: tl.constexpr, negative_slope):
    """act(z) (PORTABLE math)."""
    return _activation(z, ACT, negative_slope, PORTABLE)


@triton.jit
def _act_grad(z, ACT: tl.constexpr, negative_slope):
    """d act / d z at the pre-activation ``z`` (PORTABLE math)."""
    return _activation_grad(z, ACT, negative_slope, PORTABLE)


@triton.jit
def _act_grad_from_output(y, ACT: tl.constexpr, negative_slope):
    """d act / d z from the output ``y`` (identity, relu, leaky_relu with slope >= 0, sigmoid, tanh)."""
    if ACT == IDENTITY:
        d = tl.full(y.shape, 1.0, y.dtype)
    elif ACT == RELU:
        d = tl.where(y <= 0, 0.0, 1.0).to(y.dtype)  # 1 at NaN: torch passes the gradient through there
    elif ACT == LEAKY_RELU:
        d = tl.where(y > 0, 1.0, negative_slope).to(y.dtype)
    elif ACT == SIGMOID:
        d = y * (1.0 - y)
    else:
        tl.static_assert(ACT == TANH, "this activation's derivative needs its input, not its output")
        d = 1.0 - y * y
    return d


@triton.jit
def _activation_backward(dy, z, ACT: tl.constexpr, negative_slope, MATH: tl.constexpr):
    """dy * act'(z) as torch computes it: relu, relu6, hardtanh and hardsigmoid select (0 outside their
    linear range whatever dy), hardswish below -3, the others multiply."""
    if ACT == RELU:
        dz = tl.where(z <= 0, 0.0, dy)
    elif ACT == RELU6:
        dz = tl.where((z > 0) & (z < 6.0), dy, 0.0)
    elif ACT == HARDTANH:
        dz = tl.where((z > -1.0) & (z < 1.0), dy, 0.0)
    elif ACT == HARDSIGMOID:
        dz = tl.where((z > -3.0) & (z < 3.0), dy / 6.0, 0.0)
    elif ACT == HARDSWISH:
        dz = tl.where(z <= -3.0, 0.0, dy * _activation_grad(z, ACT, negative_slope, MATH))  # 0 there, even for NaN dy
    else:
        dz = dy * _activation_grad(z, ACT, negative_slope, MATH)
    return dz


@triton.jit
def _act_backward(dy, z, ACT: tl.constexpr, negative_slope):
    """dy * act'(z) (PORTABLE math), as :func:`_activation_backward`."""
    return _activation_backward(dy, z, ACT, negative_slope, PORTABLE)


@triton.jit
def _act_backward_from_output(dy, y, ACT: tl.constexpr, negative_slope):
    """dy * act'(.) from the output ``y``, as torch: relu selects (threshold_backward), the others multiply."""
    if ACT == RELU:
        dz = tl.where(y <= 0, 0.0, dy)
    else:
        dz = dy * _act_grad_from_output(y, ACT, negative_slope)
    return dz
