"""FusedBatchNormAct1d/2d and batch_norm_act against nn.BatchNorm + residual + activation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tfuse
from tfuse.functional import batch_norm_act
from tfuse.nn import FusedBatchNormAct1d, FusedBatchNormAct2d

from helpers import make_input, torch_activation

ACTS = ["relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "identity"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference_step(bn: nn.Module, act: str, x: torch.Tensor, residual: torch.Tensor | None, dy: torch.Tensor):
    """nn.BatchNorm + residual + act in float32 on the same values: output and gradients."""
    xr = x.detach().float().requires_grad_()
    rr = residual.detach().float().requires_grad_() if residual is not None else None
    z = bn(xr)
    if rr is not None:
        z = z + rr
    y = torch_activation(act, 0.01)(z)
    leaves = [xr] + ([rr] if rr is not None else []) + [p for p in (bn.weight, bn.bias) if p is not None]
    grads = torch.autograd.grad(y, leaves, dy.float())
    return y, grads


# d(weight) and d(bias) are sums over N * H * W float32 terms; torch's CPU
# reference accumulates in double. Summed in float32 in another order they
# differ by a few 1e-6 relative for a few hundred terms, past torch.testing's
# float32 default (1.3e-6). Parameter gradients are compared at 1e-5.
PARAM_GRAD_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def grad_tolerance(dtype: torch.dtype) -> dict:
    # Gradients of a normalisation combine many rounded terms; in half
    # precision the inputs' own rounding (x and dy rounded to the dtype before
    # either side sees them) dominates. float32: torch.testing's defaults.
    return {torch.float32: {}, torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("act", ACTS)
def test_training_step_matches_batchnorm2d(act, with_residual, layout, dtype, device):
    reference = nn.BatchNorm2d(7).to(device)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    fused = FusedBatchNormAct2d(7, act=act).to(device)
    fused.load_state_dict(reference.state_dict())
    x = make_input((3, 7, 5, 6), dtype, device, layout).requires_grad_()
    residual = make_input((3, 7, 5, 6), dtype, device).requires_grad_() if with_residual else None
    with tfuse.count_launches() as forward:
        y = fused(x, residual)
    dy = torch.randn_like(y)
    with tfuse.count_launches() as backward:
        grads = torch.autograd.grad(y, [x] + ([residual] if with_residual else []) + [fused.weight, fused.bias], dy)
    expected_y, expected_grads = reference_step(reference, act, x, residual, dy)
    assert y.dtype == dtype and y.stride() == x.stride()
    torch.testing.assert_close(y, expected_y.to(dtype))
    for index, (mine, theirs) in enumerate(zip(grads, expected_grads)):
        is_param_grad = index >= len(grads) - 2
        tolerance = PARAM_GRAD_TOLERANCE if is_param_grad and dtype == torch.float32 else grad_tolerance(dtype)
        torch.testing.assert_close(mine.float(), theirs, **tolerance)
    torch.testing.assert_close(fused.running_mean, reference.running_mean)
    torch.testing.assert_close(fused.running_var, reference.running_var)
    assert fused.num_batches_tracked.item() == reference.num_batches_tracked.item() == 1
    assert forward.total == 3 and backward.total == 3


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_over_several_steps(momentum, backend, device):
    reference = nn.BatchNorm2d(5, momentum=momentum).to(device)
    fused = FusedBatchNormAct2d(5, act="relu", momentum=momentum).to(device)
    with tfuse.use_backend(backend):
        for _ in range(4):
            x = make_input((4, 5, 3, 3), torch.float32, device) * 2 + 0.5
            fused(x)
            reference(x)
    torch.testing.assert_close(fused.running_mean, reference.running_mean)
    torch.testing.assert_close(fused.running_var, reference.running_var)
    assert fused.num_batches_tracked.item() == 4


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_eval_is_one_scale_shift_pass(layout, with_residual, device):
    reference = nn.BatchNorm2d(6).to(device)
    with torch.no_grad():
        reference.running_mean.uniform_(-1, 1)
        reference.running_var.uniform_(0.5, 2)
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    reference.eval()
    fused = FusedBatchNormAct2d.from_batchnorm(copy.deepcopy(reference), act="silu")
    assert not fused.training
    x = make_input((2, 6, 7, 3), torch.float32, device, layout).requires_grad_()
    residual = make_input((2, 6, 7, 3), torch.float32, device) if with_residual else None
    with tfuse.count_launches() as forward:
        y = fused(x, residual)
    dy = torch.randn_like(y)
    with tfuse.count_launches() as backward:
        gx, gw, gb = torch.autograd.grad(y, (x, fused.weight, fused.bias), dy)
    expected_y, expected_grads = reference_step(reference, "silu", x, residual, dy)
    ex, ew, eb = expected_grads[0], expected_grads[-2], expected_grads[-1]
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew, **PARAM_GRAD_TOLERANCE)
    torch.testing.assert_close(gb, eb, **PARAM_GRAD_TOLERANCE)
    assert forward.total == 1 and backward.total == 2
    torch.testing.assert_close(fused.running_mean, reference.running_mean)  # untouched in eval


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_options(affine, track, training, device):
    reference = nn.BatchNorm2d(9, affine=affine, track_running_stats=track).to(device).train(training)
    fused = FusedBatchNormAct2d(9, act="gelu", affine=affine, track_running_stats=track).to(device).train(training)
    fused.load_state_dict(reference.state_dict())
    x = make_input((3, 9, 4, 5), torch.float32, device).requires_grad_()
    dy = torch.randn(3, 9, 4, 5, device=device)
    y = fused(x)
    (gx,) = torch.autograd.grad(y, x, dy)
    expected_y, expected_grads = reference_step(reference, "gelu", x, None, dy)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(gx, expected_grads[0])
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(getattr(fused, name), buffer)


@pytest.mark.parametrize("shape", [(1, 130, 3, 3), (5, 3, 1, 1), (2, 257, 1, 2), (3, 4, 11, 13)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_odd_sizes(shape, layout, device):
    channels = shape[1]
    reference = nn.BatchNorm2d(channels).to(device)
    fused = FusedBatchNormAct2d(channels, act="relu").to(device)
    x = make_input(shape, torch.float32, device, layout).requires_grad_()
    residual = make_input(shape, torch.float32, device).requires_grad_()
    y = fused(x, residual)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, residual, fused.weight, fused.bias), dy)
    expected_y, expected_grads = reference_step(reference, "relu", x, residual, dy)
    torch.testing.assert_close(y, expected_y)
    for index, (mine, theirs) in enumerate(zip(grads, expected_grads)):
        torch.testing.assert_close(mine, theirs, **(PARAM_GRAD_TOLERANCE if index >= 2 else {}))
    torch.testing.assert_close(fused.running_var, reference.running_var)


def test_large_mean_keeps_its_variance(device):
    # Mean 1000, std 1 in float32: a naive E[x^2] - E[x]^2 loses the variance.
    fused = FusedBatchNormAct2d(4, act="identity", momentum=1.0).to(device)
    x = torch.randn(8, 4, 16, 16, device=device, dtype=torch.float64) + 1000
    fused(x.float())
    unbiased = x.var(dim=(0, 2, 3))
    relative = ((fused.running_var.double() - unbiased) / unbiased).abs().max().item()
    assert relative < 1e-3
    torch.testing.assert_close(fused.running_mean.double(), x.mean(dim=(0, 2, 3)), rtol=1e-6, atol=0)


def test_one_value_per_channel_raises_torch_error(device):
    fused = FusedBatchNormAct2d(3).to(device)
    reference = nn.BatchNorm2d(3).to(device)
    x = torch.randn(1, 3, 1, 1, device=device)
    with pytest.raises(ValueError) as torch_error:
        reference(x)
    with pytest.raises(ValueError) as ours:
        fused(x)
    assert str(ours.value) == str(torch_error.value)
    fused.eval()
    assert fused(x).shape == x.shape  # fine with running statistics
    fused.train()
    assert fused(torch.randn(1, 3, 2, 1, device=device)).shape == (1, 3, 2, 1)  # batch 1, spatial > 1: valid


@pytest.mark.parametrize("shape", [(6, 10), (4, 10, 7)])
def test_batchnorm1d(shape, device):
    reference = nn.BatchNorm1d(10).to(device)
    fused = FusedBatchNormAct1d(10, act="tanh").to(device)
    x = make_input(shape, torch.float32, device).requires_grad_()
    y = fused(x)
    dy = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, fused.weight, fused.bias), dy)
    expected_y, (ex, ew, eb) = reference_step(reference, "tanh", x, None, dy)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew, **PARAM_GRAD_TOLERANCE)
    torch.testing.assert_close(gb, eb, **PARAM_GRAD_TOLERANCE)
    torch.testing.assert_close(fused.running_var, reference.running_var)
    with pytest.raises(ValueError, match=r"expected 2D or 3D input"):
        fused(torch.randn(2, 10, 3, 3, device=device))


@pytest.mark.parametrize("training", [True, False])
def test_gradcheck_float64(training, device):
    x = make_input((3, 4, 3, 2), torch.float64, device).requires_grad_()
    residual = make_input((3, 4, 3, 2), torch.float64, device).requires_grad_()
    weight = (torch.rand(4, device=device, dtype=torch.float64) + 0.5).requires_grad_()
    bias = torch.randn(4, device=device, dtype=torch.float64).requires_grad_()
    running_mean = torch.randn(4, device=device, dtype=torch.float64)
    running_var = torch.rand(4, device=device, dtype=torch.float64) + 0.5

    def fn(x, residual, weight, bias):
        mean, var = running_mean.clone(), running_var.clone()
        return batch_norm_act(x, mean, var, weight, bias, training=training, act="silu", residual=residual)

    assert torch.autograd.gradcheck(fn, (x, residual, weight, bias))


def test_state_dict_interchange_and_from_batchnorm(device):
    reference = nn.BatchNorm2d(6).to(device)
    reference(torch.randn(4, 6, 3, 3, device=device))  # non-trivial running statistics
    fused = FusedBatchNormAct2d(6, act="relu").to(device)
    assert list(fused.state_dict()) == list(reference.state_dict())
    fused.load_state_dict(reference.state_dict())
    back = nn.BatchNorm2d(6).to(device)
    back.load_state_dict(fused.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value)
    shared = FusedBatchNormAct2d.from_batchnorm(reference, act="gelu")
    assert shared.weight is reference.weight and shared.running_mean is reference.running_mean
    assert isinstance(shared, nn.BatchNorm2d) and "gelu" in repr(shared)
    with pytest.raises(TypeError, match=r"expects a BatchNorm layer, got Linear"):
        FusedBatchNormAct2d.from_batchnorm(nn.Linear(2, 2))


def test_torch_backend_matches(device):
    reference = nn.BatchNorm2d(5).to(device)
    fused = FusedBatchNormAct2d(5, act="gelu").to(device)
    x = make_input((3, 5, 4, 4), torch.float32, device).requires_grad_()
    residual = make_input((3, 5, 4, 4), torch.float32, device)
    with tfuse.use_backend("torch"), tfuse.count_launches() as launches:
        y = fused(x, residual)
        dy = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, dy)
    assert launches.total == 0
    expected_y, expected_grads = reference_step(reference, "gelu", x, residual, dy)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(gx, expected_grads[0])


def test_errors(device):
    x = torch.randn(2, 3, 4, 4, device=device)
    with pytest.raises(ValueError, match=r"unknown activation 'swish'"):
        FusedBatchNormAct2d(3, act="swish")
    with pytest.raises(ValueError, match=r"residual must have x's shape \[2, 3, 4, 4\], got \[2, 3, 4\]"):
        batch_norm_act(x, None, None, residual=torch.randn(2, 3, 4, device=device), training=True)
    with pytest.raises(ValueError, match=r"weight must have shape \[3\], got \[4\]"):
        batch_norm_act(x, None, None, torch.ones(4, device=device), torch.ones(4, device=device), training=True)
    with pytest.raises(ValueError, match=r"at least 2 dimensions"):
        batch_norm_act(torch.randn(3, device=device), None, None, training=True)
    with pytest.raises(TypeError, match=r"x has dtype torch.int64"):
        batch_norm_act(torch.ones(2, 3, dtype=torch.int64, device=device), None, None, training=True)
    with pytest.raises(TypeError, match=r"momentum must be a number, got NoneType"):
        batch_norm_act(x, None, None, training=True, momentum=None)


@pytest.mark.parametrize("act, keeps", [("relu", "output"), ("gelu", "residual")])
def test_saves_no_pre_activation(act, keeps, device):
    # Full-size tensors kept for backward: x and either the output (relu) or
    # the residual (gelu recomputes its input); per-channel vectors besides.
    layer = FusedBatchNormAct2d(4, act=act).to(device)
    x = make_input((2, 4, 6, 6), torch.float32, device).requires_grad_()
    skip = make_input((2, 4, 6, 6), torch.float32, device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x, skip)
    full_size = {t.untyped_storage().data_ptr() for t in saved if t.numel() == x.numel()}
    expected = {x.untyped_storage().data_ptr(), (y if keeps == "output" else skip).untyped_storage().data_ptr()}
    assert full_size == expected
    assert all(t.numel() in (x.numel(), 4) for t in saved)
