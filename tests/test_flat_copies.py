"""Copies and serialisation of coalesced models: they behave as the same operations on plain torch objects.

* ``copy.deepcopy`` gives an independent model (plain parameters, or parameters coalesced in a
  copied FlatParams when the FlatParams is copied in the same call); training the copy leaves
  the original untouched.
* ``state_dict()`` tensors serialise only their own elements (file sizes measured), still alias
  the parameters, and load back with ``weights_only=True``.
* A FlatParams pickles and deep-copies; a shallow copy is refused.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from tfuse.flat import FlatParams, flat_params_of, register_compact_state_dict
from tfuse.optim import FusedAdam

TIGHT = dict(rtol=1e-10, atol=1e-12)


def small_model(device) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4), nn.Tanh(), nn.Linear(4, 3)).to(device, torch.float64)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def in_buffers(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    for buffer in buffers:
        start = buffer.data_ptr()
        if start <= tensor.data_ptr() < start + buffer.numel() * buffer.element_size():
            return True
    return False


def saved_bytes(obj) -> bytes:
    stream = io.BytesIO()
    torch.save(obj, stream)
    return stream.getvalue()


def loaded(data: bytes, weights_only: bool = True):
    return torch.load(io.BytesIO(data), weights_only=weights_only)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list]:
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
             for p in model.parameters()]
    return params, state


def assert_unchanged(model: nn.Module, optimizer: torch.optim.Optimizer, before: tuple[list, list]) -> None:
    params, state = before
    for param, value, entry in zip(model.parameters(), params, state):
        torch.testing.assert_close(param.detach(), value, rtol=0, atol=0)
        for key, saved in entry.items():
            torch.testing.assert_close(torch.as_tensor(optimizer.state[param][key]), torch.as_tensor(saved), rtol=0, atol=0)


# --------------------------------------------------------------------------- deepcopy


def test_deepcopy_of_a_coalesced_model_is_an_independent_plain_model(device):
    model = small_model(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    for _ in range(2):
        step(model, optimizer, torch.randn(5, 6, device=device, dtype=torch.float64))
    before = snapshot(model, optimizer)
    clone = copy.deepcopy(model)
    buffers = flat_params_of(model[0].weight).param_buffers
    for mine, theirs in zip(clone.parameters(), model.parameters()):
        assert flat_params_of(mine) is None  # plain parameters, as torch's Parameter.__deepcopy__ makes them
        assert not in_buffers(mine, buffers)
        assert mine.grad is None
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # The copy trains on its own (a torch optimizer, then a fused one of its own): the original does not move.
    plain = torch.optim.SGD(clone.parameters(), lr=0.1, momentum=0.9)
    fused = FusedAdam(clone.parameters(), lr=1e-2)
    for opt in (plain, fused, plain):
        step(clone, opt, torch.randn(5, 6, device=device, dtype=torch.float64))
    assert flat_params_of(clone[0].weight) is not flat_params_of(model[0].weight)
    assert not torch.equal(clone[0].weight, model[0].weight)
    assert_unchanged(model, optimizer, before)
    assert all(p.grad is None or in_buffers(p.grad, flat_params_of(p).grad_buffers) for p in model.parameters())


def test_deepcopy_of_a_model_with_its_flatparams_gives_a_coalesced_copy(device):
    model = small_model(device)
    flat = FlatParams(model)
    model(torch.randn(3, 6, device=device, dtype=torch.float64)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    clone, clone_flat = copy.deepcopy((model, flat))
    assert isinstance(clone_flat, FlatParams) and clone_flat is not flat
    assert clone_flat.layout_version != flat.layout_version  # copied holders of offsets re-map
    assert [g.offsets for g in clone_flat.groups] == [g.offsets for g in flat.groups]
    for mine, theirs in zip(clone.parameters(), model.parameters()):
        assert flat_params_of(mine) is clone_flat
        assert in_buffers(mine, clone_flat.param_buffers) and not in_buffers(mine, flat.param_buffers)
        assert mine.grad is None  # deep-copied parameters have no gradient, as in torch
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert clone_flat.name_of(clone[0].weight) == "0.weight"
    clone(torch.randn(3, 6, device=device, dtype=torch.float64)).pow(2).sum().backward()
    for mine, theirs, grad in zip(clone.parameters(), model.parameters(), grads):
        assert mine.grad.data_ptr() == clone_flat.grad_view(mine).data_ptr()  # into the copy's buffers
        torch.testing.assert_close(theirs.grad, grad, rtol=0, atol=0)  # the original's gradients untouched
    with torch.no_grad():
        clone_flat.param_buffers[0].zero_()
    assert all((p == 0).all() for p in clone.parameters())
    assert not any((p == 0).all() for p in model.parameters())


def test_deepcopy_of_a_model_and_its_fused_optimizer_trains_independently(device):
    model = small_model(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    x = torch.randn(5, 6, device=device, dtype=torch.float64)
    step(model, optimizer, x)
    step(reference, ref_opt, x)
    clone, clone_opt = copy.deepcopy((model, optimizer))
    ref_clone, ref_clone_opt = copy.deepcopy((reference, ref_opt))
    for _ in range(3):
        y = torch.randn(5, 6, device=device, dtype=torch.float64)
        step(clone, clone_opt, y)
        step(ref_clone, ref_clone_opt, y)
    for mine, theirs in zip(clone.parameters(), ref_clone.parameters()):
        torch.testing.assert_close(mine, theirs, **TIGHT)
    z = torch.randn(5, 6, device=device, dtype=torch.float64)
    step(model, optimizer, z)  # the original goes on from where it was, untouched by the copy's steps
    step(reference, ref_opt, z)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, **TIGHT)


def test_a_flatparams_deep_copies_pickles_and_refuses_a_shallow_copy(device):
    model = small_model(device)
    flat = FlatParams(model.named_parameters(), bucket_mb=0.0001, max_params_per_bucket=2, align_bytes=64)
    alone = copy.deepcopy(flat)
    assert len(alone) == len(flat) and all(flat_params_of(p) is alone for p in alone)
    assert not any(q is p for q in alone for p in flat)
    with pytest.raises(TypeError, match="cannot be copied shallowly"):
        copy.copy(flat)
    back = loaded(saved_bytes(flat), weights_only=False)
    assert isinstance(back, FlatParams) and back.layout_version != flat.layout_version
    assert (back.bucket_mb, back.max_params_per_bucket, back.align_bytes) == (0.0001, 2, 64)
    assert [len(b.params) for b in back.buckets] == [len(b.params) for b in flat.buckets]
    for mine, theirs in zip(back, flat):
        assert flat_params_of(mine) is back and in_buffers(mine, back.param_buffers)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert back.name_of(back.params[0]) == "0.weight"


# --------------------------------------------------------------------------- state_dict serialisation


def layers(device) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)]).to(device)


@pytest.mark.parametrize("how", ["module", "optimizer_then_register"])
def test_one_layers_state_dict_serialises_its_own_elements_only(how, device):
    plain = layers(device)
    model = copy.deepcopy(plain)
    if how == "module":
        holder = FlatParams(model)
    else:
        holder = FusedAdam(model.parameters(), lr=1e-3)  # a fused optimizer sees parameters only
        register_compact_state_dict(model)
    one_plain = len(saved_bytes(plain[3].state_dict()))
    one = saved_bytes(model[3].state_dict())
    whole = saved_bytes(model.state_dict())
    print(f"one layer of eight: {len(one)} bytes (plain layer {one_plain}); whole model {len(whole)} bytes "
          f"(plain {len(saved_bytes(plain.state_dict()))})")
    assert len(one) <= one_plain + 512  # 66 KB, not the 530 KB of the whole flat buffer
    assert len(whole) <= len(saved_bytes(plain.state_dict())) + 4096  # each parameter once, no padding
    back = loaded(one)  # weights_only=True
    assert all(type(v) is torch.Tensor for v in back.values())
    for key, value in model[3].state_dict().items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0)
        assert back[key].untyped_storage().nbytes() == value.numel() * value.element_size()
    fresh = nn.Linear(128, 128).to(device)
    fresh.load_state_dict(back)
    torch.testing.assert_close(fresh.weight, model[3].weight, rtol=0, atol=0)


def test_state_dict_entries_still_alias_the_parameters(device):
    model = layers(device)
    flat = FlatParams(model)
    state = model.state_dict()
    entry = state["2.weight"]
    assert isinstance(entry, torch.Tensor) and not entry.requires_grad
    assert entry.data_ptr() == model[2].weight.data_ptr()
    version = model[2].weight._version
    entry.fill_(0.5)  # like torch: writing through a state_dict entry writes the parameter
    assert (model[2].weight == 0.5).all() and model[2].weight._version > version
    assert type(entry + 1) is torch.Tensor and "tensor(" in repr(entry)
    assert model.state_dict(keep_vars=True)["2.weight"] is model[2].weight
    snapshot_copy = copy.deepcopy(model.state_dict())  # e.g. keeping the best weights
    model[2].weight.data.fill_(2.0)
    assert (snapshot_copy["2.weight"] == 0.5).all()


def test_tied_parameters_stay_tied_through_a_compact_state_dict(device):
    embedding = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "filler": nn.Linear(64, 64), "head": head}).to(device)
    flat = FlatParams(model)
    state = model.state_dict()
    assert set(state) == {"embedding.weight", "filler.weight", "filler.bias", "head.weight"}
    back = loaded(saved_bytes(state))
    assert back["embedding.weight"].data_ptr() == back["head.weight"].data_ptr()  # one storage, as torch saves it
    assert back["embedding.weight"].untyped_storage().nbytes() == 50 * 16 * 4


def test_a_whole_coalesced_model_pickles_and_loads(device):
    model = layers(device)
    flat = FlatParams(model)
    back = loaded(saved_bytes(model), weights_only=False)
    for mine, theirs in zip(back.parameters(), model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert flat_params_of(back[0].weight) is None  # loaded as a plain model (each parameter its own storage)
    assert len(saved_bytes(back[0].state_dict())) <= len(saved_bytes(nn.Linear(128, 128).state_dict())) + 512
    back[0].weight.data = back[0].weight.detach().clone()  # a plain model's parameters can be anything
    assert len(saved_bytes(back[0].state_dict())) <= len(saved_bytes(nn.Linear(128, 128).state_dict())) + 512
