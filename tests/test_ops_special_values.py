"""Activations at NaN, +-inf, +-0 and huge magnitudes, forward and backward, on both backends.

The reference is torch in float64 on the same values, rounded to the result
dtype: NaN exactly where it has NaN, infinities exactly, the sign of a zero
result (add_act), finite values within the dtype's tolerance. The Triton
kernels must match it everywhere. The PyTorch path is torch's own float32
(or, for batch norm, in-dtype) functions, which overflow in a few places
where float64 does not (gelu at +inf or past 1.7e38, gelu_tanh's derivative
past |z| = 1e13, see kernels/activations.py); at exactly those elements it
is held to nothing more than being torch's, everywhere else to the float64
reference too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tfuse
from tfuse.functional import batch_norm_act

from helpers import ACTIVATION_NAMES, torch_activation

ACTS = list(ACTIVATION_NAMES)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ["triton", "torch"]
SLOPE = 0.2
INF, NAN = float("inf"), float("nan")

SPECIAL = [
    NAN, INF, -INF, 0.0, -0.0, 1e30, -1e30, 3e38, -3e38, 6e4, -6e4, 1e13, -1e13, 100.0, -100.0, 20.0, -20.0,
    9.0, -9.0, 1e-30, -1e-30, 1e-7, -1e-7, 0.5, -0.5,
]
# Incoming gradients, NaN among them: relu's backward must still give 0 where z < 0. (Infinite ones
# multiply derivatives that underflow in float32 but not in float64, e.g. sigmoid'(-100), so they
# are tested with relu alone, where torch selects instead of multiplying.)
DY = [1.0, NAN, -2.0, 0.5, NAN, 3.0]


def act_kwargs(act: str) -> dict:
    return {"negative_slope": SLOPE} if act == "leaky_relu" else {}


def specials(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(SPECIAL, dtype=torch.float64).to(dtype).to(device)


def incoming(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor((DY * n)[:n], dtype=torch.float64).to(dtype).to(device)


def torch_forward_backward(act: str, z: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype, stored: torch.dtype | None = None):
    """torch's act and its gradient, computed in ``dtype``, returned in float64.

    sigmoid and tanh differentiate from their output (in torch as in tfuse):
    with ``stored``, from the output rounded to that dtype, as it is kept.
    (Near saturation 1 - y*y from a float16 y is 0 where float64 says 1e-4:
    that is the stored output's rounding, not an error of the derivative.)
    """
    zr = z.detach().to(dtype).requires_grad_()
    y = torch_activation(act, SLOPE)(zr)
    if stored is not None and act in ("sigmoid", "tanh"):
        kept = y.detach().to(stored).to(dtype)
        backward = torch.ops.aten.sigmoid_backward if act == "sigmoid" else torch.ops.aten.tanh_backward
        g = backward(dy.to(dtype), kept)
    else:
        (g,) = torch.autograd.grad(y, zr, dy.to(dtype))
    return y.detach().double(), g.double()


def same_class(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: both NaN, or both the same infinity, or both finite."""
    return (a.isnan() & b.isnan()) | (a == b) | (a.isfinite() & b.isfinite())


def assert_matches(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, check: torch.Tensor | None = None,
    **tolerance: float,
) -> None:
    """``actual`` (of ``dtype``) against the float64 ``expected`` rounded to ``dtype``, where ``check``."""
    expected = expected.to(dtype)
    if check is not None:
        actual, expected = actual[check], expected[check]
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}", **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_add_act_at_special_values(act, dtype, backend, device):
    z = specials(dtype, device)
    dy = incoming(z.numel(), dtype, device)
    x = z.clone().requires_grad_()
    with tfuse.use_backend(backend):
        y = tfuse.add_act(x, act=act, **act_kwargs(act))
        (dx,) = torch.autograd.grad(y, x, dy)
    y64, g64 = torch_forward_backward(act, z.double(), dy.double(), torch.float64, stored=dtype)
    check_y = check_g = None
    if backend == "torch":  # torch's float32 formulas: held to float64 where they agree with it
        y32, g32 = torch_forward_backward(act, z.double(), dy.double(), torch.float32, stored=dtype)
        check_y, check_g = same_class(y32, y64), same_class(g32, g64)
    assert_matches(y, y64, dtype, f"{act} forward", check_y)
    assert_matches(dx, g64, dtype, f"{act} backward", check_g)
    zeros = y64.to(dtype) == 0
    if check_y is not None:
        zeros &= check_y
    sign = y64.to(dtype).signbit()
    if backend == "torch":
        # The sign of a zero from torch's own float32 function (what the path computes) depends on the CPU's
        # vector unit (its gelu gives +0 for large negative z on an AVX2 EPYC where float64 gives -0): the
        # PyTorch path is held to being torch's there.
        sign = y32.to(dtype).signbit()
    assert torch.equal(y[zeros].signbit(), sign[zeros]), f"{act}: sign of a zero result"


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_passes_the_gradient_through_nan_and_blocks_it_below_zero(dtype, device):
    # The case, spelled out: torch's threshold_backward, 0 where z <= 0 whatever dy, dy where z is NaN.
    z = torch.tensor([NAN, -1.0, -2.0, 0.0, 3.0], device=device, dtype=dtype)
    dy = torch.tensor([5.0, NAN, INF, INF, 7.0], device=device, dtype=dtype)
    for backend in BACKENDS:
        x = z.clone().requires_grad_()
        with tfuse.use_backend(backend):
            (dx,) = torch.autograd.grad(tfuse.add_act(x, act="relu"), x, dy)
        assert dx.tolist() == [5.0, 0.0, 0.0, 0.0, 7.0], backend


# Eval in every dtype (each element's derivative on its own); training in float32 (the same
# helpers, plus NaN and infinities carried through the statistics and the dx sums).
BN_CASES = [(False, dtype) for dtype in DTYPES] + [(True, torch.float32)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training, dtype", BN_CASES)
@pytest.mark.parametrize("act", ACTS)
def test_batch_norm_act_at_special_values(act, training, dtype, backend, device):
    # The residual carries the special values into the activation: z = bn(x) + residual.
    # In eval x = 0, weight 1, bias 0 and unit running statistics make z the residual itself.
    r = specials(dtype, device).view(1, 1, -1).expand(2, 3, -1).contiguous()
    n_spatial = r.shape[-1]
    if training:
        x = torch.randn(2, 3, n_spatial, device=device).to(dtype)
    else:
        x = torch.zeros(2, 3, n_spatial, device=device, dtype=dtype)
    x.requires_grad_()
    residual = r.clone().requires_grad_()
    weight = torch.ones(3, device=device, requires_grad=True)
    bias = torch.zeros(3, device=device, requires_grad=True)
    dy = incoming(r.numel(), dtype, device).view_as(r)
    dy[1] = 1.0  # the second sample's gradients finite: NaN reaches dx only through the statistics
    mean, var = torch.zeros(3, device=device), torch.ones(3, device=device)
    with tfuse.use_backend(backend):
        y = batch_norm_act(x, mean.clone(), var.clone(), weight, bias, training=training, act=act,
                           residual=residual, **act_kwargs(act))
        grads = torch.autograd.grad(y, (x, residual, weight, bias), dy)

    def reference(compute: torch.dtype):
        leaves = [t.detach().to(compute).requires_grad_() for t in (x, residual, weight, bias)]
        xr, rr, wr, br = leaves
        z = F.batch_norm(xr, mean.to(compute), var.to(compute), wr, br, training) + rr
        out, dz = torch_forward_backward(act, z, dy.double(), compute, stored=dtype)
        return out, torch.autograd.grad(z, leaves, dz.to(compute))

    y64, g64 = reference(torch.float64)
    checks = [None] * 5
    if backend == "torch":  # torch's own batch norm + act in the input's dtype (float32 parameters)
        if dtype == torch.float32:
            y_own, g_own = reference(torch.float32)
        else:
            leaves = [t.detach().requires_grad_() for t in (x, residual, weight, bias)]
            z = F.batch_norm(leaves[0], mean, var, leaves[2], leaves[3], training) + leaves[1]
            y_own = torch_activation(act, SLOPE)(z)
            g_own = torch.autograd.grad(y_own, leaves, dy)
        checks = [same_class(a.double(), b) for a, b in zip((y_own, *g_own), (y64, *g64))]
    # The PyTorch path rounds to float16/bfloat16 after the normalisation, the residual add and the
    # activation (torch's ops in the input's dtype): a few units of the dtype's rounding, as in
    # test_batch_norm_act.py. The kernels round once.
    tolerance = {}
    if backend == "torch" and dtype != torch.float32:
        tolerance = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}[dtype]
    assert_matches(y, y64, y.dtype, f"{act} forward", checks[0], **tolerance)
    for name, mine, theirs, check in zip(("dx", "d(residual)", "d(weight)", "d(bias)"), grads, g64, checks[1:]):
        if name in ("d(weight)", "d(bias)") or (name == "dx" and training):
            # Sums over many elements: a NaN or an infinity anywhere decides the result; compare the class.
            ok = same_class(mine.double(), theirs)
            if check is not None:
                ok |= ~check
            assert ok.all(), f"{act} {name}: {mine} against {theirs}"
        else:
            assert_matches(mine, theirs, mine.dtype, f"{act} {name}", check, **tolerance)


# (shape, channels_last): a long NCHW row (one channel per program), short NCHW rows (several channels per
# program) and channels_last (a channel per lane): each way the statistics kernels read a channel.
STAT_LAYOUTS = [((2, 5, 40, 40), False), ((4, 5, 2, 3), False), ((4, 5, 2, 3), True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, channels_last", STAT_LAYOUTS, ids=["long_rows", "short_rows", "channels_last"])
def test_batch_norm_statistics_keep_nan_and_inf_as_torch(shape, channels_last, dtype, backend, device):
    """Training statistics with NaN/inf in the input: torch's CPU batch norm (a sum, not Welford) is the reference.

    Channel 0 has one NaN (mean and variance NaN), channel 1 +inf as the very first element (the kernels' shift
    value), channel 2 +inf in the middle (mean inf, variance NaN), channel 3 -inf first and +inf later (mean
    NaN), channel 4 is finite.
    """
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=generator).to(dtype)
    x[1, 0, 0, 1] = NAN
    x[0, 1, 0, 0] = INF
    x[1, 2, 1, 2] = INF
    x[0, 3, 0, 0], x[1, 3, 1, 0] = -INF, INF
    x = x.to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    mean, var = torch.full((5,), 0.5, device=device), torch.full((5,), 2.0, device=device)
    with tfuse.use_backend(backend):
        y = batch_norm_act(x, mean, var, training=True, momentum=0.1)
    ref_mean, ref_var = torch.full((5,), 0.5), torch.full((5,), 2.0)
    ref_y = F.batch_norm(x.cpu().float(), ref_mean, ref_var, training=True, momentum=0.1).relu()
    assert ref_mean[1] == INF and ref_mean[0].isnan() and ref_var[1].isnan() and ref_mean[4].isfinite()
    for name, mine, theirs in (("running_mean", mean, ref_mean), ("running_var", var, ref_var)):
        torch.testing.assert_close(mine.cpu(), theirs, equal_nan=True, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert same_class(y.cpu().double(), ref_y.double()).all()
