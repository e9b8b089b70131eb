"""FusedAddAct, FusedBiasAct and FusedLinear against the torch layers they replace."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tfuse
from tfuse.nn import FusedAddAct, FusedBiasAct, FusedLinear

from helpers import ACTIVATION_NAMES, make_input

TORCH_ACT = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "leaky_relu": lambda: nn.LeakyReLU(0.01),
    "relu6": nn.ReLU6,
    "hardtanh": nn.Hardtanh,
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "mish": nn.Mish,
    "elu": nn.ELU,
    "identity": nn.Identity,
}


# ---------------------------------------------------------------- FusedAddAct


def test_fused_add_act_module(device):
    module = FusedAddAct("leaky_relu", negative_slope=0.1)
    x, skip = make_input((2, 8, 4, 4), torch.float32, device), make_input((2, 8, 4, 4), torch.float32, device)
    torch.testing.assert_close(module(x, skip), F.leaky_relu(x + skip, 0.1))
    assert "leaky_relu" in repr(module) and list(module.state_dict()) == []
    with pytest.raises(ValueError, match=r"unknown activation 'swish'"):
        FusedAddAct("swish")


# ---------------------------------------------------------------- FusedBiasAct


@pytest.mark.parametrize("act", ["relu", "silu"])
@pytest.mark.parametrize("shape, dim", [((6, 10), -1), ((2, 10, 3, 5), 1), ((4, 3, 10), 2), ((10,), 0)])
def test_fused_bias_act_matches_bias_then_act(act, shape, dim, device):
    layer = FusedBiasAct(10, act=act, dim=dim, device=device)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(10))
    x = make_input(shape, torch.float32, device).requires_grad_()
    view = [1] * len(shape)
    view[dim] = 10
    reference_bias = layer.bias.detach().clone().requires_grad_()
    expected = TORCH_ACT[act]()(x.detach() + reference_bias.view(view))
    y = layer(x)
    torch.testing.assert_close(y, expected)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(layer.bias.grad, reference_bias.grad)


def test_fused_bias_act_state_dict_and_from_bias(device):
    layer = FusedBiasAct(7, act="gelu", device=device)
    assert list(layer.state_dict()) == ["bias"] and (layer.bias == 0).all()
    trained = nn.Parameter(torch.randn(7, device=device))
    converted = FusedBiasAct.from_bias(trained, act="gelu")
    assert converted.bias is trained  # shared, not copied
    layer.load_state_dict(converted.state_dict())
    torch.testing.assert_close(layer.bias, trained)
    with pytest.raises(ValueError, match=r"bias must be a 1-D tensor"):
        FusedBiasAct.from_bias(torch.ones(2, 3))


def test_fused_bias_act_errors(device):
    layer = FusedBiasAct(4, dim=1, device=device)
    with pytest.raises(ValueError, match=r"expected 4 features along dim 1, got input of shape \[2, 5\]"):
        layer(torch.ones(2, 5, device=device))
    with pytest.raises(ValueError, match=r"dim=1 is out of range for an input with 1 dimensions"):
        layer(torch.ones(4, device=device))
    with pytest.raises(ValueError, match=r"num_features must be a positive int"):
        FusedBiasAct(0)


# ---------------------------------------------------------------- FusedLinear


ACTS = list(ACTIVATION_NAMES)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ACTS)
def test_fused_linear_matches_linear_then_act(act, bias, device):
    torch_layer = nn.Linear(24, 40, bias=bias, device=device)
    fused = FusedLinear(24, 40, bias=bias, act=act, device=device)
    fused.load_state_dict(torch_layer.state_dict())
    x = make_input((3, 5, 24), torch.float32, device)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    y = fused(x)
    expected = TORCH_ACT[act]()(torch_layer(x_ref))
    torch.testing.assert_close(y, expected)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(fused.weight.grad, torch_layer.weight.grad)
    if bias:
        torch.testing.assert_close(fused.bias.grad, torch_layer.bias.grad)


def test_fused_linear_state_dict_interchange(device):
    torch_layer = nn.Linear(8, 6, device=device)
    fused = FusedLinear(8, 6, act="gelu", device=device)
    assert list(fused.state_dict()) == list(torch_layer.state_dict()) == ["weight", "bias"]
    fused.load_state_dict(torch_layer.state_dict())  # nn.Linear -> FusedLinear
    other = nn.Linear(8, 6, device=device)
    other.load_state_dict(fused.state_dict())  # and back
    for name, value in torch_layer.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], value)
    assert isinstance(fused, nn.Linear)


def test_from_linear_shares_parameters(device):
    torch_layer = nn.Linear(8, 6, device=device).eval()
    fused = FusedLinear.from_linear(torch_layer, act="silu")
    assert fused.weight is torch_layer.weight and fused.bias is torch_layer.bias
    assert not fused.training and fused.act == "silu"
    x = make_input((4, 8), torch.float32, device)
    torch.testing.assert_close(fused(x), F.silu(torch_layer(x)))
    with pytest.raises(TypeError, match=r"expects an nn.Linear, got Conv1d"):
        FusedLinear.from_linear(nn.Conv1d(2, 2, 1))


def test_relu_epilogue_allocates_no_second_tensor(device):
    # The bias + relu epilogue overwrites the product: one tensor per layer.
    fused = FusedLinear(16, 32, act="relu", device=device)
    x = make_input((8, 16), torch.float32, device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fused(x)
    storages = {t.untyped_storage().data_ptr() for t in saved}
    # Saved: x and weight (for the matmul) and y (for relu); no pre-activation.
    assert storages == {x.untyped_storage().data_ptr(), fused.weight.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_autocast_matches_linear(act, device):
    torch_layer = nn.Linear(16, 24, device=device)
    fused = FusedLinear.from_linear(torch_layer, act=act)
    x = make_input((6, 16), torch.float32, device)
    autocast_dtype = torch.bfloat16
    with torch.autocast(device.type, dtype=autocast_dtype):
        y = fused(x)
        expected = TORCH_ACT[act]()(torch_layer(x))
    assert y.dtype == expected.dtype == autocast_dtype
    # nn.Linear adds the bias inside the GEMM before its one rounding; here
    # the bf16 product is rounded, then bias + activation rounded again. The
    # results differ by at most 3 bf16 roundings of |x W^T| + |b|, times the
    # activation's largest slope (1 for relu, 1.13 for gelu): a bound of the
    # method, not a tuned tolerance.
    magnitude = (x @ torch_layer.weight.detach().t()).abs() + torch_layer.bias.detach().abs()
    bound = 3 * 1.13 * (torch.finfo(autocast_dtype).eps / 2) * magnitude
    assert ((y.float() - expected.float()).abs() <= bound).all()


def test_small_mlp_trains_like_the_torch_mlp(device):
    reference = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    fused = nn.Sequential(
        FusedLinear.from_linear(copy.deepcopy(reference[0]), act="gelu"),
        FusedLinear.from_linear(copy.deepcopy(reference[2]), act="relu"),
        FusedLinear.from_linear(copy.deepcopy(reference[4]), act="identity"),
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, fused)]
    inputs = torch.randn(5, 16, 12, device=device)
    targets = torch.randint(0, 3, (5, 16), device=device)
    for step in range(5):
        losses = []
        for model, optimizer in zip((reference, fused), optimizers):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs[step]), targets[step])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    for (name, a), b in zip(reference.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, msg=f"parameter {name} drifted")


def test_fused_linear_launches(device):
    assert tfuse.select_backend(device, "add_act") is tfuse.Backend.TRITON  # interpreter on CPU, else CUDA
    fused = FusedLinear(16, 32, act="gelu", device=device)
    x = make_input((8, 16), torch.float32, device).requires_grad_()
    with tfuse.count_launches() as forward:
        y = fused(x)
    with tfuse.count_launches() as backward:
        y.sum().backward()
    assert forward.by_kernel == {"_add_act_fwd_kernel": 1}
    assert backward.by_kernel == {"_add_act_bwd_kernel": 1, "_sum_partials_kernel": 1}


def test_fused_linear_mixed_parameter_dtypes_are_an_error(device):
    layer = FusedLinear(4, 3, device=device)
    layer.bias.data = layer.bias.data.double()
    with pytest.raises(RuntimeError, match=r"bias has dtype torch.float64 but the product of input and weight has torch.float32"):
        layer(torch.ones(2, 4, device=device))
