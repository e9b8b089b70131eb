"""Fused optimizers: state_dict both ways, AMP GradScaler, master weights, low precision, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tfuse
from optim_helpers import (assert_same_params, assert_same_state, backward, make_pair, muon_param_slacks, run_side_by_side,
                          saved)
from optim_references import ReferenceLAMB, ReferenceLARS, ReferenceLion, ReferenceMuon
from tfuse.optim import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedLARS, FusedLion, FusedMomentum, FusedMuon,
                         FusedSGD)

PAIRS = [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (FusedAdagrad, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.1, initial_accumulator_value=0.2, weight_decay=0.1)),
    (FusedLion, ReferenceLion, dict(lr=1e-2, weight_decay=0.3)),
    (FusedLAMB, ReferenceLAMB, dict(lr=1e-2, weight_decay=0.1, trust_clip=True)),
    (FusedLARS, ReferenceLARS, dict(lr=0.5, weight_decay=0.01, nesterov=True)),
    (FusedMuon, ReferenceMuon, dict(lr=0.02, adamw_lr=1e-2)),
]


def train_alone(model, optimizer, steps, device) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        backward(model, torch.randn(6, 5, device=device), step)
        optimizer.step()


@pytest.mark.parametrize("direction", ["torch_to_fused", "fused_to_torch"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0].__name__)
def test_state_dict_moves_both_ways_and_training_continues_on_the_same_trajectory(pair, direction, device):
    fused_cls, torch_cls, options = pair
    model, reference = make_pair(device)
    fused = fused_cls(model.parameters(), **options)
    torch_opt = torch_cls(reference.parameters(), **options)
    if direction == "torch_to_fused":
        train_alone(reference, torch_opt, 5, device)
        model.load_state_dict(reference.state_dict())
        fused.load_state_dict(saved(torch_opt.state_dict()))
    else:
        train_alone(model, fused, 5, device)
        reference.load_state_dict(model.state_dict())
        torch_opt.load_state_dict(saved(fused.state_dict()))
    assert_same_state(fused, torch_opt, torch.float32)
    ours, theirs = fused.state_dict(), torch_opt.state_dict()
    assert {k: sorted(v) for k, v in ours["state"].items()} == {k: sorted(v) for k, v in theirs["state"].items()}
    run_side_by_side(model, reference, fused, torch_opt, 5, device, torch.float32)


def test_loaded_hyperparameters_replace_the_constructor_ones(device):
    model, reference = make_pair(device)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=0.123, betas=(0.8, 0.95))
    fused = FusedAdam(model.parameters(), lr=1e-3)
    fused.load_state_dict(saved(torch_opt.state_dict()))
    assert fused.param_groups[0]["lr"] == 0.123 and fused.param_groups[0]["betas"] == (0.8, 0.95)


def test_state_dict_mismatches_raise_clear_errors(device):
    model, reference = make_pair(device)
    fused = FusedAdam(model.parameters(), lr=1e-2)
    two_groups = torch.optim.Adam([{"params": [reference.first.weight]}, {"params": [reference.first.bias]}])
    with pytest.raises(ValueError, match="different number of parameter groups"):
        fused.load_state_dict(two_groups.state_dict())
    smaller = torch.optim.Adam(list(reference.parameters())[:-1])
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        fused.load_state_dict(smaller.state_dict())
    torch_opt = torch.optim.Adam(reference.parameters())
    train_alone(reference, torch_opt, 1, device)
    state = saved(torch_opt.state_dict())
    assert list(reference.parameters())[1] is reference.first.weight
    state["state"][1]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'exp_avg' of shape \(3, 3\) for a parameter of shape \(7, 5\)"):
        fused.load_state_dict(state)
    train_alone(model, fused, 1, device)  # nothing was half-loaded: the optimizer still works


@pytest.mark.parametrize("source_cls, source_options, target_cls, target_options, problem", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9), FusedAdam, dict(lr=1e-2), "has 'momentum_buffer'"),
    (torch.optim.Adam, dict(lr=1e-2), FusedMomentum, dict(lr=0.1, momentum=0.9), "has 'exp_avg'"),
    (torch.optim.Adam, dict(lr=1e-2), FusedAdam, dict(lr=1e-2, amsgrad=True), "lacks 'max_exp_avg_sq'"),
], ids=["sgd_into_adam", "adam_into_momentum", "adam_into_amsgrad"])
def test_another_optimizers_state_is_refused_at_load_and_nothing_changes(
    source_cls, source_options, target_cls, target_options, problem, device
):
    """torch fails at load for another family's state; so must tfuse (not later in step with a bare KeyError)."""
    model, reference = make_pair(device)
    source = source_cls(reference.parameters(), **source_options)
    train_alone(reference, source, 1, device)
    target = target_cls(model.parameters(), **target_options)
    train_alone(model, target, 1, device)
    before = saved(target.state_dict())
    # (amsgrad is a group option: the saved group says False, so the target's must be forced to expect it)
    state = saved(source.state_dict())
    if target_options.get("amsgrad"):
        for group in state["param_groups"]:
            group["amsgrad"] = True
    with pytest.raises(ValueError, match=problem):
        target.load_state_dict(state)
    after = target.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()
    for key, entry in before["state"].items():
        assert entry.keys() == after["state"][key].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][key][k])) for k, v in entry.items())
    train_alone(model, target, 1, device)  # still steps


def test_state_cleared_by_hand_is_recreated_like_torch(device):
    model, reference = make_pair(device)
    fused, torch_opt = FusedAdam(model.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    run_side_by_side(model, reference, fused, torch_opt, 2, device, torch.float32)
    fused.state.clear()
    torch_opt.state.clear()
    run_side_by_side(model, reference, fused, torch_opt, 3, device, torch.float32)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["in_kernel_unscale", "unscale_then_clip"])
@pytest.mark.parametrize("fused_cls,torch_cls,options", [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2)), (FusedMomentum, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (FusedAdagrad, torch.optim.Adagrad, dict(lr=0.05, weight_decay=0.1)),
    (FusedLion, ReferenceLion, dict(lr=1e-3, weight_decay=0.1)),
    (FusedLAMB, ReferenceLAMB, dict(lr=1e-2, weight_decay=0.1)),
    (FusedLARS, ReferenceLARS, dict(lr=0.5, weight_decay=0.01)),
    (FusedMuon, ReferenceMuon, dict(lr=0.02, adamw_lr=1e-2)),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_grad_scaler_skips_inf_steps_and_unscales_like_torch(fused_cls, torch_cls, options, unscale_first, device):
    model, reference = make_pair(device)
    fused, torch_opt = fused_cls(model.parameters(), **options), torch_cls(reference.parameters(), **options)
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for step in range(8):
        x = torch.randn(6, 5, device=device)
        for net, opt, scaler in ((model, fused, scalers[0]), (reference, torch_opt, scalers[1])):
            opt.zero_grad()
            scaler.scale(net(x, use_aux=True).pow(2).mean()).backward()
        for mine, other in zip(model.parameters(), reference.parameters()):
            mine.grad.copy_(other.grad)
        if step in (2, 5):  # an overflow: both must skip the step and halve the scale
            for net in (model, reference):
                net.second.weight.grad[0, 0] = float("inf")
        for net, opt, scaler in ((model, fused, scalers[0]), (reference, torch_opt, scalers[1])):
            if unscale_first:
                scaler.unscale_(opt)
                tfuse.optim.clip_grad_norm_(opt, max_norm=1e9) if opt is fused else torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)
            scaler.step(opt)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert_same_params(model, reference, torch.float32, muon_param_slacks(model, fused, step + 1))
        assert_same_state(fused, torch_opt, torch.float32)
        if step not in (2, 5):  # gradients are left unscaled, as torch's unscale_ leaves them
            for mine, other in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(mine.grad, other.grad, rtol=1e-6, atol=0)
    if fused_cls in (FusedAdam, FusedAdagrad, FusedLAMB):
        assert float(fused.state[model.first.weight]["step"]) == 6  # two skipped


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("fused_cls,torch_cls,options", [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (FusedAdagrad, torch.optim.Adagrad, dict(lr=0.05, weight_decay=0.1, initial_accumulator_value=0.1)),
    (FusedLion, ReferenceLion, dict(lr=1e-3, weight_decay=0.1)),
    (FusedLAMB, ReferenceLAMB, dict(lr=1e-2, weight_decay=0.1)),
    (FusedLARS, ReferenceLARS, dict(lr=0.5, weight_decay=0.01)),
    (FusedMuon, ReferenceMuon, dict(lr=0.02, adamw_lr=1e-2)),
], ids=["adamw", "sgd", "adagrad", "lion", "lamb", "lars", "muon"])
def test_master_weights_follow_a_float32_run_and_round_the_parameters(fused_cls, torch_cls, options, dtype, backend, device):
    model = make_pair(device)[0].to(dtype)
    reference = make_pair(device)[1].to(torch.float32)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    fused = fused_cls(model.parameters(), master_weights=True, **options)
    torch_opt = torch_cls(reference.parameters(), **options)
    with tfuse.use_backend(backend):
        for step in range(6):
            fused.zero_grad()
            torch_opt.zero_grad()
            backward(model, torch.randn(6, 5, device=device, dtype=dtype), step)
            for mine, other in zip(model.parameters(), reference.parameters()):
                other.grad = None if mine.grad is None else mine.grad.float()
            fused.step()
            torch_opt.step()
    slacks = muon_param_slacks(model, fused, 6)
    for (name, mine), other in zip(model.named_parameters(), reference.parameters()):
        if mine not in fused.state:
            continue
        master = fused.state[mine]["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, other.detach(), rtol=2e-6, atol=2e-7 + slacks.get(name, 0.0))
        torch.testing.assert_close(mine.detach(), master.to(dtype), rtol=0, atol=0)  # rounded to nearest even
    assert all(v.dtype == torch.float32 for s in fused.state.values() for k, v in s.items() if k != "step")


def test_master_weights_take_values_the_user_writes_into_the_parameters(device):
    model = make_pair(device)[0].to(torch.bfloat16)
    optimizer = FusedSGD(model.parameters(), lr=0.0, master_weights=True)
    backward(model, torch.randn(2, 5, device=device, dtype=torch.bfloat16), 0)
    optimizer.step()
    new_values = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    model.load_state_dict(new_values)  # e.g. restoring a checkpoint of the model only
    backward(model, torch.randn(2, 5, device=device, dtype=torch.bfloat16), 0)
    optimizer.step()  # lr 0: the parameters must stay what the user loaded, not the stale masters
    for name, param in model.named_parameters():
        assert (param == 0.25).all(), name
        if param in optimizer.state:
            assert (optimizer.state[param]["master_param"] == 0.25).all(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_without_master_weights_matches_torch_fused(dtype, device):
    """State in the parameter dtype, math in float32, as torch's fused Adam; one bf16/f16 ulp apart at most."""
    model, reference = (m.to(dtype) for m in make_pair(device))
    fused = FusedAdam(model.parameters(), lr=1e-2)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, fused=True)
    for step in range(5):
        x = torch.randn(6, 5, device=device, dtype=dtype)
        for net, opt in ((model, fused), (reference, torch_opt)):
            opt.zero_grad()
            backward(net, x, step)
        for mine, other in zip(model.parameters(), reference.parameters()):
            if mine.grad is not None:
                mine.grad.copy_(other.grad)
        fused.step()
        torch_opt.step()
    ulp = torch.finfo(dtype).eps
    for mine, other in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, other, rtol=2 * ulp, atol=1e-4)
        assert fused.state[mine]["exp_avg"].dtype == dtype


def torch_error(factory) -> str:
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        factory()
    return str(info.value)


@pytest.mark.parametrize("fused_cls,torch_cls,options", [
    (FusedAdam, torch.optim.Adam, dict(lr=-1.0)),
    (FusedAdam, torch.optim.Adam, dict(lr=torch.tensor([1e-3, 1e-3]))),
    (FusedAdam, torch.optim.Adam, dict(betas=(1.0, 0.9))),
    (FusedAdam, torch.optim.Adam, dict(betas=(0.9, -0.1))),
    (FusedAdam, torch.optim.Adam, dict(eps=-1e-8)),
    (FusedAdamW, torch.optim.AdamW, dict(weight_decay=-0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=-0.5)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, weight_decay=-1.0)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, nesterov=True)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)),
], ids=str)
def test_bad_hyperparameters_raise_with_torchs_wording(fused_cls, torch_cls, options):
    layer = nn.Linear(2, 2)
    expected = torch_error(lambda: torch_cls(layer.parameters(), **options))
    with pytest.raises(ValueError) as info:
        fused_cls(layer.parameters(), **options)
    assert str(info.value) == expected


def test_bad_values_in_an_added_group_are_refused(device):
    optimizer = FusedAdam(nn.Linear(2, 2).to(device).parameters())
    with pytest.raises(ValueError, match="Invalid learning rate: -0.5"):
        optimizer.add_param_group({"params": nn.Linear(2, 2).to(device).parameters(), "lr": -0.5})
    assert len(optimizer.param_groups) == 1


def test_bad_parameter_lists_raise_with_torchs_wording(device):
    layer = nn.Linear(2, 2).to(device)
    for bad in ([], lambda: [layer.weight, layer.weight][:0]):
        params = bad() if callable(bad) else bad
        expected = torch_error(lambda: torch.optim.Adam(params))
        with pytest.raises(ValueError, match=expected):
            FusedAdam(params)
    expected = torch_error(lambda: torch.optim.SGD([{"params": [layer.weight]}, {"params": [layer.weight]}], lr=0.1))
    with pytest.raises(ValueError, match=expected):
        FusedSGD([{"params": [layer.weight]}, {"params": [layer.weight]}], lr=0.1)
    with pytest.raises(ValueError, match="duplicate parameters"):
        FusedSGD([layer.weight, layer.weight], lr=0.1)
    non_leaf = layer.weight * 2
    expected = torch_error(lambda: torch.optim.Adam([non_leaf]))
    with pytest.raises(ValueError, match=expected):
        FusedAdam([non_leaf])
    with pytest.raises(ValueError, match="requires all the params to be floating point Tensors"):
        FusedAdam([nn.Parameter(torch.zeros(3, dtype=torch.complex64, device=device))])
    with pytest.raises(ValueError, match="requires all the params to be floating point Tensors"):
        FusedAdam([torch.zeros(3, dtype=torch.int64, device=device)])
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors"):
        FusedAdam([layer.weight, 3.0])


def test_sparse_gradients_are_refused(device):
    embedding = nn.Embedding(10, 3, sparse=True).to(device)
    optimizer = FusedAdam(embedding.parameters())
    with pytest.raises(RuntimeError, match="sparse gradient"):
        embedding(torch.tensor([1, 2], device=device)).sum().backward()
    embedding.weight.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 3), (10, 3)).to(device)  # set by hand
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()


class ConvNet(nn.Module):
    """A channels_last convolution (its slot keeps the memory format) next to plain parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).mean(dim=(2, 3)))


def conv_step(net, optimizer, x) -> None:
    optimizer.zero_grad()
    net(x).pow(2).mean().backward()
    optimizer.step()


def conv_steps_alike(model, fused, reference, torch_opt, x) -> None:
    """One step of both sides on the fused side's gradients (each side's own could differ: Muon's bfloat16
    iterations leave the matrices a few ulps apart, which then moves the other parameters' gradients)."""
    for optimizer in (fused, torch_opt):
        optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        theirs.grad = mine.grad.detach().clone()  # (clone keeps the channels_last strides)
    fused.step()
    torch_opt.step()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0].__name__)
def test_channels_last_parameters_get_state_in_their_layout_and_state_dicts_move_both_ways(pair, backend, device):
    """optimizer.state[p] pairs element by element with a channels_last p (same strides), so state
    dicts to and from torch.optim mean the same thing and training continues on torch's trajectory."""
    fused_cls, torch_cls, options = pair
    model = ConvNet().to(device).to(memory_format=torch.channels_last)
    reference = ConvNet().to(device).to(memory_format=torch.channels_last)
    reference.load_state_dict(model.state_dict())
    fused, torch_opt = fused_cls(model.parameters(), **options), torch_cls(reference.parameters(), **options, foreach=False)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    with tfuse.use_backend(backend):
        for _ in range(3):
            x = torch.randn(2, 3, 6, 6, device=device).to(memory_format=torch.channels_last)
            conv_steps_alike(model, fused, reference, torch_opt, x)
        assert_same_params(model, reference, torch.float32, muon_param_slacks(model, fused, 3))
        assert_same_state(fused, torch_opt, torch.float32)
        for param in model.parameters():
            for value in fused.state[param].values():
                if value.dim():
                    assert value.stride() == param.stride()
        # Both ways through checkpoint files, then on together.
        fresh = fused_cls(model.parameters(), **options)
        fresh.load_state_dict(saved(torch_opt.state_dict()))
        torch_again = torch_cls(reference.parameters(), **options, foreach=False)
        torch_again.load_state_dict(saved(fresh.state_dict()))
        assert_same_state(fresh, torch_again, torch.float32)
        for _ in range(2):
            x = torch.randn(2, 3, 6, 6, device=device).to(memory_format=torch.channels_last)
            conv_steps_alike(model, fresh, reference, torch_again, x)
        assert_same_params(model, reference, torch.float32, muon_param_slacks(model, fused, 5))
        assert_same_state(fresh, torch_again, torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_channels_last_master_weights_are_the_parameters_values(backend, device):
    model = ConvNet().to(device=device, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    optimizer = FusedAdamW(model.parameters(), lr=1e-2, master_weights=True)
    with tfuse.use_backend(backend):
        for _ in range(2):
            conv_step(model, optimizer, torch.randn(2, 3, 6, 6, device=device, dtype=torch.bfloat16))
    for param in model.parameters():
        master = optimizer.state[param]["master_param"]
        assert master.stride() == param.stride()
        torch.testing.assert_close(master.to(torch.bfloat16), param.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [FusedAdam, FusedMomentum])
def test_a_deleted_optimizer_frees_its_state_at_once(cls):
    """No reference cycle through the span engines: ``del optimizer`` frees its state without waiting for
    the garbage collector (large state on a GPU is freed when the user deletes the optimizer)."""
    import gc
    import weakref

    layer = torch.nn.Linear(3, 2)
    optimizer = cls(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    gone = weakref.ref(optimizer)
    state = weakref.ref(optimizer.spans[0].state.ensure(optimizer.state_names[0]))
    gc.disable()
    try:
        del optimizer
        assert gone() is None and state() is None
    finally:
        gc.enable()
