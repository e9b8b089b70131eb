"""The activations tfuse fuses, as one table: :class:`Activation`.

Each member carries what every layer needs of an activation:

* its public name (``Activation.GELU_TANH.label == "gelu_tanh"``), the
  string users pass as ``act=`` (:meth:`Activation.from_name`);
* its kernel code, the ``ACT`` constexpr of kernels/activations.py (the
  member's int value, ``Activation.RELU.code``; kernels cannot import tfuse,
  so the codes are spelled in kernels/codes.py, plain Python read here, and
  tests pin the two);
* its PyTorch path: :meth:`~Activation.forward` (out of place),
  :meth:`~Activation.forward_` (in place where torch has an in-place form)
  and :meth:`~Activation.backward` (torch's fused backward kernels);
* what its backward needs besides the incoming gradient
  (:meth:`~Activation.grad_source`): nothing, the output, or the input.

Strings are resolved to a member once, where the public API takes them
(:func:`check_activation`); launchers, autograd Functions and modules pass
the member on.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tfuse.kernels import codes as _codes


class GradSource(enum.Enum):
    """What ``act'`` is computed from in backward, besides ``dy``."""

    NONE = "none"  #: nothing: the derivative is constant (identity)
    OUTPUT = "output"  #: the output y = act(z): the derivative follows from it
    INPUT = "input"  #: the pre-activation z (recomputed from saved inputs)


class Activation(enum.IntEnum):
    """An activation of tfuse's fused ops; its value is its kernel code (``ACT``).

    Members are declared in the order error messages list them.
    """

    RELU = _codes.RELU
    LEAKY_RELU = _codes.LEAKY_RELU
    GELU = _codes.GELU  # erf form
    GELU_TANH = _codes.GELU_TANH  # tanh approximation
    SILU = _codes.SILU
    SIGMOID = _codes.SIGMOID
    TANH = _codes.TANH
    RELU6 = _codes.RELU6
    HARDTANH = _codes.HARDTANH  # min_val -1, max_val 1
    HARDSWISH = _codes.HARDSWISH
    HARDSIGMOID = _codes.HARDSIGMOID
    MISH = _codes.MISH
    ELU = _codes.ELU  # alpha 1
    IDENTITY = _codes.IDENTITY

    @classmethod
    def from_name(cls, name: str) -> Activation:
        """The member named ``name`` (``"relu"``, ``"gelu_tanh"``, ...).

        Raises:
            ValueError: no activation has that name.
        """
        member = _BY_LABEL.get(name) if isinstance(name, str) else None
        if member is None:
            raise ValueError(f"unknown activation {name!r}; supported: {', '.join(_BY_LABEL)}")
        return member

    @property
    def label(self) -> str:
        """The public name: what ``act=`` takes and module reprs show."""
        return self.name.lower()

    @property
    def code(self) -> int:
        """The ``ACT`` constexpr of kernels/activations.py, as a plain int (a launch meta-parameter)."""
        return int(self)

    @property
    def takes_slope(self) -> bool:
        """True for the one activation with a ``negative_slope`` parameter (leaky_relu)."""
        return self is Activation.LEAKY_RELU

    def grad_source(self, negative_slope: float) -> GradSource:
        """What backward computes ``act'`` from, for this slope (used by leaky_relu only).

        relu, sigmoid and tanh are one-to-one where their derivative varies,
        so it follows from the output; so does leaky_relu's with a
        non-negative slope (y > 0 exactly when z > 0). gelu, gelu_tanh, silu,
        hardswish, mish, and leaky_relu with a negative slope (two z give one
        y) need z. So do relu6, hardtanh, hardsigmoid and elu, by choice: read
        off a float16/bfloat16 y, their range tests would flip for z within
        half an ulp of a corner (y rounds onto it), and elu's exp(z) = y + 1
        would lose its precision near y = -1; z is exact.
        """
        source = _TORCH[self].grad_source
        if source is GradSource.OUTPUT and self.takes_slope and negative_slope < 0:
            return GradSource.INPUT
        return source

    def grad_from_output(self, negative_slope: float) -> bool:
        """True when backward needs the output y (not z): :meth:`grad_source` is OUTPUT."""
        return self.grad_source(negative_slope) is GradSource.OUTPUT

    def forward(self, z: torch.Tensor, negative_slope: float) -> torch.Tensor:
        """``act(z)`` with torch's own out-of-place functions (``z`` itself for identity)."""
        return _TORCH[self].forward(z, negative_slope)

    def forward_(self, z: torch.Tensor, negative_slope: float) -> torch.Tensor:
        """``act(z)``, in place on ``z`` where torch has an in-place form (gelu has none: a new tensor)."""
        return _TORCH[self].forward_(z, negative_slope)

    def backward(self, dy: torch.Tensor, saved: torch.Tensor | None, negative_slope: float) -> torch.Tensor:
        """``dy * act'(.)`` with torch's fused backward kernels (differentiable under grad mode).

        ``saved`` is what :meth:`grad_source` names: the output y, the
        pre-activation z, or None (identity, which returns ``dy`` itself).
        """
        return _TORCH[self].backward(dy, saved, negative_slope)


@dataclasses.dataclass(frozen=True)
class _TorchPath:
    """The PyTorch path of one activation (functions of (tensor, negative_slope) and (dy, saved, slope))."""

    forward: Callable[[torch.Tensor, float], torch.Tensor]
    forward_: Callable[[torch.Tensor, float], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]
    grad_source: GradSource  # for leaky_relu: with a non-negative slope


_aten = torch.ops.aten


def _silu_backward(dy: torch.Tensor, z: torch.Tensor, _: float) -> torch.Tensor:
    if torch.is_grad_enabled():  # double backward: aten.silu_backward has no derivative (torch's own choice)
        s = torch.sigmoid(z)
        return dy * s * (1 + z * (1 - s))
    return _aten.silu_backward(dy, z)


def _mish_backward(dy: torch.Tensor, z: torch.Tensor, _: float) -> torch.Tensor:
    if torch.is_grad_enabled():  # double backward: aten.mish_backward has no derivative
        t = torch.tanh(F.softplus(z))
        return dy * (t + z * torch.sigmoid(z) * (1 - t * t))
    return _aten.mish_backward(dy, z)


def _hardsigmoid_backward(dy: torch.Tensor, z: torch.Tensor, _: float) -> torch.Tensor:
    # Not aten.hardsigmoid_backward: it multiplies by a float32 1/6 (3e-8 relative in float64) and has no
    # derivative of its own; this select is exact and differentiable in dy (its derivative in z is 0).
    return torch.where((z > -3) & (z < 3), dy / 6, torch.zeros((), dtype=dy.dtype, device=dy.device))


# torch's CUDA kernels of hardsigmoid and hardswish multiply by a float32 1/6 (3e-8 relative in float64:
# seen on an H100); its CPU kernels divide by 6. In float64 these compute the CPU's formula on every device.
def _hardsigmoid(z: torch.Tensor, _: float) -> torch.Tensor:
    return (z + 3.0).clamp(0.0, 6.0) / 6.0 if z.dtype == torch.float64 else F.hardsigmoid(z)


def _hardsigmoid_(z: torch.Tensor, _: float) -> torch.Tensor:
    return z.add_(3.0).clamp_(0.0, 6.0).div_(6.0) if z.dtype == torch.float64 else F.hardsigmoid(z, inplace=True)


def _hardswish(z: torch.Tensor, _: float) -> torch.Tensor:
    return z * (z + 3.0).clamp(0.0, 6.0) / 6.0 if z.dtype == torch.float64 else F.hardswish(z)


def _hardswish_(z: torch.Tensor, _: float) -> torch.Tensor:
    if z.dtype == torch.float64:
        return z.mul_((z + 3.0).clamp(0.0, 6.0)).div_(6.0)
    return F.hardswish(z, inplace=True)


_TORCH: dict[Activation, _TorchPath] = {
    Activation.RELU: _TorchPath(
        forward=lambda z, _: F.relu(z),
        forward_=lambda z, _: torch.relu_(z),
        backward=lambda dy, y, _: _aten.threshold_backward(dy, y, 0.0),
        grad_source=GradSource.OUTPUT,
    ),
    Activation.LEAKY_RELU: _TorchPath(
        forward=lambda z, slope: F.leaky_relu(z, slope),
        forward_=lambda z, slope: F.leaky_relu_(z, slope),
        # self_is_result: the saved tensor is y when the slope allows (see Activation.grad_source).
        backward=lambda dy, saved, slope: _aten.leaky_relu_backward(dy, saved, slope, slope >= 0),
        grad_source=GradSource.OUTPUT,
    ),
    Activation.GELU: _TorchPath(
        forward=lambda z, _: F.gelu(z),
        forward_=lambda z, _: F.gelu(z),
        backward=lambda dy, z, _: _aten.gelu_backward(dy, z, approximate="none"),
        grad_source=GradSource.INPUT,
    ),
    Activation.GELU_TANH: _TorchPath(
        forward=lambda z, _: F.gelu(z, approximate="tanh"),
        forward_=lambda z, _: F.gelu(z, approximate="tanh"),
        backward=lambda dy, z, _: _aten.gelu_backward(dy, z, approximate="tanh"),
        grad_source=GradSource.INPUT,
    ),
    Activation.SILU: _TorchPath(
        forward=lambda z, _: F.silu(z),
        forward_=lambda z, _: F.silu(z, inplace=True),
        backward=_silu_backward,
        grad_source=GradSource.INPUT,
    ),
    Activation.SIGMOID: _TorchPath(
        forward=lambda z, _: torch.sigmoid(z),
        forward_=lambda z, _: z.sigmoid_(),
        backward=lambda dy, y, _: _aten.sigmoid_backward(dy, y),
        grad_source=GradSource.OUTPUT,
    ),
    Activation.TANH: _TorchPath(
        forward=lambda z, _: torch.tanh(z),
        forward_=lambda z, _: z.tanh_(),
        backward=lambda dy, y, _: _aten.tanh_backward(dy, y),
        grad_source=GradSource.OUTPUT,
    ),
    Activation.RELU6: _TorchPath(
        forward=lambda z, _: F.relu6(z),
        forward_=lambda z, _: F.relu6(z, inplace=True),
        backward=lambda dy, z, _: _aten.hardtanh_backward(dy, z, 0.0, 6.0),
        grad_source=GradSource.INPUT,  # see Activation.grad_source: the range test on z, not on a rounded y
    ),
    Activation.HARDTANH: _TorchPath(
        forward=lambda z, _: F.hardtanh(z),
        forward_=lambda z, _: F.hardtanh(z, inplace=True),
        backward=lambda dy, z, _: _aten.hardtanh_backward(dy, z, -1.0, 1.0),
        grad_source=GradSource.INPUT,
    ),
    Activation.HARDSWISH: _TorchPath(
        forward=_hardswish,
        forward_=_hardswish_,
        backward=lambda dy, z, _: _aten.hardswish_backward(dy, z),
        grad_source=GradSource.INPUT,
    ),
    Activation.HARDSIGMOID: _TorchPath(
        forward=_hardsigmoid,
        forward_=_hardsigmoid_,
        backward=_hardsigmoid_backward,
        grad_source=GradSource.INPUT,
    ),
    Activation.MISH: _TorchPath(
        forward=lambda z, _: F.mish(z),
        forward_=lambda z, _: F.mish(z, inplace=True),
        backward=_mish_backward,
        grad_source=GradSource.INPUT,
    ),
    Activation.ELU: _TorchPath(
        forward=lambda z, _: F.elu(z),
        forward_=lambda z, _: F.elu(z, inplace=True),
        # From z, as torch's F.elu: from the output, exp(z) = y + 1 would lose its precision where y rounds
        # near -1 in float16/bfloat16 (z below about -3), the saturated region.
        backward=lambda dy, z, _: _aten.elu_backward(dy, 1.0, 1.0, 1.0, False, z),
        grad_source=GradSource.INPUT,
    ),
    Activation.IDENTITY: _TorchPath(
        forward=lambda z, _: z,
        forward_=lambda z, _: z,
        backward=lambda dy, _saved, _slope: dy,
        grad_source=GradSource.NONE,
    ),
}

#: Public name -> member, in declaration order (the order error messages list them).
_BY_LABEL: dict[str, Activation] = {member.label: member for member in Activation}


#: Math modes of kernels/activations.py as plain ints.
MATH_PORTABLE, MATH_GPU, MATH_GPU_TANH_APPROX = _codes.PORTABLE, _codes.GPU, _codes.GPU_TANH_APPROX
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


def check_activation(
    op: str, act: object, negative_slope: object = None, *, strict: bool = False
) -> tuple[Activation, float]:
    """Validates ``act`` and ``negative_slope``; returns the table entry and the slope as a float.

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
    activation = _BY_LABEL.get(act)
    if activation is None:
        raise ValueError(f"tfuse.{op}: unknown activation {act!r}; supported: {', '.join(_BY_LABEL)}")
    if negative_slope is None:
        return activation, DEFAULT_NEGATIVE_SLOPE
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise TypeError(f"tfuse.{op}: negative_slope must be a number, got {type(negative_slope).__name__}")
    slope = float(negative_slope)
    if slope != slope or slope in (float("inf"), float("-inf")):
        raise ValueError(f"tfuse.{op}: negative_slope must be finite, got {slope}")
    if not activation.takes_slope and (strict or slope != DEFAULT_NEGATIVE_SLOPE):
        raise ValueError(
            f"tfuse.{op}: negative_slope={slope} has no effect with act={act!r}; "
            "it is the slope of act='leaky_relu' only"
        )
    return activation, slope
