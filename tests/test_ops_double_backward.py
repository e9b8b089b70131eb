"""Double backward (``create_graph=True``) of add, add_act and batch_norm_act, on both backends.

A gradient penalty differentiates a gradient: with ``create_graph=True`` the
first backward must itself be differentiable, or the penalty is silently
dropped. Checked two ways: torch.autograd.gradgradcheck in float64, and the
second-order gradients of a gradient penalty against the same expression
written with torch's own ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tfuse
from tfuse.functional import batch_norm_act

from helpers import ACTIVATION_NAMES, torch_activation

# hardsigmoid: torch has no double backward for it (aten.hardsigmoid_backward has no derivative), so there is
# no reference; tfuse's second derivative of it is 0, like relu6's and hardtanh's, which are compared.
ACTS = [act for act in ACTIVATION_NAMES if act != "hardsigmoid"]
BACKENDS = ["triton", "torch"]
SLOPE = 0.3


def slope_kwargs(act: str, slope: float = SLOPE) -> dict:
    return {"negative_slope": slope} if act == "leaky_relu" else {}


def penalty_grads(fn, leaves: list[torch.Tensor], wrt: list[torch.Tensor], upstream: torch.Tensor):
    """The first gradients d <fn(leaves), upstream> / d wrt (with their graph), and the
    gradients of their squared norm (the penalty) with respect to every leaf."""
    out = fn(*leaves)
    first = torch.autograd.grad((out * upstream).sum(), wrt, create_graph=True)
    penalty = sum(g.pow(2).sum() for g in first)
    if not penalty.requires_grad:  # a linear fn: the first gradients are constants
        return first, [None] * len(leaves)
    return first, torch.autograd.grad(penalty, leaves, allow_unused=True)


def assert_same_second_order(ours_fn, torch_fn, inputs, wrt_index, upstream, backend):
    ours = [t.detach().clone().requires_grad_() for t in inputs]
    theirs = [t.detach().clone().requires_grad_() for t in inputs]
    with tfuse.use_backend(backend):
        first, mine = penalty_grads(ours_fn, ours, [ours[i] for i in wrt_index], upstream)
    first_ref, expected = penalty_grads(torch_fn, theirs, [theirs[i] for i in wrt_index], upstream)
    # A first gradient without a graph where torch's has one would silently drop a penalty.
    assert [g.requires_grad for g in first] == [g.requires_grad for g in first_ref]
    for a, b in zip(first, first_ref):
        torch.testing.assert_close(a, b)
    for index, (a, b) in enumerate(zip(mine, expected)):
        if b is None:
            assert a is None or (a == 0).all(), index
        else:
            torch.testing.assert_close(a, b, msg=lambda m: f"input {index}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_example_gradient_penalty_of_add_act(backend, device):
    # The issue's example: the gradient of tanh(h + b)^2 with respect to x (h = x W) must carry a graph.
    x = torch.randn(6, 5, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, device=device, dtype=torch.float64, requires_grad=True)
    with tfuse.use_backend(backend):
        (g,) = torch.autograd.grad(tfuse.add_act(x @ w, b, act="tanh").pow(2).sum(), x, create_graph=True)
    assert g.requires_grad
    second = torch.autograd.grad(g.pow(2).sum(), (x, w, b))
    (g_ref,) = torch.autograd.grad(torch.tanh(x @ w + b).pow(2).sum(), x, create_graph=True)
    expected = torch.autograd.grad(g_ref.pow(2).sum(), (x, w, b))
    torch.testing.assert_close(g, g_ref)
    for mine, theirs in zip(second, expected):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_add_second_order_matches_torch(dtype, backend, device):
    inputs = [torch.randn(3, 4, device=device, dtype=dtype), torch.randn(4, device=device, dtype=dtype),
              torch.randn(3, 1, device=device, dtype=dtype)]
    upstream = torch.randn(3, 4, device=device, dtype=dtype)
    # add is linear: its own second derivative is zero; through a square it is not.
    assert_same_second_order(
        lambda a, b, c: tfuse.add(a, b, c).pow(2), lambda a, b, c: (a + b + c).pow(2), inputs, [0, 1], upstream, backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ACTS)
def test_add_act_second_order_matches_torch(act, backend, device):
    x = torch.randn(5, 6, device=device, dtype=torch.float64)
    bias = torch.randn(6, device=device, dtype=torch.float64)
    residual = torch.randn(5, 6, device=device, dtype=torch.float64)
    upstream = torch.randn(5, 6, device=device, dtype=torch.float64)
    fn = torch_activation(act, SLOPE)
    assert_same_second_order(
        lambda x, b, r: tfuse.add_act(x, b, r, act=act, **slope_kwargs(act)),
        lambda x, b, r: fn(x + b + r),
        [x, bias, residual], [0, 1], upstream, backend,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ACTS)
def test_add_act_gradgradcheck(act, backend, device):
    x = torch.randn(3, 4, device=device, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, device=device, dtype=torch.float64, requires_grad=True)
    with tfuse.use_backend(backend):
        assert torch.autograd.gradgradcheck(
            lambda x, b: tfuse.add_act(x, b, act=act, **slope_kwargs(act)), (x, bias), fast_mode=True
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act, slope", [("leaky_relu", -0.2), ("relu", None)])
def test_add_act_second_order_with_inplace_and_negative_slope(act, slope, backend, device):
    # inplace (the output saved is x itself) and leaky_relu with a negative slope (inputs saved).
    x = torch.randn(4, 7, device=device, dtype=torch.float64)
    bias = torch.randn(7, device=device, dtype=torch.float64)
    upstream = torch.randn(4, 7, device=device, dtype=torch.float64)
    kwargs = {} if slope is None else {"negative_slope": slope}
    inplace = slope is None
    fn = (lambda z: F.leaky_relu(z, slope)) if slope is not None else F.relu
    assert_same_second_order(
        lambda x, b: tfuse.add_act(x * 1.5, b, act=act, inplace=inplace, **kwargs).pow(2),
        lambda x, b: fn(x * 1.5 + b).pow(2),
        [x, bias], [0, 1], upstream, backend,
    )


def _bn_inputs(device, shape=(3, 4, 2, 3)):
    c = shape[1]
    x = torch.randn(shape, device=device, dtype=torch.float64)
    residual = torch.randn(shape, device=device, dtype=torch.float64)
    weight = torch.rand(c, device=device, dtype=torch.float64) + 0.5
    bias = torch.randn(c, device=device, dtype=torch.float64)
    running_mean = torch.randn(c, device=device, dtype=torch.float64)
    running_var = torch.rand(c, device=device, dtype=torch.float64) + 0.5
    return x, residual, weight, bias, running_mean, running_var


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("act", ACTS)
def test_batch_norm_act_second_order_matches_torch(act, training, backend, device):
    x, residual, weight, bias, running_mean, running_var = _bn_inputs(device)
    upstream = torch.randn_like(x)
    fn = torch_activation(act, SLOPE)

    def ours(x, r, w, b):
        return batch_norm_act(x, running_mean.clone(), running_var.clone(), w, b, training=training, act=act,
                              residual=r, **slope_kwargs(act))

    def theirs(x, r, w, b):
        return fn(F.batch_norm(x, running_mean.clone(), running_var.clone(), w, b, training=training) + r)

    # Penalties on the gradients of x and of the weight: every input's second-order gradient.
    assert_same_second_order(ours, theirs, [x, residual, weight, bias], [0, 2], upstream, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training, act", [(True, "relu"), (True, "silu"), (True, "gelu_tanh"), (False, "tanh")])
def test_batch_norm_act_gradgradcheck(training, act, backend, device):
    x, residual, weight, bias, running_mean, running_var = _bn_inputs(device, (2, 3, 2, 2))
    leaves = [t.requires_grad_() for t in (x, residual, weight, bias)]

    def fn(x, r, w, b):
        return batch_norm_act(x, running_mean.clone(), running_var.clone(), w, b, training=training, act=act, residual=r)

    with tfuse.use_backend(backend):
        assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_norm_act_without_affine_or_residual(backend, device):
    x, _, _, _, running_mean, running_var = _bn_inputs(device)
    upstream = torch.randn_like(x)
    assert_same_second_order(
        lambda x: batch_norm_act(x, running_mean.clone(), running_var.clone(), training=True, act="gelu"),
        lambda x: F.gelu(F.batch_norm(x, running_mean.clone(), running_var.clone(), training=True)),
        [x], [0], upstream, backend,
    )


def test_first_order_backward_still_runs_the_kernels(device):
    # create_graph=False keeps the fused backward kernels; only create_graph=True takes the torch ops.
    x = torch.randn(4, 6, device=device, requires_grad=True)
    bias = torch.randn(6, device=device, requires_grad=True)
    y = tfuse.add_act(x, bias, act="silu")
    with tfuse.count_launches() as plain:
        torch.autograd.grad(y.sum(), (x, bias), retain_graph=True)
    with tfuse.count_launches() as graphed:
        torch.autograd.grad(y.sum(), (x, bias), create_graph=True)
    assert plain.by_kernel["_add_act_bwd_kernel"] == 1
    assert graphed.total == 0
