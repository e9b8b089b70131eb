"""Fused optimizers against torch.optim: launches, layouts, groups, schedulers, state views (the trajectories of
every family and option set: tests/test_optim_trajectories.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tfuse
from optim_helpers import (
    assert_same_params, backward, groups_of, make_pair, run_side_by_side,
)
from tfuse.flat import FlatParams, flat_params_of
from tfuse.optim import FusedAdam, FusedAdamW, FusedMomentum, FusedSGD


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_one_launch_per_flat_buffer_per_step(backend, device):
    model, _ = make_pair(device)
    extra = nn.Linear(3, 4).to(device=device, dtype=torch.float64)  # a second dtype: a second buffer
    optimizer = FusedAdam([{"params": model.parameters()}, {"params": extra.parameters(), "lr": 0.1}])
    assert "2 flat buffers" in optimizer.describe()
    x = torch.randn(4, 5, device=device)
    for step in range(3):
        optimizer.zero_grad()
        backward(model, x, step)
        extra(torch.randn(2, 3, device=device, dtype=torch.float64)).sum().backward()
        with tfuse.use_backend(backend), tfuse.count_launches() as launches:
            optimizer.step()
        expected = 2 if backend == "triton" else 0
        assert launches.total == expected
        if backend == "triton":
            assert launches.by_kernel == {"_adam_kernel": 2}


def test_groups_given_to_the_constructor_share_one_buffer(device):
    model, _ = make_pair(device)
    optimizer = FusedAdamW(groups_of(model, dict(lr=1e-2, weight_decay=0.1), two_groups=True), lr=1e-2)
    assert "1 flat buffer" in optimizer.describe()
    backward(model, torch.randn(2, 5, device=device), 0)
    with tfuse.use_backend("triton"), tfuse.count_launches() as launches:
        optimizer.step()
    assert launches.total == 1


def test_parameters_already_in_a_flat_buffer_are_not_copied_again(device):
    model, reference = make_pair(device)
    flat = FlatParams(model.parameters(), bucket_mb=1)
    data_ptrs = [p.data_ptr() for p in model.parameters()]
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    assert [p.data_ptr() for p in model.parameters()] == data_ptrs
    assert all(flat_params_of(p) is flat for p in model.parameters())
    run_side_by_side(model, reference, optimizer, torch.optim.Adam(reference.parameters(), lr=1e-2), 4, device, torch.float32)


def test_flat_buffer_shared_with_parameters_the_optimizer_does_not_own(device):
    """A FlatParams holding more than the optimizer's parameters: the others are never touched."""
    model, reference = make_pair(device)
    FlatParams(model.parameters())
    mine = [model.first.weight, model.aux.bias]  # not adjacent in the buffer: runs must not merge across others
    optimizer = FusedAdam(mine, lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.Adam([reference.first.weight, reference.aux.bias], lr=1e-2, weight_decay=0.1)
    run_side_by_side(model, reference, optimizer, torch_opt, 6, device, torch.float32)
    assert_same_params(model, reference, torch.float32)  # untouched ones stayed equal too


def test_frozen_then_unfrozen_layer_follows_torch(device):
    model, reference = make_pair(device)
    for net in (model, reference):
        net.second.weight.requires_grad_(False)
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=0.1)
    run_side_by_side(model, reference, optimizer, torch_opt, 3, device, torch.float32)
    assert model.second.weight not in optimizer.state
    version = flat_params_of(model.first.weight).layout_version
    for net in (model, reference):
        net.second.weight.requires_grad_(True)
    run_side_by_side(model, reference, optimizer, torch_opt, 4, device, torch.float32)
    assert flat_params_of(model.first.weight).layout_version > version  # laid out again, state moved along
    assert float(optimizer.state[model.second.weight]["step"]) == 4


def test_parameters_without_gradient_are_not_updated_or_decayed(device):
    model, _ = make_pair(device)
    optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    before = model.aux.weight.detach().clone()
    model(torch.randn(3, 5, device=device), use_aux=False).sum().backward()
    optimizer.step()
    assert model.aux.weight.grad is None
    torch.testing.assert_close(model.aux.weight, before, rtol=0, atol=0)
    assert model.aux.weight not in optimizer.state
    assert "momentum_buffer" in optimizer.state[model.first.weight]


def test_add_param_group_gives_a_second_buffer_and_follows_torch(device):
    model, reference = make_pair(device)
    head, reference_head = nn.Linear(3, 3).to(device), nn.Linear(3, 3).to(device)
    reference_head.load_state_dict(head.state_dict())
    optimizer = FusedMomentum([model.first.weight, model.first.bias], lr=0.05)
    torch_opt = torch.optim.SGD([reference.first.weight, reference.first.bias], lr=0.05, momentum=0.9)
    for opt, net, extra in ((optimizer, model, head), (torch_opt, reference, reference_head)):
        rest = [p for p in net.parameters() if p is not net.first.weight and p is not net.first.bias]
        opt.add_param_group({"params": rest + list(extra.parameters()), "lr": 0.02, "nesterov": True})
    assert len(optimizer.param_groups) == 2
    run_side_by_side(model, reference, optimizer, torch_opt, 4, device, torch.float32)
    with tfuse.count_launches() as launches:
        optimizer.step()
    assert launches.total == (2 if device.type == "cuda" or tfuse._backend.interpreter_active() else 0)


def test_zero_grad_keeps_gradients_flowing_into_the_flat_buffer(device):
    model, _ = make_pair(device)
    optimizer = FusedSGD(model.parameters(), lr=0.1)
    (buffer,) = flat_params_of(model.first.weight).grad_buffers
    for set_to_none in (True, False, True):
        optimizer.zero_grad(set_to_none=set_to_none)
        assert (model.first.weight.grad is None) == set_to_none
        backward(model, torch.randn(2, 5, device=device), 0)
        grad = model.first.weight.grad
        assert buffer.data_ptr() <= grad.data_ptr() < buffer.data_ptr() + buffer.numel() * buffer.element_size()


def test_lr_as_a_zero_dim_tensor(device):
    model, reference = make_pair(device)
    fused = FusedAdam(model.parameters(), lr=torch.tensor(1e-2))
    torch_opt = torch.optim.Adam(reference.parameters(), lr=torch.tensor(1e-2))
    run_side_by_side(model, reference, fused, torch_opt, 3, device, torch.float32)


@pytest.mark.parametrize("scheduler", ["step", "onecycle", "cosine"])
def test_lr_schedulers_drive_the_fused_step(scheduler, device):
    model, reference = make_pair(device)
    fused = FusedAdam(model.parameters(), lr=1e-2)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)

    def make(opt):
        if scheduler == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        if scheduler == "onecycle":  # cycles betas[0] too
            return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)

    schedulers = [make(fused), make(torch_opt)]
    for _ in range(5):
        run_side_by_side(model, reference, fused, torch_opt, 1, device, torch.float32)
        for s in schedulers:
            s.step()
        assert fused.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"]
        assert fused.param_groups[0]["betas"] == torch_opt.param_groups[0]["betas"]


def test_state_entries_are_views_of_the_flat_state(device):
    model, _ = make_pair(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2, amsgrad=True)
    backward(model, torch.randn(2, 5, device=device), 0)
    optimizer.step()
    state = optimizer.state[model.first.weight]
    assert state["exp_avg"].shape == model.first.weight.shape
    assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu"  # torch's format
    assert state["exp_avg"].abs().sum() > 0 and state["max_exp_avg_sq"].abs().sum() > 0
    (flat_params,) = optimizer.flat_params
    flat = optimizer.spans[0].state.buffers["exp_avg"]  # the FlatState of its one flat buffer
    assert flat.numel() == flat_params.groups[0].data.numel()
    assert flat.data_ptr() <= state["exp_avg"].data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()


def test_clip_grad_norm_accepts_the_optimizer(device):
    from tfuse.optim import clip_grad_norm_

    model, reference = make_pair(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 5, device=device)
    backward(model, x, 0)
    backward(reference, x, 0)
    total = clip_grad_norm_(optimizer, max_norm=0.1)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for mine, other in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-5, atol=1e-7)


def test_float64_trajectory_against_a_float64_reference_is_tight(device):
    """A stronger check of the semantics: float64 throughout, differences at rounding level only."""
    model, reference = make_pair(device, torch.float64)
    fused = FusedAdamW(model.parameters(), lr=3e-2, weight_decay=0.3, amsgrad=True)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=3e-2, weight_decay=0.3, amsgrad=True)
    run_side_by_side(model, reference, fused, torch_opt, 12, device, torch.float64)
