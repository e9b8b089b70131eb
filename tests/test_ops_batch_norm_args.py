"""batch_norm_act's arguments against F.batch_norm's, on both backends: same errors (same words) or same results.

eps (zero and negative, training and eval), momentum (out of [0, 1], None),
per-channel tensors of the wrong size (a channel mismatch named as such),
mixed dtypes, running statistics given alone or missing in eval, weight or
bias alone, non-contiguous parameters and statistics, a residual of another
dtype; and negative_slope with an activation that has none.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tfuse
from tfuse.functional import batch_norm_act
from tfuse.nn import FusedBatchNormAct2d

from helpers import assert_batch_norm_input_grad_accurate, make_input

BACKENDS = ["triton", "torch"]
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _stats(c: int, device, dtype=F32):
    return torch.randn(c, device=device, dtype=dtype) * 0.1, torch.rand(c, device=device, dtype=dtype) + 0.5


def _outcome(fn):
    """("ok", result) or (exception type, message)."""
    try:
        return "ok", fn()
    except (ValueError, RuntimeError, TypeError) as error:
        return type(error), str(error)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("eps", [0.0, -1e-5, 1e-3])
def test_eps_as_torch(eps, training, backend, device):
    x = make_input((4, 5, 3, 3), F32, device)
    mean, var = _stats(5, device)
    weight, bias = torch.rand(5, device=device) + 0.5, torch.randn(5, device=device)
    ours_stats, torch_stats = (mean.clone(), var.clone()), (mean.clone(), var.clone())
    with tfuse.use_backend(backend):
        ours = _outcome(lambda: batch_norm_act(x, *ours_stats, weight, bias, training=training, eps=eps, act="identity"))
    theirs = _outcome(lambda: F.batch_norm(x, *torch_stats, weight, bias, training=training, eps=eps))
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "ok":
        assert not ours[1].isnan().any()
        torch.testing.assert_close(ours[1], theirs[1])
        torch.testing.assert_close(ours_stats, torch_stats)
    else:
        assert ours[1] == theirs[1]  # torch's own words


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_with_eps_zero_raises_torchs_error_in_training(backend, device):
    fused = FusedBatchNormAct2d(5, eps=0.0).to(device)
    reference = nn.BatchNorm2d(5, eps=0.0).to(device)
    x = make_input((2, 5, 3, 3), F32, device)
    with pytest.raises(ValueError) as theirs:
        reference(x)
    with tfuse.use_backend(backend), pytest.raises(ValueError) as ours:
        fused(x)
    assert str(ours.value) == str(theirs.value)  # torch's words, whichever torch is installed
    assert "batch_norm eps must be positive" in str(ours.value) and "got 0.0" in str(ours.value)
    fused.eval(), reference.eval()
    # With running statistics torch 2.13 takes eps = 0 and torch 2.11 refuses it (seen on the GPU machine's
    # torch): tfuse does what the installed torch does, in its words.
    try:
        expected = reference(x)
    except ValueError as refusal:
        with tfuse.use_backend(backend), pytest.raises(ValueError) as ours:
            fused(x)
        assert str(ours.value) == str(refusal)
    else:
        with tfuse.use_backend(backend):
            torch.testing.assert_close(fused(x), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("momentum", [0.0, 1.0, -0.5, 1.5, 3])
def test_momentum_out_of_range_updates_as_torch(momentum, backend, device):
    x = make_input((4, 6, 2, 3), F32, device) * 2 + 1
    mean, var = _stats(6, device)
    ours, theirs = (mean.clone(), var.clone()), (mean.clone(), var.clone())
    with tfuse.use_backend(backend):
        y = batch_norm_act(x, *ours, training=True, momentum=momentum, act="identity")
    expected = F.batch_norm(x, *theirs, training=True, momentum=momentum)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(ours, theirs)


def test_momentum_none_names_the_modules_option(device):
    x = make_input((4, 6, 2, 3), F32, device)
    with pytest.raises(TypeError, match=r"momentum must be a number, got NoneType \(momentum=None, a cumulative"):
        batch_norm_act(x, *_stats(6, device), training=True, momentum=None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training, track", [(True, True), (False, True), (True, False)])
def test_channel_mismatch_is_named(training, track, backend, device):
    # FusedBatchNormAct2d(16) given 8 channels: the input's channels, not running_mean, are the news.
    layer = FusedBatchNormAct2d(16, track_running_stats=track).to(device).train(training)
    x = make_input((2, 8, 4, 4), F32, device)
    names = "running_mean, running_var, weight, bias" if track else "weight, bias"
    with tfuse.use_backend(backend), pytest.raises(ValueError) as error:
        layer(x)
    message = str(error.value)
    assert "channel mismatch: x of shape [2, 8, 4, 4] has 8 channels (dimension 1)" in message
    assert f"but {names} have 16 elements, as for an input with 16 channels" in message


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["running_mean", "running_var", "weight", "bias"])
def test_one_tensor_of_the_wrong_size_is_named(name, backend, device):
    x = make_input((2, 8, 4, 4), F32, device)
    tensors = dict(zip(("running_mean", "running_var"), _stats(8, device)), weight=torch.ones(8, device=device),
                   bias=torch.zeros(8, device=device))
    tensors[name] = torch.ones(7, device=device)
    with tfuse.use_backend(backend), pytest.raises(ValueError, match=rf"{name} must have shape \[8\], got \[7\] "
                                                   rf"\(x has 8 channels; {name} should contain 8 elements not 7\)"):
        batch_norm_act(x, training=True, **tensors)
    with pytest.raises(ValueError, match=r"must have shape \[8\], got \[8, 1\]"):
        batch_norm_act(x, None, None, torch.ones(8, 1, device=device), torch.zeros(8, device=device), training=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "x_dtype, param_dtype, stats_dtype, torch_allows",
    [
        (F16, F32, F32, True), (BF16, F32, F32, True), (F16, F16, F16, True), (F64, F64, F64, True),
        (F64, F32, F32, False),  # tfuse takes float32 statistics with a float64 x too (normalised in float64)
        (F32, F64, F64, False), (F16, BF16, BF16, False), (F16, F32, F16, False), (F32, F32, F16, False),
    ],
)
def test_parameter_dtypes_as_torch(x_dtype, param_dtype, stats_dtype, torch_allows, backend, device):
    # torch: weight, bias and the running statistics share one dtype, x's or float32 for a 16-bit x.
    allowed = torch_allows or (x_dtype, param_dtype, stats_dtype) == (F64, F32, F32)
    x = make_input((3, 4, 2, 2), x_dtype, device)
    mean, var = (t.to(stats_dtype) for t in _stats(4, device))
    weight, bias = torch.rand(4, device=device, dtype=param_dtype) + 0.5, torch.randn(4, device=device, dtype=param_dtype)
    theirs = _outcome(lambda: F.batch_norm(x, mean.clone(), var.clone(), weight, bias, training=True))
    ours_stats = (mean.clone(), var.clone())
    with tfuse.use_backend(backend):
        ours = _outcome(lambda: batch_norm_act(x, *ours_stats, weight, bias, training=True, act="identity"))
    if device.type == "cpu":
        assert (theirs[0] == "ok") == torch_allows, theirs
    if allowed:
        assert ours[0] == "ok", ours
        expected_stats = (mean.double(), var.double())
        expected = F.batch_norm(x.double(), *expected_stats, weight.double(), bias.double(), training=True)
        tolerance = dict(rtol=1e-2, atol=1e-2) if x_dtype in (F16, BF16) else {}
        torch.testing.assert_close(ours[1], expected.to(x_dtype), **tolerance)
        torch.testing.assert_close(ours_stats, tuple(t.to(stats_dtype) for t in expected_stats), **tolerance)
    else:
        assert ours[0] is RuntimeError and "mixed dtype" in ours[1], ours


@pytest.mark.parametrize("backend", BACKENDS)
def test_running_statistics_alone_or_missing_as_torch(backend, device):
    x = make_input((3, 4, 2, 2), F32, device)
    mean, var = _stats(4, device)
    cases = [
        lambda fn: fn(x, mean.clone(), None, training=True),
        lambda fn: fn(x, None, var.clone(), training=False),
        lambda fn: fn(x, None, None, training=False),
        lambda fn: fn(x, mean.clone(), None, training=False),
    ]
    for case in cases:
        theirs = _outcome(lambda: case(F.batch_norm))
        with tfuse.use_backend(backend):
            ours = _outcome(lambda: case(batch_norm_act))
        assert ours[0] is theirs[0] and theirs[1] in ours[1], (ours, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("given", ["weight", "bias"])
@pytest.mark.parametrize("training", [True, False])
def test_weight_or_bias_alone_as_torch(given, training, backend, device):
    x = make_input((3, 5, 2, 3), F64, device).requires_grad_()
    param = (torch.rand(5, device=device, dtype=F64) + 0.5).requires_grad_()
    kwargs = {given: param}
    mean, var = _stats(5, device, F64)
    with tfuse.use_backend(backend):
        y = batch_norm_act(x, mean.clone(), var.clone(), training=training, act="tanh", **kwargs)
    # torch normalises with weight 1 where only a bias is given; said explicitly in the reference, because
    # torch 2.11's CUDA backward of a bias-only F.batch_norm raises "tensor does not have a device".
    reference_kwargs = kwargs if given == "weight" else dict(kwargs, weight=torch.ones_like(param))
    expected = torch.tanh(F.batch_norm(x, mean.clone(), var.clone(), training=training, **reference_kwargs))
    torch.testing.assert_close(y, expected)
    dy = torch.randn_like(y)
    for mine, theirs in zip(torch.autograd.grad(y, (x, param), dy), torch.autograd.grad(expected, (x, param), dy)):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False])
def test_non_contiguous_parameters_and_statistics(training, backend, device):
    # Views with stride 2: the kernels index per-channel vectors densely, so these must not be read as dense.
    x = make_input((4, 5, 3, 2), F32, device).requires_grad_()
    w_base = (torch.rand(10, device=device) + 0.5).requires_grad_()
    b_base = torch.randn(10, device=device).requires_grad_()
    stats = torch.stack(_stats(10, device))
    ours_stats, theirs_stats = stats.clone(), stats.clone()
    with tfuse.use_backend(backend):
        y = batch_norm_act(x, ours_stats[0, ::2], ours_stats[1, ::2], w_base[::2], b_base[::2], training=training,
                           act="silu")
    expected = F.silu(F.batch_norm(x, theirs_stats[0, ::2], theirs_stats[1, ::2], w_base[::2], b_base[::2],
                                   training=training))
    torch.testing.assert_close(y, expected)
    # Updated in place, through the views, in training. The reference is the update's formula, not torch's
    # result: cuDNN's batch norm drops the update of non-contiguous running statistics (pytorch#33867).
    if training:
        xd = x.detach().double()
        batch_var, batch_mean = torch.var_mean(xd, (0, 2, 3), correction=1)
        theirs_stats = stats.double().clone()
        theirs_stats[0, ::2] = 0.9 * theirs_stats[0, ::2] + 0.1 * batch_mean
        theirs_stats[1, ::2] = 0.9 * theirs_stats[1, ::2] + 0.1 * batch_var
    torch.testing.assert_close(ours_stats.double(), theirs_stats.double(), rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(y)
    ours, theirs = torch.autograd.grad(y, (x, w_base, b_base), dy), torch.autograd.grad(expected, (x, w_base, b_base), dy)
    if training:  # d(x) against float64 within the bound of its terms (they cancel for some data)
        weight = w_base[::2].detach()
        z = F.batch_norm(x.detach().double(), None, None, weight.double(), b_base[::2].detach().double(),
                         training=True).requires_grad_()
        (grad_out,) = torch.autograd.grad(F.silu(z), z, dy.double())
        assert_batch_norm_input_grad_accurate(ours[0], x, weight, grad_out, 1e-5)
        ours, theirs = ours[1:], theirs[1:]
    for mine, other in zip(ours, theirs):
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_dtype, residual_dtype", [(F16, F32), (F32, F64), (BF16, F16), (F32, F16)])
def test_residual_dtype_promotes_as_torch(x_dtype, residual_dtype, backend, device):
    x = make_input((3, 4, 3, 3), x_dtype, device).requires_grad_()
    residual = make_input((3, 4, 3, 3), residual_dtype, device).requires_grad_()
    mean, var = _stats(4, device)
    with tfuse.use_backend(backend):
        y = batch_norm_act(x, mean.clone(), var.clone(), training=True, act="relu", residual=residual)
    expected = F.relu(F.batch_norm(x, mean.clone(), var.clone(), training=True) + residual)
    assert y.dtype == expected.dtype == torch.promote_types(x_dtype, residual_dtype)
    exact = F.relu(F.batch_norm(x.double(), mean.double(), var.double(), training=True) + residual.double())
    low = x_dtype in (F16, BF16) or residual_dtype in (F16, BF16)
    # The PyTorch path normalises at x's precision (as torch), the kernels at the result's.
    tolerance = dict(rtol=2e-2, atol=2e-2) if low else dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(y, exact.to(y.dtype), **tolerance)
    dy = torch.randn_like(y)
    gx, gr = torch.autograd.grad(y, (x, residual), dy)
    # relu's derivative at the kink: where the low-precision pre-activation and the float64 one fall on
    # either side of 0 (only where the float64 one is within the forward's rounding of 0), both masks are
    # right; the reference takes ours there, and the float64 maths everywhere else.
    z = F.batch_norm(x.double(), mean.double(), var.double(), training=True) + residual.double()
    mask = (y.detach() > 0).double()
    flipped = mask != (z.detach() > 0).double()
    assert bool((z.detach()[flipped].abs() <= tolerance["atol"]).all()), "a relu mask differs away from the kink"
    ex, er = torch.autograd.grad(z, (x, residual), dy.double() * mask)
    assert gx.dtype == x_dtype and gr.dtype == residual_dtype
    # (the float64 reference's gradients come back in the inputs' dtypes, as ours)
    torch.testing.assert_close(gx.double(), ex.double(), **(tolerance if low else dict(rtol=1e-4, atol=1e-4)))
    torch.testing.assert_close(gr, er, **tolerance)


# ---------------------------------------------------------------- negative_slope


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "identity"])
def test_negative_slope_without_leaky_relu_is_an_error(act, device):
    x = make_input((2, 3, 2, 2), F32, device)
    message = rf"negative_slope=0\.2 has no effect with act='{act}'; it is the slope of act='leaky_relu' only"
    with pytest.raises(ValueError, match=rf"tfuse.add_act: {message}"):
        tfuse.add_act(x, act=act, negative_slope=0.2)
    with pytest.raises(ValueError, match=rf"tfuse.batch_norm_act: {message}"):
        batch_norm_act(x, None, None, training=True, act=act, negative_slope=0.2)
    with pytest.raises(ValueError, match=r"negative_slope=0\.01 has no effect"):  # the default value too, if given
        tfuse.add_act(x, act=act, negative_slope=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaky_relu_slope_default_and_given(backend, device):
    x = make_input((4, 9), F32, device)
    with tfuse.use_backend(backend):
        torch.testing.assert_close(tfuse.add_act(x, act="leaky_relu"), F.leaky_relu(x))
        torch.testing.assert_close(tfuse.add_act(x, act="leaky_relu", negative_slope=0.3), F.leaky_relu(x, 0.3))
        torch.testing.assert_close(tfuse.add_act(x, act="leaky_relu", negative_slope=None), F.leaky_relu(x))
        y = batch_norm_act(x.view(4, 9, 1), None, None, training=True, act="leaky_relu", negative_slope=0.3)
        torch.testing.assert_close(y, F.leaky_relu(F.batch_norm(x.view(4, 9, 1), None, None, training=True), 0.3))
