"""Every input order that broadcasts works, on both backends: shapes, dtype promotion, 0-dim tensors.

Each case is tried in every permutation of its inputs (the PyTorch path once
resized its accumulator when the first two inputs did not span the output),
for tfuse.add and for the others of tfuse.add_act, against torch's own
``t0 + t1 + ...`` (values, dtype, shape) and the float64 sum, gradients too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import tfuse

from conftest import ON_CUDA
from helpers import assert_sum_accurate, make_input, torch_activation

BACKENDS = ["triton", "torch"]
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# Shape sets: every permutation must broadcast as torch does.
SHAPES = {
    "issue_example": [(1, 3), (3,), (2, 3)],
    "first_two_span_less": [(2, 1, 4), (1, 3, 1), (4,), ()],
    "outer_product_and_full": [(5, 1), (1, 6), (5, 6)],
    "zero_dim_everywhere": [(), (4, 5), ()],
    "ones_only": [(1,), (1, 1), ()],
    "all_zero_dim": [(), ()],
    "rank_4_mixed": [(3, 1, 5, 1), (4, 1, 1), (1, 1, 6), (3, 4, 5, 6)],
    "zero_size": [(0, 3), (3,), (1, 3)],
}

# Dtype sets (with shapes): torch's promotion, where 0-dim tensors do not promote dimensioned ones.
DTYPES = {
    "half_and_bfloat": [(F16, (4,)), (BF16, (3, 4)), (F16, ())],
    "zero_dim_float32_does_not_promote": [(F16, (4,)), (F32, ()), (BF16, ())],
    "zero_dim_float64_with_float32": [(F64, ()), (F32, (2, 4)), (F16, (4,))],
    "all_zero_dim_promote": [(F16, ()), (F64, ()), (BF16, ())],
    "float64_wins": [(F32, (3, 1)), (F64, (4,)), (F16, (3, 4))],
}


def _inputs(specs, device, requires_grad=True):
    return [make_input(shape, dtype, device).requires_grad_(requires_grad) for dtype, shape in specs]


def _check_add(inputs, backend):
    with tfuse.use_backend(backend):
        out = tfuse.add(*inputs)
    expected = inputs[0]
    for t in inputs[1:]:
        expected = expected + t
    assert out.shape == expected.shape and out.dtype == expected.dtype
    # (torch's chain may round an intermediate to float16, e.g. f16 + f16 + bf16: the float64
    # bound, one rounding of the result, is the comparison that holds for every order.)
    assert_sum_accurate(out.detach(), [t.detach() for t in inputs])
    if out.numel():
        grad = torch.randn_like(out)
        mine = torch.autograd.grad(out, inputs, grad)
        for a, t in zip(mine, inputs):
            assert a.shape == t.shape and a.dtype == t.dtype
            assert_reduced_accurately(a, grad, t.shape)


def assert_reduced_accurately(actual: torch.Tensor, grad: torch.Tensor, shape) -> None:
    """``actual`` is ``grad`` summed to ``shape``: against the float64 sum, within the roundings torch
    (and tfuse) make: the sum is rounded to the gradient's dtype, then cast to ``actual``'s (two
    roundings when the dtypes differ, e.g. a float16 sum cast to bfloat16: (1 + u_grad)(1 + u_actual) - 1
    relative), plus a float32 accumulation of the terms (the bound of assert_sum_accurate)."""
    terms = grad.double()
    exact = terms.sum_to_size(shape)
    n = terms.numel() // max(exact.numel(), 1)
    coarse = torch.finfo(max((actual.dtype, grad.dtype), key=lambda d: torch.finfo(d).eps))
    rounding = torch.finfo(grad.dtype).eps / 2
    if actual.dtype != grad.dtype:
        rounding = (1 + rounding) * (1 + torch.finfo(actual.dtype).eps / 2) - 1
    bound = rounding * exact.abs() + n * 2.0**-24 * terms.abs().sum_to_size(shape) + coarse.tiny
    assert ((actual.double().to(exact.device) - exact).abs() <= bound).all(), (actual, exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SHAPES)
def test_add_every_order_of_shapes(case, backend, device):
    specs = [(torch.float32, shape) for shape in SHAPES[case]]
    for order in itertools.permutations(specs):
        _check_add(_inputs(order, device), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", DTYPES)
def test_add_every_order_of_dtypes(case, backend, device):
    for order in itertools.permutations(DTYPES[case]):
        _check_add(_inputs(order, device), backend)


def _check_add_act(x, others, backend, act="silu"):
    with tfuse.use_backend(backend):
        y = tfuse.add_act(x, *others, act=act)
    z = x
    for t in others:
        z = z + t
    assert y.shape == x.shape == z.shape and y.dtype == z.dtype
    # float32 (float64) sum and activation, one rounding: against float64, within the result's rounding.
    exact = torch_activation(act)(sum(t.detach().double() for t in (x, *others)))
    torch.testing.assert_close(y.detach(), exact.to(y.dtype))
    grad = torch.randn_like(y)
    mine = torch.autograd.grad(y, (x, *others), grad)
    z64 = sum(t.detach().double() for t in (x, *others)).requires_grad_()
    (dz,) = torch.autograd.grad(torch_activation(act)(z64), z64, grad.double())
    for a, t in zip(mine, (x, *others)):
        assert a.shape == t.shape and a.dtype == t.dtype
        # dz in float32 from the rounded y's inputs, summed in float32, rounded to the input's dtype.
        low = min((y.dtype, t.dtype), key=lambda d: torch.finfo(d).bits)
        tolerance = {F16: dict(rtol=2e-3, atol=1e-3), BF16: dict(rtol=1.6e-2, atol=1e-2)}.get(low, dict(rtol=1e-5, atol=1e-5))
        torch.testing.assert_close(a.double().to(dz.device), dz.sum_to_size(t.shape), **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_act_every_order_of_others(backend, device):
    # x fixes the output's shape; the others may come in any order.
    x = make_input((2, 3, 4), F32, device).requires_grad_()
    others = _inputs([(F32, (4,)), (F32, (3, 1)), (F32, ())], device)
    for order in itertools.permutations(others):
        _check_add_act(x, order, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["half_and_bfloat", "zero_dim_float64_with_float32", "float64_wins"])
def test_add_act_every_order_of_dtypes(case, backend, device):
    # x is the full-size input; its dtype may be promoted by the others (then inplace is impossible, not the op).
    specs = DTYPES[case]
    full = max(specs, key=lambda spec: (len(spec[1]), torch.Size(spec[1]).numel()))
    rest = [spec for spec in specs if spec is not full]
    for x_dtype in (full[0], F16, F64):
        x = make_input(full[1], x_dtype, device).requires_grad_()
        for order in itertools.permutations(_inputs(rest, device)):
            _check_add_act(x, order, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dim_x(backend, device):
    x = torch.tensor(0.7, device=device, requires_grad=True)
    bias = torch.tensor(-0.2, device=device, dtype=F64, requires_grad=True)
    _check_add_act(x, (bias,), backend, act="tanh")
    _check_add(_inputs([(F32, ())], device) + [bias], backend)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_cpu_scalar_in_any_position_joins_another_device(position):
    # meta stands in for a GPU (the PyTorch path serves it); on a GPU the CUDA case runs below.
    tensors = [torch.ones(2, 3, device="meta"), torch.ones(3, device="meta")]
    tensors.insert(position, torch.tensor(2.0))
    out = tfuse.add(*tensors)
    assert out.device.type == "meta" and out.shape == (2, 3)
    x = torch.ones(2, 3, device="meta")
    others = [torch.ones(3, device="meta")]
    others.insert(min(position, 1), torch.tensor(2.0, dtype=F64))
    y = tfuse.add_act(x, *others, act="relu")
    assert y.device.type == "meta" and y.shape == (2, 3) and y.dtype == F32


@pytest.mark.skipif(not ON_CUDA, reason="mixes CUDA and CPU tensors: needs a GPU")
@pytest.mark.parametrize("position", [0, 1, 2])
def test_cpu_scalar_in_any_position_with_cuda_tensors(position, device):
    tensors = _inputs([(F32, (2, 3)), (F32, (3,))], device)
    scalar = torch.tensor(0.5, dtype=F64, requires_grad=True)
    tensors.insert(position, scalar)
    _check_add(tensors, "triton")
    x = make_input((2, 3), F32, device).requires_grad_()
    others = [make_input((3,), F32, device).requires_grad_()]
    others.insert(min(position, 1), scalar)
    _check_add_act(x, others, "triton")
