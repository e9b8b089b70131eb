"""The activation table (tfuse/ops/_activations.py) against the kernels and against torch.

Kernels cannot import tfuse, so each activation's code is spelled twice: as a
constexpr in kernels/activations.py and as the value of an ``Activation``
member. These tests pin the two to each other, and pin each member's PyTorch
path (forward, backward, what backward needs) to torch.nn.functional in
float64, references written here independently of the table.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton.language as tl

import tfuse
from tfuse import kernels
from tfuse.ops._activations import (
    DEFAULT_NEGATIVE_SLOPE,
    MATH_GPU,
    MATH_GPU_TANH_APPROX,
    MATH_PORTABLE,
    Activation,
    GradSource,
    check_activation,
)

#: Public names, in the order the error messages list them.
NAMES = ("relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "relu6", "hardtanh", "hardswish",
         "hardsigmoid", "mish", "elu", "identity")
#: Constants of kernels/activations.py that are math modes, not activations.
MATH_MODES = {"PORTABLE": MATH_PORTABLE, "GPU": MATH_GPU, "GPU_TANH_APPROX": MATH_GPU_TANH_APPROX}


def reference(name: str, slope: float):
    """torch.nn.functional's version of each activation (independent of the table)."""
    return {
        "relu": F.relu,
        "leaky_relu": lambda z: F.leaky_relu(z, slope),
        "gelu": F.gelu,
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "silu": F.silu,
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "relu6": F.relu6,
        "hardtanh": F.hardtanh,
        "hardswish": F.hardswish,
        "hardsigmoid": F.hardsigmoid,
        "mish": F.mish,
        "elu": F.elu,
        "identity": lambda z: z,
    }[name]


def kernel_constants() -> dict[str, int]:
    """Public ``tl.constexpr`` ints of kernels/activations.py, activations only."""
    found = {
        name: value.value
        for name, value in vars(kernels.activations).items()
        if name.isupper() and not name.startswith("_") and isinstance(value, tl.constexpr)
    }
    return {name: code for name, code in found.items() if name not in MATH_MODES}


# ---------------------------------------------------------------- codes and names


def test_every_member_has_its_kernel_code():
    constants = kernel_constants()
    for member in Activation:
        assert constants[member.name] == member.code == member.value


def test_every_kernel_activation_has_a_member():
    assert set(kernel_constants()) == set(Activation.__members__)


def test_codes_are_distinct_so_no_member_is_an_alias():
    # IntEnum turns a repeated value into an alias: it would vanish from iteration.
    assert len(list(Activation)) == len(Activation.__members__) == len(set(kernel_constants().values()))


def test_math_modes_match_the_kernel_constants():
    for name, mode in MATH_MODES.items():
        assert getattr(kernels.activations, name).value == mode


def test_code_is_a_plain_int_for_launch_meta():
    # Meta-parameters go into Triton's specialisation keys: plain ints, as before the table.
    for member in Activation:
        assert type(member.code) is int


def test_names_round_trip():
    assert tuple(member.label for member in Activation) == NAMES
    for member in Activation:
        assert Activation.from_name(member.label) is member
        assert member.label == member.name.lower()
        assert check_activation("op", member.label) == (member, DEFAULT_NEGATIVE_SLOPE)


@pytest.mark.parametrize("name", ["ReLU", "gelu_erf", "", "swish"])
def test_unknown_names_are_rejected_with_the_supported_list(name):
    supported = ", ".join(NAMES)
    with pytest.raises(ValueError, match=f"unknown activation {name!r}; supported: {supported}$"):
        Activation.from_name(name)
    with pytest.raises(ValueError, match=f"^tfuse.op: unknown activation {name!r}; supported: {supported}$"):
        check_activation("op", name)


def test_only_leaky_relu_takes_a_slope():
    assert [member for member in Activation if member.takes_slope] == [Activation.LEAKY_RELU]


# ---------------------------------------------------------------- the PyTorch path against torch


def _cases() -> list:
    return [
        pytest.param(member, slope, id=f"{member.label}-{slope}")
        for member in Activation
        for slope in ((0.2, -0.3, 0.0) if member.takes_slope else (DEFAULT_NEGATIVE_SLOPE,))
    ]


def _inputs() -> torch.Tensor:
    z = torch.randn(257, dtype=torch.float64) * 3
    return torch.cat([z, torch.tensor([0.0, -0.0, 1e-8, -1e-8, 8.0, -8.0], dtype=torch.float64)])


@pytest.mark.parametrize("member, slope", _cases())
def test_forward_matches_torch_in_float64(member, slope):
    z = _inputs()
    expected = reference(member.label, slope)(z)
    torch.testing.assert_close(member.forward(z.clone(), slope), expected, rtol=0, atol=0)
    inplace = z.clone()
    result = member.forward_(inplace, slope)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    if result.data_ptr() == inplace.data_ptr():
        torch.testing.assert_close(inplace, expected, rtol=0, atol=0)  # written where it claims to be


@pytest.mark.parametrize("member, slope", _cases())
def test_backward_from_what_it_claims_matches_autograd_in_float64(member, slope):
    z = _inputs().requires_grad_()
    y = reference(member.label, slope)(z)
    dy = torch.randn_like(z)
    (expected,) = torch.autograd.grad(y, z, dy)
    if member is Activation.HARDSIGMOID:
        # torch's hardsigmoid_backward multiplies by a float32 1/6 even in float64 (3e-8 relative); tfuse divides
        # by 6: the exact derivative is the reference.
        expected = torch.where((z > -3) & (z < 3), dy / 6, torch.zeros_like(dy)).detach()
    source = member.grad_source(slope)
    saved = {GradSource.NONE: None, GradSource.OUTPUT: y.detach(), GradSource.INPUT: z.detach()}[source]
    with torch.no_grad():
        dz = member.backward(dy, saved, slope)
    torch.testing.assert_close(dz, expected, rtol=1e-12, atol=1e-15)
    assert member.grad_from_output(slope) == (source is GradSource.OUTPUT)


def test_grad_sources():
    sources = {member.label: member.grad_source(0.2) for member in Activation}
    assert sources == {
        "relu": GradSource.OUTPUT, "leaky_relu": GradSource.OUTPUT, "sigmoid": GradSource.OUTPUT,
        "tanh": GradSource.OUTPUT, "gelu": GradSource.INPUT, "gelu_tanh": GradSource.INPUT,
        "silu": GradSource.INPUT, "identity": GradSource.NONE, "relu6": GradSource.INPUT,
        "hardtanh": GradSource.INPUT, "hardswish": GradSource.INPUT, "hardsigmoid": GradSource.INPUT,
        "mish": GradSource.INPUT, "elu": GradSource.INPUT,
    }
    assert Activation.LEAKY_RELU.grad_source(0.0) is GradSource.OUTPUT
    assert Activation.LEAKY_RELU.grad_source(-0.3) is GradSource.INPUT


def _derivative(name: str, slope: float, z: float) -> float:
    t = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    (d,) = torch.autograd.grad(reference(name, slope)(t), t)
    return d.item()


@pytest.mark.parametrize(
    "member, slope",
    [
        case
        for case in _cases()
        # relu6, hardtanh, hardsigmoid and elu keep z for precision (Activation.grad_source), not because y is
        # ambiguous: they are one-to-one where their derivative varies.
        if case.values[0].grad_source(case.values[1]) is GradSource.INPUT
        and case.values[0] not in (Activation.RELU6, Activation.HARDTANH, Activation.HARDSIGMOID, Activation.ELU)
    ],
)
def test_input_activations_have_outputs_that_do_not_determine_the_derivative(member, slope):
    # The claim "needs z" is true: two inputs with one output and different derivatives.
    f = reference(member.label, slope)
    grid = torch.linspace(-5, 5, 100001, dtype=torch.float64)
    lowest = grid[torch.argmin(f(grid))].item()  # these activations dip below their value at -5, then rise
    right = lowest + 0.5
    target = f(torch.tensor(right, dtype=torch.float64)).item()
    lo, hi = -5.0, lowest  # f decreases on [lo, hi] from above target to below it: bisect
    assert f(torch.tensor(lo, dtype=torch.float64)).item() > target
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(torch.tensor(mid, dtype=torch.float64)).item() > target:
            lo = mid
        else:
            hi = mid
    left = (lo + hi) / 2
    assert f(torch.tensor(left, dtype=torch.float64)).item() == pytest.approx(target, abs=1e-12)
    assert abs(_derivative(member.label, slope, left) - _derivative(member.label, slope, right)) > 0.1


# ---------------------------------------------------------------- the kernels behind the codes


@pytest.mark.parametrize("member", list(Activation), ids=lambda m: m.label)
def test_kernel_code_computes_the_member_in_float64(member, device):
    # The code the launcher passes selects the formula the table names (the Triton path, float64), to
    # float64 accuracy: the slope reaches the kernel split in two float32 numbers (test_float_args.py).
    # atol: torch's float64 gelu_tanh, 0.5 z (1 + tanh u), cancels below z ~ -5 (the kernels' does not).
    slope = 0.2 if member.takes_slope else None
    z = (torch.randn(2, 33, dtype=torch.float64, device=device) * 3).requires_grad_()
    with tfuse.use_backend("triton"), tfuse.count_launches() as launches:
        y = tfuse.add_act(z, act=member.label, negative_slope=slope)
        (dz,) = torch.autograd.grad(y, z, torch.ones_like(y))
    assert launches.total >= 1
    expected = reference(member.label, 0.2)(z.detach())
    if member is Activation.HARDSIGMOID:  # torch's float64 hardsigmoid is 3e-8 off too (float32 constants)
        expected = F.relu6(z.detach() + 3) / 6
    torch.testing.assert_close(y, expected, rtol=1e-13, atol=1e-14)
    (expected_dz,) = torch.autograd.grad(reference(member.label, 0.2)(z), z, torch.ones_like(y))
    if member is Activation.HARDSIGMOID:  # and its backward multiplies by a float32 1/6
        expected_dz = ((z > -3) & (z < 3)).to(z.dtype) / 6
    torch.testing.assert_close(dz, expected_dz, rtol=1e-13, atol=1e-14)


def test_kernel_constants_are_their_definitions():
    # A constant typed in by hand was once off in its 11th digit (gelu_tanh's K1: 2e-10 relative error in
    # float64 at z = -6); each is now pinned to the expression it stands for.
    k = kernels.activations
    k0 = 2 * math.sqrt(2 / math.pi)
    assert k._SQRT_HALF.value == math.sqrt(0.5)
    assert k._INV_SQRT_2PI.value == 1 / math.sqrt(2 * math.pi)
    assert k._SQRT_2_OVER_PI.value == math.sqrt(2 / math.pi)
    assert k._GELU_TANH_K0.value == k0
    assert k._GELU_TANH_K1.value == k0 * k._GELU_TANH_C.value
    assert k._GELU_TANH_K1x3.value == 3 * k0 * k._GELU_TANH_C.value


def test_gelu_tanh_kernel_is_float64_accurate(device):
    z = torch.linspace(-8, 8, 257, dtype=torch.float64, device=device).requires_grad_()
    with tfuse.use_backend("triton"):
        y = tfuse.add_act(z, act="gelu_tanh")
        (dz,) = torch.autograd.grad(y, z, torch.ones_like(y))
    exact = z.detach().clone().requires_grad_()
    ref = exact * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (exact + 0.044715 * exact**3))  # = torch's formula
    (ref_dz,) = torch.autograd.grad(ref, exact, torch.ones_like(ref))
    # exp(-a) turns the rounding of a = 2u (|a| up to 40 here) into a relative error of |a| ulps, in both.
    torch.testing.assert_close(y, ref.detach(), rtol=2 * 48 * 2**-53, atol=0)
    # The derivative s + z a' s (1 - s) is a sum of O(1) terms that cancel near its zero (z ~ -0.75).
    torch.testing.assert_close(dz, ref_dz, rtol=2 * 48 * 2**-53, atol=64 * 2**-53)
