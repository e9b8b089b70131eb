"""Copies of fused optimizers: copy.deepcopy, pickle and torch.save of the whole object behave like
torch.optim's (the copy holds copies of the parameters, steps on its own, and keeps pointing at the
model copy's parameters when both are copied together); state-dict checkpoints keep working."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import tfuse
from optim_helpers import assert_same_state, backward, make_pair, run_side_by_side, saved
from tfuse.flat import FlatParams, flat_params_of
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
    (FusedSGD, torch.optim.SGD, dict(lr=0.05)),  # no state at all
    (FusedMomentum, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.2)),
]


def pair_id(pair) -> str:
    return pair[0].__name__ + "-" + "-".join(f"{k}={v}" for k, v in pair[2].items())


def via_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def via_torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIERS = {"deepcopy": copy.deepcopy, "pickle": via_pickle, "torch_save": via_torch_save}


def snapshot(model, optimizer) -> tuple[list, dict]:
    params = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state.get(p, {}).items()}
             for i, p in enumerate(model.parameters())}
    return params, state


def assert_unchanged(model, optimizer, before) -> None:
    params, state = snapshot(model, optimizer)
    for mine, old in zip(params, before[0]):
        assert torch.equal(mine, old)
    assert state.keys() == before[1].keys()
    for index, entry in state.items():
        assert entry.keys() == before[1][index].keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(before[1][index][key])), (index, key)


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_a_copy_of_model_and_optimizer_continues_like_torchs_copy(pair, copier, device):
    """copy.deepcopy({"m": model, "o": optimizer}) (or a pickle/torch.save round trip of the pair):
    the copy's optimizer holds the copy's parameters, continues the trajectory exactly as a copy of
    torch's optimizer does, and neither the original nor the copy disturbs the other."""
    fused_cls, torch_cls, options = pair
    model, reference = make_pair(device)
    fused, torch_opt = fused_cls(model.parameters(), **options), torch_cls(reference.parameters(), **options, foreach=False)
    run_side_by_side(model, reference, fused, torch_opt, 3, device, torch.float32)

    copied = COPIERS[copier]({"m": model, "o": fused})
    torch_copied = copy.deepcopy({"m": reference, "o": torch_opt})
    model_copy, fused_copy = copied["m"], copied["o"]
    assert type(fused_copy) is fused_cls and fused_copy.defaults == fused.defaults
    ours = [p for g in fused_copy.param_groups for p in g["params"]]  # (FusedMuon's groups are in another order)
    assert {id(p) for p in ours} == {id(p) for p in model_copy.parameters()} and len(ours) == len(list(model.parameters()))
    assert not {id(p) for p in ours} & {id(p) for p in model.parameters()}
    assert_same_state(fused_copy, torch_copied["o"], torch.float32)
    assert all(flat_params_of(p) is not None and flat_params_of(p) is not flat_params_of(model.first.weight) for p in ours)

    before = snapshot(model, fused)
    run_side_by_side(model_copy, torch_copied["m"], fused_copy, torch_copied["o"], 4, device, torch.float32)
    assert_unchanged(model, fused, before)  # the copy's steps never touch the original
    before = snapshot(model_copy, fused_copy)
    run_side_by_side(model, reference, fused, torch_opt, 2, device, torch.float32)  # nor the other way round
    assert_unchanged(model_copy, fused_copy, before)


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("pair", PAIRS[:3], ids=pair_id)
def test_a_copy_of_the_optimizer_alone_holds_copies_of_the_parameters(pair, copier, device):
    """As with torch.optim: the copy's parameters are new tensors with the same values; stepping the
    copy changes them, not the model's."""
    fused_cls, torch_cls, options = pair
    model, reference = make_pair(device)
    fused, torch_opt = fused_cls(model.parameters(), **options), torch_cls(reference.parameters(), **options, foreach=False)
    run_side_by_side(model, reference, fused, torch_opt, 2, device, torch.float32)
    fused_copy, torch_copy = COPIERS[copier](fused), copy.deepcopy(torch_opt)
    mine = [p for g in fused_copy.param_groups for p in g["params"]]
    theirs = [p for g in torch_copy.param_groups for p in g["params"]]
    for copied, original in zip(mine, model.parameters()):
        assert copied is not original and torch.equal(copied.detach(), original.detach())
    before = snapshot(model, fused)
    for step in range(3):
        for a, b in zip(mine, theirs):
            grad = torch.randn_like(a)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused_copy.step()
        torch_copy.step()
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
        assert_same_state(fused_copy, torch_copy, torch.float32)
    assert_unchanged(model, fused, before)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_copy_with_master_weights_keeps_them(backend, device):
    model = make_pair(device)[0].to(torch.bfloat16)
    fused = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    with tfuse.use_backend(backend):
        for step in range(2):
            fused.zero_grad()
            backward(model, torch.randn(4, 5, device=device, dtype=torch.bfloat16), step)
            fused.step()
        copied = copy.deepcopy({"m": model, "o": fused})
        model_copy, fused_copy = copied["m"], copied["o"]
        assert fused_copy.master_weights
        for a, b in zip(model.parameters(), model_copy.parameters()):
            if a in fused.state:
                assert torch.equal(fused.state[a]["master_param"], fused_copy.state[b]["master_param"])
                assert fused_copy.state[b]["master_param"].dtype == torch.float32
        # The same gradients on both sides: the copy steps exactly like the original.
        for step in range(3):
            fused.zero_grad()
            fused_copy.zero_grad()
            x = torch.randn(4, 5, device=device, dtype=torch.bfloat16)
            backward(model, x, step)
            backward(model_copy, x, step)
            fused.step()
            fused_copy.step()
        for a, b in zip(model.parameters(), model_copy.parameters()):
            assert torch.equal(a, b)
            if a in fused.state:
                for key, value in fused.state[a].items():
                    assert torch.equal(value, fused_copy.state[b][key]), key


@pytest.mark.parametrize("order", [("m", "o"), ("o", "flat", "m"), ("flat", "m", "o"), ("o",)], ids="-".join)
def test_a_copy_of_parameters_in_a_users_flat_params_keeps_its_layout(order, device):
    """The optimizer reuses a FlatParams the user made; copied together in any order (or the optimizer
    alone), the copy's parameters live in one copy of it, with the same layout, and train like torch."""
    model, reference = make_pair(device)
    flat = FlatParams(model.parameters())
    fused, torch_opt = FusedAdam(model.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    run_side_by_side(model, reference, fused, torch_opt, 2, device, torch.float32)
    objects = {"m": model, "o": fused, "flat": flat}
    copied = copy.deepcopy({key: objects[key] for key in order})
    torch_copied = copy.deepcopy({"m": reference, "o": torch_opt})
    fused_copy = copied["o"]
    params = [p for g in fused_copy.param_groups for p in g["params"]]
    owner = flat_params_of(params[0])
    assert owner is not None and owner is not flat and all(flat_params_of(p) is owner for p in params)
    assert owner.layout_version != flat.layout_version  # holders of offsets re-map
    assert [o for g in owner.groups for o in g.offsets] == [o for g in flat.groups for o in g.offsets]
    if "flat" in copied:
        assert copied["flat"] is owner
    if "m" in copied:
        assert all(a is b for a, b in zip(copied["m"].parameters(), params))
    assert "1 flat buffer" in fused_copy.describe()
    model_copy = copied.get("m")
    if model_copy is None:  # the optimizer alone: its parameter copies, in the model's order
        model_copy = copy.deepcopy(model)
        for name, param in zip([n for n, _ in model.named_parameters()], params):
            module, attr = name.rsplit(".", 1) if "." in name else ("", name)
            setattr(model_copy.get_submodule(module), attr, param)
    run_side_by_side(model_copy, torch_copied["m"], fused_copy, torch_copied["o"], 3, device, torch.float32)


def test_state_dict_checkpoints_of_a_copy_load_into_torch(device):
    model, reference = make_pair(device)
    fused = FusedAdam(model.parameters(), lr=1e-2, amsgrad=True)
    for step in range(3):
        fused.zero_grad()
        backward(model, torch.randn(4, 5, device=device), step)
        fused.step()
    copied = via_pickle({"m": model, "o": fused})
    reference.load_state_dict(copied["m"].state_dict())
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, amsgrad=True)
    torch_opt.load_state_dict(saved(copied["o"].state_dict()))
    assert_same_state(copied["o"], torch_opt, torch.float32)
    run_side_by_side(copied["m"], reference, copied["o"], torch_opt, 3, device, torch.float32)
