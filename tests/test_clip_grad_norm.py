"""tfuse.optim.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import tfuse
from tfuse.flat import FlatParams
from tfuse.optim import clip_grad_norm_


def model_pair(device, dtype=torch.float32):
    model = nn.Sequential(nn.Linear(70, 33), nn.Tanh(), nn.Linear(33, 5)).to(device=device, dtype=dtype)
    return model, copy.deepcopy(model)


def backward_both(model, reference, device, dtype=torch.float32):
    x = torch.randn(8, 70, device=device, dtype=dtype)
    for m in (model, reference):
        m(x).pow(2).sum().backward()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, "inf", 3.0, 0.5])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_matches_torch(norm_type, max_norm, backend, device):
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device)
    with tfuse.use_backend(backend), tfuse.count_launches() as launches:
        total = clip_grad_norm_(flat, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, float(norm_type))
    # The kernels sum ~2.5k float32 terms (torch's CPU reduction is more
    # exact), about 1e-6 relative; the 1/p power multiplies that by 1/p (2
    # for p = 0.5), and general p goes through exp(p log|g|). Hence 1e-5.
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    assert launches.total == (3 if backend == "triton" else 0)  # partial norms, final norm, scaling


def test_only_parameters_with_gradients_count(device):
    # optimizer.zero_grad() leaves stale values in the flat buffer; a parameter
    # the next backward does not reach keeps grad None and must not count.
    used, unused = nn.Linear(9, 9).to(device), nn.Linear(9, 9).to(device)
    reference = copy.deepcopy(used)
    flat = FlatParams(list(used.parameters()) + list(unused.parameters()))
    optimizer = torch.optim.SGD(flat.params, lr=0.1)
    (used(torch.randn(3, 9, device=device)).sum() + unused(torch.randn(3, 9, device=device)).sum()).backward()
    optimizer.zero_grad()
    x = torch.randn(3, 9, device=device)
    used(x).sum().backward()
    reference(x).sum().backward()
    total = clip_grad_norm_(flat, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    torch.testing.assert_close(total, expected)
    assert all(p.grad is None for p in unused.parameters())


def test_flat_and_plain_gradients_together(device):
    model, reference = model_pair(device)
    FlatParams(model[0].parameters())  # the last layer stays un-coalesced
    backward_both(model, reference, device)
    total = clip_grad_norm_(model.parameters(), 0.3)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
    torch.testing.assert_close(total, expected)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_several_buffers_one_total(device):
    half = nn.Linear(6, 6).to(device=device, dtype=torch.float64)
    single = nn.Linear(6, 6).to(device)
    references = [copy.deepcopy(half), copy.deepcopy(single)]
    flat = FlatParams(list(half.parameters()) + list(single.parameters()))
    x = torch.randn(2, 6, device=device)
    for a, b in ((half, single), references):
        (a(x.double()).sum() + b(x).sum()).backward()
    total = clip_grad_norm_(flat, 0.2)
    expected = torch.nn.utils.clip_grad_norm_([p for m in references for p in m.parameters()], 0.2)
    assert total.dtype == expected.dtype == torch.float64  # promoted across the gradients' dtypes, as torch
    torch.testing.assert_close(total, expected)
    for mine, theirs in zip(flat.params, [p for m in references for p in m.parameters()]):
        torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_return_dtype_follows_the_gradients(dtype, device):
    model, reference = model_pair(device, dtype)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device, dtype)
    total = clip_grad_norm_(flat, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    assert total.dtype == expected.dtype == dtype
    torch.testing.assert_close(total, expected)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_non_finite_gradients(norm_type, device):
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device)
    for m in (model, reference):
        m[0].weight.grad[0, 0] = float("nan")
    total = clip_grad_norm_(flat, 1.0, norm_type)
    assert torch.isnan(total)
    with pytest.raises(RuntimeError) as torch_error:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as ours:
        clip_grad_norm_(flat, 1.0, norm_type, error_if_nonfinite=True)
    assert str(ours.value) == str(torch_error.value)


def test_no_gradients_and_single_tensor(device):
    layer = nn.Linear(3, 3).to(device)
    FlatParams(layer.parameters())
    assert clip_grad_norm_(layer.parameters(), 1.0).item() == 0.0
    tensor = torch.randn(5, device=device, requires_grad=True)
    tensor.grad = torch.full((5,), 2.0, device=device)
    total = clip_grad_norm_(tensor, 1.0)
    torch.testing.assert_close(total, torch.tensor(math.sqrt(20.0), device=device))


def test_errors(device):
    layer = nn.Linear(3, 3).to(device)
    with pytest.raises(ValueError, match=r"norm_type must be a positive number or 'inf', got 0"):
        clip_grad_norm_(layer.parameters(), 1.0, 0)
    with pytest.raises(ValueError, match=r"got 'fro'"):
        clip_grad_norm_(layer.parameters(), 1.0, "fro")
    with pytest.raises(TypeError, match=r"max_norm must be a number, got str"):
        clip_grad_norm_(layer.parameters(), "1")
