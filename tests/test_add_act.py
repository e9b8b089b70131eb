"""tfuse.add_act: values, gradients, saved tensors, launches and errors, on both backends."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tfuse
import tfuse.ops.add_act as add_act_op
from tfuse.ops import _add_act_backward, _add_act_forward, _tiles

from conftest import ON_CUDA
from helpers import ACTIVATION_NAMES, PATH_ACTIVATIONS, make_input, torch_activation, unit_roundoff

ACTS = list(ACTIVATION_NAMES)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ["triton", "torch"]

# name: (x shape, other shapes, x layout)
PATTERNS = {
    "alone": ((37, 129), [], "contiguous"),
    "bias_last_dim": ((37, 129), [(129,)], "contiguous"),
    "bias_and_residual": ((37, 129), [(129,), (37, 129)], "contiguous"),
    "per_channel": ((3, 6, 7, 5), [(6, 1, 1)], "contiguous"),
    "per_channel_residual_channels_last": ((3, 6, 7, 5), [(6, 1, 1), (3, 6, 7, 5)], "channels_last"),
    "scalar_and_transposed_x": ((17, 9), [()], "transposed"),
    "strided_broadcast": ((2, 5, 6, 7), [(1, 5, 1, 7)], "contiguous"),
    "three_others": ((4, 6, 5), [(4, 1, 5), (6, 1), (4, 6, 5)], "strided"),
}



@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and gradient buffers start as NaN, so an unwritten element fails."""
    allocate = _tiles.empty_broadcast_output
    monkeypatch.setattr(_add_act_forward, "empty_broadcast_output",
                        lambda *a, **k: allocate(*a, **k).fill_(float("nan")))
    empty_grad = _add_act_backward._empty_grad
    monkeypatch.setattr(_add_act_backward, "_empty_grad", lambda *a, **k: empty_grad(*a, **k).fill_(float("nan")))


def slope_kwargs(act: str, slope: float) -> dict:
    """``negative_slope`` for leaky_relu; nothing for the others (a slope there is an error)."""
    return {"negative_slope": slope} if act == "leaky_relu" else {}


def make_operands(pattern: str, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    x_shape, other_shapes, layout = PATTERNS[pattern]
    return [make_input(x_shape, dtype, device, layout)] + [make_input(s, dtype, device) for s in other_shapes]


def reference(inputs: list[torch.Tensor], act: str, grad: torch.Tensor, output: torch.Tensor, slope: float = 0.2):
    """torch eager on the same values: the output and the input gradients.

    The sum and activation run in float32 and are rounded once, as the kernel
    does. Activations whose backward uses their output (torch's
    sigmoid/tanh/threshold/leaky_relu backward kernels) get the ``output``
    under test, rounded as stored: near saturation 1 - y*y from a float16 y is
    ill-conditioned, so a one-ulp difference in the forward (checked on its
    own) would otherwise show up as a large one in the gradient. The others
    are differentiated at the float32 pre-activation.
    """
    z = sum(t.detach().float() for t in inputs)
    z = z.requires_grad_()
    fn = torch_activation(act, slope)
    y = fn(z)
    dy = grad.float()
    stored = output.detach().float()
    aten = torch.ops.aten
    if act == "sigmoid":
        dz = aten.sigmoid_backward(dy, stored)
    elif act == "tanh":
        dz = aten.tanh_backward(dy, stored)
    elif act == "relu":
        dz = aten.threshold_backward(dy, stored, 0.0)
    elif act == "leaky_relu" and slope >= 0:
        dz = aten.leaky_relu_backward(dy, stored, slope, True)
    else:
        (dz,) = torch.autograd.grad(y, z, dy)
    grads = [dz if t.shape == dz.shape else dz.sum_to_size(t.shape) for t in inputs]
    return y.detach(), grads


def assert_reduced_grad_close(actual: torch.Tensor, upstream: torch.Tensor, shape: torch.Size) -> None:
    """A float32 gradient summed over broadcast rows, against the float64 sum of torch's per-element gradients.

    Each summed term may differ from torch's by what the per-element check
    (``assert_close``'s float32 default: atol 1e-5, rtol 1.3e-6) accepts, and
    n float32 terms summed in any order land within (n + 1) * eps * sum(|terms|)
    of their exact sum; the bound adds the two up. A fixed rtol on the sum does
    not follow either when the terms cancel.
    """
    terms = upstream.double()
    exact = terms.sum_to_size(shape)
    n = terms.numel() // exact.numel()
    magnitude = terms.abs().sum_to_size(shape)
    bound = n * 1e-5 + (1.3e-6 + (n + 1) * torch.finfo(torch.float32).eps) * magnitude
    excess = (actual.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"worst excess over the bound: {excess.max().item():.3g}"


def expected_backward_launches(inputs: list[torch.Tensor]) -> int:
    reduced = any(t.shape != inputs[0].shape for t in inputs if t.requires_grad)
    return 2 if reduced else 1


# Every layout with the activations of every path; the others with a residual, per-channel and broadcast mix.
ACT_PATTERNS = [
    (act, pattern)
    for act in ACTS
    for pattern in PATTERNS
    if act in PATH_ACTIVATIONS or pattern in ("bias_and_residual", "per_channel_residual_channels_last", "three_others")
]


# The dtype is independent of the layout and of the activation: it rotates over the cases, so that every
# activation and every layout meets every dtype (pairs, not the whole cross product).
ACT_PATTERN_DTYPES = [
    (act, pattern, DTYPES[(i + j) % len(DTYPES)])
    for j, act in enumerate(ACTS)
    for i, pattern in enumerate(pattern for a, pattern in ACT_PATTERNS if a == act)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act, pattern, dtype", ACT_PATTERN_DTYPES)
def test_values_and_gradients_match_torch(act, pattern, dtype, backend, device):
    inputs = [t.requires_grad_() for t in make_operands(pattern, dtype, device)]
    with tfuse.use_backend(backend):
        with tfuse.count_launches() as forward:
            y = tfuse.add_act(*inputs, act=act, **slope_kwargs(act, 0.2))
        grad = torch.randn_like(y)
        with tfuse.count_launches() as backward:
            grads = torch.autograd.grad(y, inputs, grad)
    expected_y, expected_grads = reference(inputs, act, grad, y)
    assert y.dtype == dtype and y.shape == inputs[0].shape
    torch.testing.assert_close(y, expected_y.to(dtype))
    for mine, theirs, t in zip(grads, expected_grads, inputs):
        assert mine.dtype == t.dtype and mine.shape == t.shape
        torch.testing.assert_close(mine, theirs.to(t.dtype))
    if backend == "triton":
        assert forward.by_kernel == {"_add_act_fwd_kernel": 1}
        assert backward.total == expected_backward_launches(inputs)
    else:
        assert forward.total == backward.total == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ACTS)
def test_gradcheck_float64(act, backend, device):
    # The smallest shapes with a row and a column broadcast (every input element is a gradcheck column, and
    # each one an interpreted launch): 3 rows in a tile of 4 (masked rows in the bias reduction), 2 columns.
    x = make_input((3, 2), torch.float64, device).requires_grad_()
    bias = make_input((2,), torch.float64, device).requires_grad_()
    scale = make_input((3, 1), torch.float64, device).requires_grad_()

    def fn(x, bias, scale):
        return tfuse.add_act(x, bias, scale, act=act, **slope_kwargs(act, 0.3))

    with tfuse.use_backend(backend):
        assert torch.autograd.gradcheck(fn, (x, bias, scale))


@pytest.mark.parametrize(
    "act, slope, saves",
    [
        ("relu", 0.01, "output"),
        ("sigmoid", 0.01, "output"),
        ("tanh", 0.01, "output"),
        ("leaky_relu", 0.1, "output"),
        ("leaky_relu", -0.1, "inputs"),
        ("gelu", 0.01, "inputs"),
        ("gelu_tanh", 0.01, "inputs"),
        ("silu", 0.01, "inputs"),
        ("identity", 0.01, "nothing"),
    ],
)
def test_saves_only_what_the_derivative_needs(act, slope, saves, device):
    x = make_input((8, 16), torch.float32, device).requires_grad_()
    bias = make_input((16,), torch.float32, device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = tfuse.add_act(x, bias, act=act, **slope_kwargs(act, slope))
    storages = {t.untyped_storage().data_ptr() for t in saved}
    expected = {
        "output": {y.untyped_storage().data_ptr()},
        "inputs": {x.untyped_storage().data_ptr(), bias.untyped_storage().data_ptr()},
        "nothing": set(),
    }[saves]
    assert storages == expected
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(bias.grad, _derivative(x, bias, act, slope).sum(0))


def _derivative(x: torch.Tensor, bias: torch.Tensor, act: str, slope: float) -> torch.Tensor:
    z = (x.detach() + bias.detach()).requires_grad_()
    fn = torch_activation(act, slope)
    (d,) = torch.autograd.grad(fn(z).sum(), z)
    return d


def test_inputs_without_grad_cost_nothing(device):
    x = make_input((16, 32), torch.float32, device).requires_grad_()
    bias = make_input((32,), torch.float32, device)  # no grad: no reduction at all
    y = tfuse.add_act(x, bias, act="gelu")
    with tfuse.count_launches() as backward:
        y.backward(torch.randn_like(y))
    assert backward.by_kernel == {"_add_act_bwd_kernel": 1}
    assert bias.grad is None


def test_full_size_gradients_share_one_buffer(device):
    x = make_input((6, 10), torch.float32, device).requires_grad_()
    residual = make_input((6, 10), torch.float32, device).requires_grad_()
    y = tfuse.add_act(x, residual, act="relu")
    gx, gr = torch.autograd.grad(y, (x, residual), torch.randn_like(y))
    assert gx.data_ptr() == gr.data_ptr()  # like torch's add: one tensor for both


@pytest.mark.parametrize("backend", BACKENDS)
def test_sum_backward_with_expanded_gradient(backend, device):
    # y.sum().backward() hands backward a stride-0 gradient.
    x = make_input((9, 33), torch.float32, device).requires_grad_()
    bias = make_input((33,), torch.float32, device).requires_grad_()
    with tfuse.use_backend(backend):
        tfuse.add_act(x, bias, act="silu").sum().backward()
    d = _derivative(x, bias, "silu", 0.0)
    torch.testing.assert_close(x.grad, d)
    torch.testing.assert_close(bias.grad, d.sum(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size(backend, device):
    x = make_input((0, 5), torch.float32, device).requires_grad_()
    bias = make_input((5,), torch.float32, device).requires_grad_()
    with tfuse.use_backend(backend), tfuse.count_launches() as launches:
        y = tfuse.add_act(x, bias, act="gelu")
        y.sum().backward()
    assert y.shape == (0, 5) and launches.total == 0
    assert (bias.grad == 0).all() and x.grad.shape == (0, 5)


def test_int64_offsets_path(monkeypatch, device):
    monkeypatch.setattr(_tiles, "INT32_LIMIT", 500)
    x = make_input((37, 129), torch.float32, device).requires_grad_()
    bias = make_input((129,), torch.float32, device).requires_grad_()
    y = tfuse.add_act(x, bias, act="gelu_tanh")
    assert _tiles.plan_tiles(y, [x, bias]).index_64
    grad = torch.randn_like(y)
    y.backward(grad)
    expected_y, (gx, _) = reference([x, bias], "gelu_tanh", grad, y)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(x.grad, gx)
    assert_reduced_grad_close(bias.grad, gx, bias.shape)


@pytest.mark.parametrize("act", ["tanh", "gelu_tanh"])
def test_tanh_is_accurate_near_zero_and_saturates(act, device):
    # 1 - 2 / (exp(2x) + 1) loses every digit near 0; the kernel must not.
    z = torch.tensor([1e-7, -3e-6, 1e-4, 0.01, 0.3, 5.0, -20.0, 80.0, -200.0], device=device)
    y = tfuse.add_act(z, act=act)
    torch.testing.assert_close(y, torch_activation(act, 0.2)(z.double()).float(), rtol=2e-6, atol=0)


# ---------------------------------------------------------------- wide columns

# Per-channel biases over 7x7 and 14x14 pixels (not multiples of 16), odd
# sizes and channels_last: the forward widens its columns (see
# tfuse/ops/_tiles.py); the backward keeps wide columns where every reduction
# fits them (per-channel bias gradients: mode CHAN, whole channels per column
# block) and falls back to one column dimension otherwise.
_CHAN = add_act_op.CHAN
WIDE = {
    # name: (x shape, other shapes, layout of full-size inputs, backward gradient modes)
    "nchw_7x7": ((2, 16, 7, 7), [(16, 1, 1)], "contiguous", (_tiles.LINEAR, _CHAN)),
    "nchw_7x7_two_blocks": ((2, 96, 7, 7), [(96, 1, 1)], "contiguous", (_tiles.LINEAR, _CHAN)),
    "nchw_14x14_residual": ((2, 40, 14, 14), [(40, 1, 1), (2, 40, 14, 14)], "contiguous", (_tiles.LINEAR, _CHAN)),
    "per_sample_scale": ((3, 16, 7, 7), [(3, 16, 1, 1), (16, 1, 1)], "contiguous", (_tiles.LINEAR, _tiles.ROW, _tiles.ROW)),
    "channels_last_24": ((2, 24, 7, 7), [(24, 1, 1), (2, 24, 7, 7)], "channels_last", (_tiles.LINEAR, _tiles.COL)),
    "rows_of_1000": ((5, 1000), [(1000,)], "contiguous", (_tiles.LINEAR, _tiles.COL)),
    "odd_channels": ((3, 5, 7, 7), [(5, 1, 1)], "contiguous", (_tiles.LINEAR, _tiles.ROW)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["relu", "silu", "gelu_tanh"])
@pytest.mark.parametrize("pattern", WIDE)
def test_wide_columns_values_and_gradients(pattern, act, dtype, backend, device, monkeypatch):
    x_shape, other_shapes, layout, grad_modes = WIDE[pattern]
    inputs = [make_input(x_shape, dtype, device, layout)] + [
        make_input(s, dtype, device, layout if tuple(s) == x_shape else "contiguous") for s in other_shapes
    ]
    inputs = [t.requires_grad_() for t in inputs]
    launched = []
    watcher = (lambda k, g, a, meta, d: launched.append(meta), True)
    monkeypatch.setattr(tfuse._launch, "_watchers", [*tfuse._launch._watchers, watcher])
    with tfuse.use_backend(backend):
        y = tfuse.add_act(*inputs, act=act)
        grad = torch.randn_like(y)
        grads = torch.autograd.grad(y, inputs, grad)
    expected_y, expected_grads = reference(inputs, act, grad, y)
    torch.testing.assert_close(y, expected_y.to(dtype))
    for mine, theirs, t in zip(grads, expected_grads, inputs):
        assert mine.dtype == t.dtype and mine.shape == t.shape
        if dtype == torch.float32 and mine.shape != y.shape:
            assert_reduced_grad_close(mine, expected_grads[0], t.shape)
        else:
            torch.testing.assert_close(mine, theirs.to(t.dtype))
    if backend == "triton":
        forward, backward = launched[0], launched[1]
        assert forward["COL_RANK"] > 1
        assert backward["GRAD_MODES"] == grad_modes
        assert (backward["COL_RANK"] > 1) == (_CHAN in grad_modes)
    else:
        assert launched == []


def test_chan_blocks_hold_whole_aligned_channels():
    # 7x7: 80 channels (3920 of 4096 lanes) rather than 32 (1568 of 2048); 3x3: 224 channels of 2048 lanes.
    for pixels, channels, lanes, width in ((49, 96, 4096, 3920), (196, 40, 4096, 3920), (9, 512, 2048, 2016)):
        out = torch.empty(2, channels, pixels)
        plan = _tiles.plan_tiles(out, [out, torch.empty(channels, 1)], max_col_rank=None)
        block_rows, block_cols, block_width = add_act_op._backward_blocks(plan, per_channel=True)
        assert (block_rows, block_cols, block_width) == (1, lanes, width)
        assert block_width % pixels == 0 and block_width % _tiles.COL_ALIGN == 0


# ---------------------------------------------------------------- math modes

_K0 = 2 * math.sqrt(2 / math.pi)
_K1 = _K0 * 0.044715
_U32 = 2.0**-24  # unit roundoff of float32


def _gelu_tanh_float64(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """a = 2u, y = z sigmoid(a), dy/dz, and the magnitude of the derivative's two terms, in float64.

    (torch's float64 gelu_tanh, 0.5 z (1 + tanh(u)), cancels to nothing for z below about -7.)
    """
    z = z.double()
    a = z * (_K0 + z * z * _K1)
    s = torch.sigmoid(a)
    term = z * (_K0 + 3 * z * z * _K1) * s * torch.sigmoid(-a)
    return a, z * s, s + term, s + term.abs()


def _gelu_tanh_sweep(device: torch.device) -> torch.Tensor:
    return torch.cat(
        [torch.linspace(-12, 12, 200_001), torch.logspace(-30, 1.2, 5_001), -torch.logspace(-30, 1.2, 5_001)]
    ).to(device)


def test_gelu_tanh_formula_in_float32_is_within_its_error_bound():
    """The kernels' gelu_tanh, z * sigmoid(a) with a = 2u, emulated in float32 torch against float64.

    Expected error, relative: a carries 3 roundings (3 u), exp(-a) turns them
    into |a| 3 u and adds its own (about |a| u from scaling the argument, plus
    one rounding), 1 + e, the reciprocal and the product add three: y is within
    (4 |a| + 8) u of z sigmoid(a), and the derivative s (1 + z a' e s) within
    (4 |a| + 12) u of the sum of its terms' magnitudes (it changes sign near
    z = -0.75). Below a = -80 both are zero (|y| < 1e-33 |z|, |dy/dz| < 1e-32).
    On a GPU, ex2.approx and div.approx.f32 (2 ulp = 4 u each) add 8 u:
    see test_gelu_tanh_on_gpu_is_within_its_error_bound. (torch's own float32
    gelu_tanh loses every digit below z = -5, in 1 + tanh(u).)
    """
    z = _gelu_tanh_sweep(torch.device("cpu")).float()
    a = z * (_K0 + z * z * _K1)
    e = torch.exp(torch.where(a < -80, torch.full_like(a, 80.0), -a))
    s = 1 / (1 + e)
    y = torch.where(a < -80, z * 0, z * s)
    s_d = torch.where(a < -80, 0.0, s)
    zc = z.clamp(-10, 10)
    d = s_d * (1 + zc * (_K0 + 3 * _K1 * zc * zc) * (e * s_d))
    a64, y64, d64, magnitude = _gelu_tanh_float64(z)
    small = a64 < -80
    assert (y[small] == 0).all() and (d[small] == 0).all()
    assert (y64[small].abs() <= 1e-33 * z[small].abs()).all() and (d64[small].abs() <= 1e-32).all()
    big = ~small
    assert ((y.double() - y64).abs() <= (4 * a64.abs() + 8) * _U32 * y64.abs())[big].all()
    assert ((d.double() - d64).abs() <= (4 * a64.abs() + 12) * _U32 * magnitude)[big].all()


def test_tanh_approx_error_hides_in_bfloat16_rounding():
    """tanh.approx.f32 (relative error below 2**-10.98, PTX ISA) is used only for bfloat16 results.

    A bfloat16 ulp is 2**-7 relative at worst, 2**-8 at best: an error a
    quarter of the smallest moves the rounded result by at most one ulp, what
    two correctly rounded float32 tanh may already differ by after rounding.
    """
    z = torch.linspace(-10, 10, 100_001, dtype=torch.float64)
    exact = torch.tanh(z)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().to(torch.bfloat16).double()  # ulp at or above |tanh|
    for sign in (1, -1):
        perturbed = (exact * (1 + sign * 2.0**-10.98)).to(torch.bfloat16).double()
        assert ((perturbed - exact.to(torch.bfloat16).double()).abs() <= ulp + 1e-38).all()


@pytest.mark.skipif(not ON_CUDA, reason="the GPU math mode exists only in compiled kernels")
def test_gelu_tanh_on_gpu_is_within_its_error_bound(device):
    z = _gelu_tanh_sweep(device).float().requires_grad_()
    y = tfuse.add_act(z, act="gelu_tanh")
    (d,) = torch.autograd.grad(y, z, torch.ones_like(y))
    a64, y64, d64, magnitude = _gelu_tanh_float64(z.detach())
    small = a64 < -80
    assert (y[small] == 0).all() and (d[small] == 0).all()
    assert ((y.double() - y64).abs() <= (4 * a64.abs() + 16) * _U32 * y64.abs())[~small].all()
    assert ((d.double() - d64).abs() <= (4 * a64.abs() + 20) * _U32 * magnitude)[~small].all()


@pytest.mark.skipif(not ON_CUDA, reason="tanh.approx.f32 runs only in compiled kernels")
def test_bfloat16_tanh_on_gpu_is_within_one_ulp(device):
    z = torch.linspace(-10, 10, 1_000_001, device=device).to(torch.bfloat16)
    y = tfuse.add_act(z, act="tanh").double()
    exact = torch.tanh(z.double())
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().to(torch.bfloat16).double()
    assert ((y - exact.to(torch.bfloat16).double()).abs() <= ulp + 1e-38).all()


def test_functional_and_top_level_are_the_same(device):
    assert tfuse.functional.add_act is tfuse.add_act


# ---------------------------------------------------------------- errors


def test_unknown_activation_lists_the_supported_ones(device):
    supported = "relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh, relu6, hardtanh, hardswish, hardsigmoid, mish, elu, identity"
    with pytest.raises(ValueError, match=rf"unknown activation 'swish'; supported: {supported}"):
        tfuse.add_act(torch.ones(3, device=device), act="swish")


def test_too_many_others(device):
    t = torch.ones(3, device=device)
    with pytest.raises(TypeError, match=r"takes x and 0 to 3 other tensors, got 4 others"):
        tfuse.add_act(t, t, t, t, t)


def test_others_must_broadcast_to_x(device):
    with pytest.raises(RuntimeError, match=r"argument 1 of shape \[3, 5\] does not broadcast to x's shape \[5\]"):
        tfuse.add_act(torch.ones(5, device=device), torch.ones(3, 5, device=device))
    with pytest.raises(RuntimeError, match=r"size of tensor 0 \(5\) must match the size of tensor 1 \(4\)"):
        tfuse.add_act(torch.ones(5, device=device), torch.ones(4, device=device))


@pytest.mark.parametrize("bad, message", [(None, "x must be a torch.Tensor, got NoneType"), (2.0, "x must be a torch.Tensor, got float")])
def test_x_must_be_a_tensor(bad, message):
    with pytest.raises(TypeError, match=message):
        tfuse.add_act(bad)


def test_bad_act_and_slope_types(device):
    t = torch.ones(3, device=device)
    with pytest.raises(TypeError, match=r"act must be a string"):
        tfuse.add_act(t, act=F.relu)
    with pytest.raises(TypeError, match=r"negative_slope must be a number, got str"):
        tfuse.add_act(t, act="leaky_relu", negative_slope="0.1")
    with pytest.raises(ValueError, match=r"negative_slope must be finite, got nan"):
        tfuse.add_act(t, act="leaky_relu", negative_slope=float("nan"))


def test_integer_input(device):
    with pytest.raises(TypeError, match=r"argument 1 has dtype torch.int64"):
        tfuse.add_act(torch.ones(3, device=device), torch.ones(3, dtype=torch.int64, device=device))


# ---------------------------------------------------------------- inplace


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh", "leaky_relu", "identity"])
def test_inplace_writes_into_x_with_the_same_values_and_gradients(act, backend, device):
    base = make_input((12, 40), torch.float32, device)
    bias = make_input((40,), torch.float32, device).requires_grad_()
    leaf = base.clone().requires_grad_()
    x = leaf * 1.0  # not a leaf: in-place is allowed, as for torch's relu_
    with tfuse.use_backend(backend):
        y = tfuse.add_act(x, bias, act=act, inplace=True, **slope_kwargs(act, 0.2))
    assert y.data_ptr() == x.data_ptr()
    grad = torch.randn_like(y)
    y.backward(grad)
    expected_y, (gx, _) = reference([base, bias], act, grad, y)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(leaf.grad, gx)
    assert_reduced_grad_close(bias.grad, gx, bias.shape)


def test_inplace_errors(device):
    x = make_input((4, 8), torch.float32, device)
    bias = make_input((8,), torch.float32, device)
    with pytest.raises(ValueError, match=r"inplace=True needs an activation whose gradient follows from its output.*gelu"):
        tfuse.add_act(x, bias, act="gelu", inplace=True)
    with pytest.raises(ValueError, match=r"writes into x of dtype torch.float16, but the result is torch.float32"):
        tfuse.add_act(x.half(), bias, inplace=True)
    with pytest.raises(ValueError, match=r"needs a dense x"):
        tfuse.add_act(x[:, ::2], bias[::2], inplace=True)
    with pytest.raises(ValueError, match=r"share no memory with x"):
        tfuse.add_act(x, x[0], inplace=True)
    leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"leaf Variable that requires grad"):
        tfuse.add_act(leaf, bias, inplace=True)


def test_autocast_leaves_add_act_alone_as_it_does_add_and_activations(device):
    # Autocast does not cast add or activations, so act(x + b) keeps the inputs' dtype.
    x = make_input((4, 8), torch.float32, device)
    bias = make_input((8,), torch.float32, device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = tfuse.add_act(x, bias, act="gelu")
        expected = F.gelu(x + bias)
    assert y.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(y, expected)


@pytest.mark.skipif(
    not ON_CUDA or torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
    reason="needs a GPU with 40 GB: float16 tensors of 2**31 + 4099 elements "
    "(the interpreter would take hours; the int64 logic itself is tested above)",
)
def test_more_than_2_31_elements_on_gpu(device):
    numel = 2**31 + 4099
    windows = [slice(0, 4096), slice(2**31 - 2048, 2**31 + 2048), slice(numel - 1024, numel)]  # disjoint
    x = torch.randn(numel, device=device, dtype=torch.float16).requires_grad_()
    bias = torch.randn((), device=device, dtype=torch.float16).requires_grad_()
    # The incoming gradient is zero except in the windows, so the bias gradient is a sum of a few thousand
    # known terms: an element read from the wrong offset (int32 wrap-around past 2**31) changes it.
    dy = torch.zeros(numel, device=device, dtype=torch.float16)
    for window in windows:
        dy[window] = torch.randn(window.stop - window.start, device=device, dtype=torch.float16)
    y = tfuse.add_act(x, bias, act="silu")
    y.backward(dy)
    expected_bias_grad = torch.zeros((), dtype=torch.float64, device=device)
    magnitude = torch.zeros((), dtype=torch.float64, device=device)
    for window in windows:
        z = (x.detach()[window].float() + bias.detach().float()).requires_grad_()
        expected = F.silu(z)
        expected.backward(dy[window].float())
        torch.testing.assert_close(y.detach()[window], expected.half())
        torch.testing.assert_close(x.grad[window], z.grad.half())
        terms = z.grad.double()
        expected_bias_grad += terms.sum()
        magnitude += terms.abs().sum()
    outside = slice(2**30, 2**30 + 4096)
    assert torch.count_nonzero(x.grad[outside]) == 0
    # float32 accumulation of at most 3 * 4096 nonzero terms, rounded once to float16.
    bound = unit_roundoff(torch.float16) * expected_bias_grad.abs() + 3 * 4096 * unit_roundoff(torch.float32) * magnitude
    assert (bias.grad.double() - expected_bias_grad).abs() <= bound
