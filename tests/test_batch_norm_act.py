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
from tfuse.ops import _arrivals
from tfuse.ops import _bn_geometry as bn_geometry
from tfuse.ops import _bn_plans as bn_plans
from tfuse.ops import batch_norm as bn_ops

from helpers import ACTIVATION_NAMES, PATH_ACTIVATIONS, assert_batch_norm_input_grad_accurate, make_input, torch_activation

ACTS = list(ACTIVATION_NAMES)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def grad_at_batch_norm_output(act: str, z: torch.Tensor, residual: torch.Tensor | None, dy: torch.Tensor) -> torch.Tensor:
    """float64 gradient at the batch norm's output ``z`` (before the residual add and the activation)."""
    z64 = z.detach().double().requires_grad_()
    pre = z64 + residual.detach().double() if residual is not None else z64
    (grad,) = torch.autograd.grad(torch_activation(act, 0.01)(pre), z64, dy.double())
    return grad


def assert_input_grad(gx: torch.Tensor, bn: nn.Module, act: str, x: torch.Tensor, residual: torch.Tensor | None,
                      dy: torch.Tensor) -> None:
    """Training-mode d(x) against float64 within its error bound (see helpers.assert_batch_norm_input_grad_accurate)."""
    z = F.batch_norm(x.detach().double(), None, None, None if bn.weight is None else bn.weight.detach().double(),
                     None if bn.bias is None else bn.bias.detach().double(), training=True, eps=bn.eps)
    grad_out = grad_at_batch_norm_output(act, z, residual, dy)
    assert_batch_norm_input_grad_accurate(gx, x, bn.weight, grad_out, bn.eps)


def reference_step(bn: nn.Module, act: str, x: torch.Tensor, residual: torch.Tensor | None, dy: torch.Tensor):
    """nn.BatchNorm + residual + act in float32 on the same values: output and gradients.

    sigmoid and tanh differentiate from their output, in torch as in tfuse: from the output as it is kept,
    rounded to x's dtype (in bfloat16 near saturation 1 - y*y of the rounded y is far from float32's, and a
    parameter gradient sums those terms).
    """
    xr = x.detach().float().requires_grad_()
    rr = residual.detach().float().requires_grad_() if residual is not None else None
    z = bn(xr)
    if rr is not None:
        z = z + rr
    y = torch_activation(act, 0.01)(z)
    leaves = [xr] + ([rr] if rr is not None else []) + [p for p in (bn.weight, bn.bias) if p is not None]
    if act in ("sigmoid", "tanh"):
        kept = y.detach().to(x.dtype).float()
        backward = torch.ops.aten.sigmoid_backward if act == "sigmoid" else torch.ops.aten.tanh_backward
        grads = torch.autograd.grad(z, leaves, backward(dy.float(), kept))
    else:
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


# The activations of every path with and without a residual, the others (whose path is one of those) with one,
# each in every dtype. The memory layout is a path of its own, independent of the activation: it alternates over
# the cases, so that every dtype and every activation meets both layouts (pairs, not the whole cross product).
_ACT_RESIDUAL = [(act, residual) for act in ACTS for residual in (False, True) if act in PATH_ACTIVATIONS or residual]
TRAINING_CASES = [
    (act, residual, ("contiguous", "channels_last")[(i + j) % 2], dtype)
    for i, (act, residual) in enumerate(_ACT_RESIDUAL)
    for j, dtype in enumerate(DTYPES)
]


@pytest.mark.parametrize("act, with_residual, layout, dtype", TRAINING_CASES)
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
        if index == 0 and dtype == torch.float32:
            assert_input_grad(mine, reference, act, x, residual, dy)  # float64, within its cancellation bound
            continue
        tolerance = PARAM_GRAD_TOLERANCE if is_param_grad and dtype == torch.float32 else grad_tolerance(dtype)
        torch.testing.assert_close(mine.float(), theirs, **tolerance)
    torch.testing.assert_close(fused.running_mean, reference.running_mean)
    torch.testing.assert_close(fused.running_var, reference.running_var)
    assert fused.num_batches_tracked.item() == reference.num_batches_tracked.item() == 1
    assert forward.total == 2 and backward.total == 2  # statistics (merged in), normalise; sums (merged in), dx


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
    assert forward.total == 1 and backward.total == 1  # the sums pass writes dx and merges d(weight), d(bias)
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
    assert_input_grad(grads[0], reference, "relu", x, residual, dy)  # 4 elements per channel: terms cancel
    for index, (mine, theirs) in enumerate(zip(grads[1:], expected_grads[1:]), start=1):
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
    # Small: every input element is a gradcheck column (two forwards of two interpreted launches each).
    x = make_input((2, 3, 2, 2), torch.float64, device).requires_grad_()
    residual = make_input((2, 3, 2, 2), torch.float64, device).requires_grad_()
    weight = (torch.rand(3, device=device, dtype=torch.float64) + 0.5).requires_grad_()
    bias = torch.randn(3, device=device, dtype=torch.float64).requires_grad_()
    running_mean = torch.randn(3, device=device, dtype=torch.float64)
    running_var = torch.rand(3, device=device, dtype=torch.float64) + 0.5

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


# ------------------------------------------------------------------ tilings of the kernels (kernels/batch_norm.py)

def _tiling(x: torch.Tensor):
    return bn_ops._geometry_of(x)


def float64_reference(x, residual, weight, bias, act, dy, eps=1e-5):
    """act(batch_norm(x) + residual) written out in float64 (batch statistics, biased variance), and its gradients."""
    xr = x.detach().double().requires_grad_()
    rr = residual.detach().double().requires_grad_() if residual is not None else None
    wr = weight.detach().double().requires_grad_()
    br = bias.detach().double().requires_grad_()
    dims = [0] + list(range(2, x.dim()))
    view = [1, -1] + [1] * (x.dim() - 2)
    mean = xr.mean(dim=dims, keepdim=True)
    var = ((xr - mean) ** 2).mean(dim=dims, keepdim=True)
    z = (xr - mean) / torch.sqrt(var + eps) * wr.view(view) + br.view(view)
    if rr is not None:
        z = z + rr
    y = torch_activation(act, 0.01)(z)
    leaves = [xr] + ([rr] if rr is not None else []) + [wr, br]
    return y, torch.autograd.grad(y, leaves, dy.double())


# (shape, layout, how the reductions split the columns)
TILINGS = [
    ((2, 24, 7, 7), "contiguous", "packed"),  # S = 49: rows of 49 values, 16 channels per program
    ((2, 12, 14, 14), "contiguous", "packed"),  # S = 196: 10 channels per program, a partial last group
    ((2, 3, 40, 40), "contiguous", "one"),  # S = 1600: one channel per program, in pieces
    ((3, 5, 7, 7), "channels_last", "lane"),  # a column per channel
    ((2, 130, 3, 3), "channels_last", "lane"),  # two column blocks, the second partial
]
_SEG_NAMES = {bn_ops._SEG_PACKED: "packed", bn_ops._SEG_ONE: "one", bn_ops._SEG_LANE: "lane"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, layout, seg", TILINGS)
def test_tilings_match_float64(shape, layout, seg, dtype, device):
    x = make_input(shape, dtype, device, layout).requires_grad_()
    residual = make_input(shape, dtype, device, layout).requires_grad_()
    weight = (torch.rand(shape[1], device=device) + 0.5).requires_grad_()
    bias = torch.randn(shape[1], device=device).requires_grad_()
    assert _SEG_NAMES[_tiling(x).seg] == seg
    y = batch_norm_act(x, None, None, weight, bias, training=True, act="relu", residual=residual)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, residual, weight, bias), dy)
    expected_y, expected_grads = float64_reference(x, residual, weight, bias, "relu", dy)
    assert y.stride() == x.stride()
    tolerance = {} if dtype == torch.float32 else grad_tolerance(dtype)
    torch.testing.assert_close(y.double(), expected_y, **(tolerance or dict(rtol=1e-5, atol=1e-5)))
    for index, (mine, theirs) in enumerate(zip(grads, expected_grads)):
        torch.testing.assert_close(mine.double(), theirs, **(tolerance or dict(rtol=1e-4, atol=1e-4)))


def assert_param_grads_accurate(dweight, dbias, bn, x, residual, dy) -> None:
    """d(weight), d(bias) of relu(bn(x) + residual) against float64 sums, within what float32 summation allows.

    Each is a sum of N*H*W terms of both signs (thousands here), so a float32
    sum in any order can differ from the exact one by a few roundings of the
    sum of |terms| (its condition), far past a fixed rtol when the terms cancel.
    Bound: 16 float32 roundings of sum(|terms|), plus the terms whose relu mask
    float32 may decide otherwise (|z| below 1e-5).
    """
    dims = (0, 2, 3)
    x64, r64, dy64 = x.detach().double(), residual.detach().double(), dy.double()
    var, mean = torch.var_mean(x64, dims, correction=0, keepdim=True)
    xhat = (x64 - mean) / torch.sqrt(var + bn.eps)
    z = xhat * bn.weight.detach().double().view(1, -1, 1, 1) + bn.bias.detach().double().view(1, -1, 1, 1) + r64
    dz = dy64 * (z > 0)
    unit = torch.finfo(torch.float32).eps / 2
    near_zero = z.abs() < 1e-5
    for mine, terms, ambiguous in ((dweight, dz * xhat, dy64 * xhat), (dbias, dz, dy64)):
        bound = 16 * unit * terms.abs().sum(dims) + (ambiguous.abs() * near_zero).sum(dims) + 1e-12
        error = (mine.double() - terms.sum(dims)).abs()
        assert (error <= bound).all(), f"error {error.tolist()} over bound {bound.tolist()}"


# Reductions of several column groups and several row chunks, also in the interpreter's 8-program grids: the
# last programs to arrive merge the others' partials (kernels/batch_norm.py, "last program merges").
MERGES = [
    ((3, 2, 32, 32), "contiguous", "one"),  # 2 groups of one channel; 3 rows in chunks of 1 (interpreter)
    ((17, 17, 2, 2), "contiguous", "packed"),  # 2 groups (the second partial); 17 rows in chunks of 16
    ((2, 96, 5, 5), "channels_last", "lane"),  # 3 groups of 32 channels; 50 rows in chunks of 32
]


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("shape, layout, seg", MERGES)
def test_last_programs_merge_every_group(shape, layout, seg, levels, device, monkeypatch):
    """Statistics, gradients and running statistics through the merges; levels=2 forces blocks of at most 2
    chunks (3 chunks: blocks of 2 and 1) and one item per merge step, as large grids get."""
    if levels == 2:
        monkeypatch.setattr(bn_plans, "_forward_plans", {})  # plans of their own, dropped after the test
        monkeypatch.setattr(bn_geometry, "_chunks_per_block", lambda chunks, per_step: 2 if chunks > 2 else 1)
        monkeypatch.setattr(bn_geometry, "MERGE_TILE", 1)
    channels = shape[1]
    reference = nn.BatchNorm2d(channels).to(device)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    fused = FusedBatchNormAct2d(channels, act="relu").to(device)
    fused.load_state_dict(reference.state_dict())
    x = make_input(shape, torch.float32, device, layout).requires_grad_()
    residual = make_input(shape, torch.float32, device, layout).requires_grad_()
    y = fused(x, residual)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, residual, fused.weight, fused.bias), dy)
    plan = y.grad_fn.plan
    (backward,) = plan.backward.values()
    assert _SEG_NAMES[plan.geometry.seg] == seg
    for launch, counters in ((plan.stats, plan.counters), (backward.reduce, backward.counters)):
        groups, chunks = launch.grid
        blocks = -(-chunks // launch.ints[-1])  # the last integer argument: chunks per block
        assert groups >= 2 and chunks >= 2 and (blocks == 1 if levels == 1 else blocks >= 2)
        assert counters.tensor.numel() == groups * (1 + blocks)
        assert not counters.tensor.any()  # each launch leaves its arrival counters at 0 for the next
    expected_y, expected_grads = reference_step(reference, "relu", x, residual, dy)
    torch.testing.assert_close(y, expected_y)
    assert_input_grad(grads[0], reference, "relu", x, residual, dy)
    torch.testing.assert_close(grads[1], expected_grads[1])
    assert_param_grads_accurate(grads[2], grads[3], fused, x, residual, dy)
    torch.testing.assert_close(fused.running_mean, reference.running_mean)
    torch.testing.assert_close(fused.running_var, reference.running_var)
    # Again, weight and bias alone: the same merges, in the one launch of a backward without dx.
    again = fused(x.detach(), residual.detach())
    with tfuse.count_launches() as launches:
        weight_grads = torch.autograd.grad(again, (fused.weight, fused.bias), dy)
    assert launches.total == 1 and torch.equal(again, y)
    assert torch.equal(weight_grads[0], grads[2]) and torch.equal(weight_grads[1], grads[3])


def test_arrival_counters_outlive_their_plans_and_zero_after_a_capture(device, monkeypatch):
    """Counters of dropped plans are kept (a captured CUDA graph may still use them) and taken over by new
    plans; counters allocated during a capture (whose zero fill runs on replay only) are filled at first use."""
    monkeypatch.setattr(bn_plans, "_forward_plans", {})
    monkeypatch.setattr(bn_plans, "_spare_counters", {})
    x = torch.randn(4, 3, 2, 2, device=device)
    batch_norm_act(x, None, None, training=True)
    (plan,) = bn_plans._forward_plans.values()
    counters = plan.counters
    bn_plans._drop_plans()
    assert not bn_plans._forward_plans and bn_plans._spare_counters
    batch_norm_act(x, None, None, training=True)
    (plan,) = bn_plans._forward_plans.values()
    assert plan.counters is counters and not bn_plans._spare_counters[(counters.tensor.device, counters.tensor.numel())]
    monkeypatch.setattr(_arrivals, "_capturing", lambda device: True)
    captured = _arrivals.ArrivalCounters(3, device)
    monkeypatch.setattr(_arrivals, "_capturing", lambda device: False)
    captured.tensor.fill_(7)  # what the memory may hold before a replay has run the fill
    assert captured.pending and not captured.ready().any() and not captured.pending


@pytest.mark.parametrize("shape, layout, seg", TILINGS + [((64, 5), "contiguous", "lane")])
def test_each_channel_keeps_its_variance_at_large_means(shape, layout, seg, device):
    # Channels with means from -1e4 to 1e4 and std 1, in float32: each channel's shift
    # must come from that channel (a neighbour's would leave a large mean in the sums).
    channels = shape[1]
    means = torch.linspace(-1e4, 1e4, channels, dtype=torch.float64, device=device)
    view = [1, -1] + [1] * (len(shape) - 2)
    x64 = torch.randn(shape, dtype=torch.float64, device=device) + means.view(view)
    x = x64.float()
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    assert _SEG_NAMES[_tiling(x).seg] == seg
    running_mean, running_var = torch.zeros(channels, device=device), torch.ones(channels, device=device)
    y = batch_norm_act(x, running_mean, running_var, training=True, momentum=1.0, act="identity")
    dims = [0] + list(range(2, len(shape)))
    exact = x.double()  # the float32 values the op saw
    unbiased = exact.var(dim=dims)
    assert ((running_var.double() - unbiased) / unbiased).abs().max().item() < 1e-3
    torch.testing.assert_close(running_mean.double(), exact.mean(dim=dims), rtol=1e-6, atol=1e-6)
    biased = exact.var(dim=dims, unbiased=False, keepdim=True)
    normalised = (exact - exact.mean(dim=dims, keepdim=True)) / torch.sqrt(biased + 1e-5)
    torch.testing.assert_close(y.double(), normalised, rtol=0, atol=5e-3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 1, 3, 3), (1, 5, 1, 3), (5, 3, 1, 1), (2, 9, 11, 13)])
def test_odd_sizes_both_backends_match_float64(shape, backend, device):
    x = make_input(shape, torch.float32, device).requires_grad_()
    residual = make_input(shape, torch.float32, device)
    weight = (torch.rand(shape[1], device=device) + 0.5).requires_grad_()
    bias = torch.randn(shape[1], device=device).requires_grad_()
    with tfuse.use_backend(backend), tfuse.count_launches() as launches:
        y = batch_norm_act(x, None, None, weight, bias, training=True, act="gelu", residual=residual)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, weight, bias), dy)
    assert launches.total == (4 if backend == "triton" else 0)
    expected_y, (ex, er, ew, eb) = float64_reference(x, residual, weight, bias, "gelu", dy)
    # float32 centring x - mean loses |x| / |x - mean| of its digits (two close values in a channel of two): the
    # bound grows with that condition number, times the normalising scale and gelu's slope (at most 1.13).
    xd = x.detach().double()
    dims = [0, 2, 3]
    var, mean = torch.var_mean(xd, dims, correction=0, keepdim=True)
    scale = weight.detach().double().view(1, -1, 1, 1).abs() * torch.rsqrt(var + 1e-5)
    centring = 4 * torch.finfo(torch.float32).eps * (xd.abs() + mean.abs()) * scale * 1.13
    error = (y.double() - expected_y).abs()
    allowed = 1e-5 + 1e-5 * expected_y.abs() + centring
    assert bool((error <= allowed).all()), f"forward: {error.max().item():.3e} beyond {allowed.flatten()[error.argmax()]:.3e}"
    for mine, theirs in zip(grads, (ex, ew, eb)):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-4, atol=1e-4)


def test_other_layouts_are_copied_and_still_correct(device):
    # x laid out (C, N, H, W) in memory, a channels_last residual, and dy from y.sum() (every stride 0).
    x = torch.randn(5, 3, 4, 6, device=device).permute(1, 0, 2, 3).requires_grad_()
    residual = make_input((3, 5, 4, 6), torch.float32, device, "channels_last").requires_grad_()
    weight = (torch.rand(5, device=device) + 0.5).requires_grad_()
    bias = torch.randn(5, device=device).requires_grad_()
    y = batch_norm_act(x, None, None, weight, bias, training=True, act="silu", residual=residual)
    grads = torch.autograd.grad(y.sum(), (x, residual, weight, bias))
    expected_y, expected_grads = float64_reference(x, residual, weight, bias, "silu", torch.ones_like(y))
    torch.testing.assert_close(y.double(), expected_y, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_residual_gradient_in_its_own_dtype(layout, device):
    # d(residual) is dy' in the residual's dtype; the dx pass reads it back only when that loses nothing.
    x = make_input((3, 6, 5, 5), torch.float32, device, layout).requires_grad_()
    residual = make_input((3, 6, 5, 5), torch.float16, device, layout).requires_grad_()
    weight = (torch.rand(6, device=device) + 0.5).requires_grad_()
    bias = torch.randn(6, device=device).requires_grad_()
    y = batch_norm_act(x, None, None, weight, bias, training=True, act="relu", residual=residual)
    dy = torch.randn_like(y)
    gx, gr = torch.autograd.grad(y, (x, residual), dy)
    expected_y, (ex, er, _, _) = float64_reference(x, residual.float(), weight, bias, "relu", dy)
    assert gr.dtype == torch.float16
    torch.testing.assert_close(gx.double(), ex, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gr.double(), er, rtol=1e-3, atol=1e-3)


def test_results_are_deterministic(device):
    x = make_input((4, 24, 7, 7), torch.bfloat16, device).requires_grad_()
    residual = make_input((4, 24, 7, 7), torch.bfloat16, device).requires_grad_()
    layer = FusedBatchNormAct2d(24).to(device)
    dy = torch.randn_like(x)
    runs = []
    for _ in range(2):
        y = layer(x, residual)
        runs.append((y, *torch.autograd.grad(y, (x, residual, layer.weight, layer.bias), dy)))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("shape, layout, seg, vec", [
    ((256, 2048, 7, 7), "contiguous", "packed", 8),
    ((256, 1024, 14, 14), "contiguous", "packed", 8),
    ((256, 64, 112, 112), "contiguous", "one", 8),
    ((256, 64, 112, 112), "channels_last", "lane", 8),
    ((256, 2048, 7, 7), "channels_last", "lane", 8),
])
def test_resnet_shapes_get_16_byte_alignment(shape, layout, seg, vec):
    # Planning only (meta tensors): rows of 49 or 196 values still give 128-bit vectors (8 x bf16).
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    tiling = _tiling(x)
    assert _SEG_NAMES[tiling.seg] == seg
    assert tiling.red_vec == vec and tiling.ew_vec == vec
    assert tiling.group_width * tiling.groups >= tiling.n_cols > tiling.group_width * (tiling.groups - 1)


def test_cumulative_average_keeps_one_plan_and_follows_torch(device, monkeypatch):
    """momentum=None changes the update factor every step (1 / num_batches_tracked): a runtime argument, so
    the layer keeps one forward plan (its prepared launches) while its running statistics follow torch's."""
    monkeypatch.setattr(bn_plans, "_forward_plans", {})
    fused = FusedBatchNormAct2d(3, act="relu", momentum=None).to(device)
    reference = torch.nn.BatchNorm2d(3, momentum=None).to(device)
    for step in range(3):
        x = torch.randn(4, 3, 2, 2, device=device) * (step + 1) + step
        y = fused(x)
        torch.testing.assert_close(y, torch.relu(reference(x)))
        torch.testing.assert_close(fused.running_mean, reference.running_mean)
        torch.testing.assert_close(fused.running_var, reference.running_var)
    assert len(bn_plans._forward_plans) == 1
