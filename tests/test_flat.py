"""tfuse.flat.FlatParams: layout, gradient views, zero_grad, buckets, trainability changes, errors."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from torch import nn

from tfuse.flat import FlatParams, flat_params_of


def small_model(device) -> nn.Module:
    torch.manual_seed(torch.initial_seed() % 2**31)
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 5), nn.Tanh(), nn.Linear(5, 3)).to(device)


def in_buffer(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= end


def test_parameters_become_aligned_views_with_unchanged_values(device):
    model = small_model(device)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = [id(p) for p in model.parameters()]
    flat = FlatParams(model.parameters(), align_bytes=256)
    assert [id(p) for p in model.parameters()] == ids  # same Parameter objects
    (buffer,) = flat.param_buffers
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, before[name], rtol=0, atol=0)
        assert in_buffer(param, buffer)
        assert (param.data_ptr() - buffer.data_ptr()) % 256 == 0
        assert flat_params_of(param) is flat
    assert list(model.state_dict()) == list(before)


def test_gradients_accumulate_into_the_flat_buffer_and_match_an_uncoalesced_copy(device):
    model = small_model(device)
    reference = copy.deepcopy(model)
    flat = FlatParams(model.parameters())
    x = torch.randn(4, 7, device=device)
    model(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for (name, param), theirs in zip(model.named_parameters(), reference.parameters()):
        assert param.grad.data_ptr() == flat.grad_view(param).data_ptr(), name
        assert in_buffer(param.grad, flat.grad_buffers[0])
        torch.testing.assert_close(param.grad, theirs.grad)
    # A second backward without zero_grad accumulates, as in torch.
    model(x).sum().backward()
    reference(x).sum().backward()
    for param, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, theirs.grad)


@pytest.mark.parametrize("how", ["flat_zero_grad", "optimizer_zero_grad", "manual_none"])
def test_grads_set_to_none_come_back_as_views_without_stale_values(how, device):
    model = small_model(device)
    reference = copy.deepcopy(model)
    flat = FlatParams(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 7, device=device)).sum().backward()  # leaves stale values in the buffer
    if how == "flat_zero_grad":
        flat.zero_grad()
    elif how == "optimizer_zero_grad":
        optimizer.zero_grad()  # torch's default: set_to_none=True
    else:
        for param in model.parameters():
            param.grad = None
    assert all(p.grad is None for p in model.parameters())
    x = torch.randn(4, 7, device=device)
    model(x).sum().backward()
    reference(x).sum().backward()
    for param, theirs in zip(model.parameters(), reference.parameters()):
        assert param.grad.data_ptr() == flat.grad_view(param).data_ptr()
        torch.testing.assert_close(param.grad, theirs.grad)


def test_zero_grad_without_none_keeps_views_and_unused_parameters_stay_none(device):
    used, unused = nn.Linear(3, 3).to(device), nn.Linear(3, 3).to(device)
    flat = FlatParams(list(used.parameters()) + list(unused.parameters()))
    used(torch.randn(2, 3, device=device)).sum().backward()
    assert all(p.grad is None for p in unused.parameters())  # torch's semantics: not reached, no grad
    flat.zero_grad(set_to_none=False)
    for param in used.parameters():
        assert param.grad.data_ptr() == flat.grad_view(param).data_ptr() and (param.grad == 0).all()
    assert all(p.grad is None for p in unused.parameters())


def test_training_with_torch_optimizer_follows_the_uncoalesced_trajectory(device):
    model = small_model(device)
    reference = copy.deepcopy(model)
    flat = FlatParams(model.parameters())
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    for _ in range(5):
        x = torch.randn(8, 7, device=device)
        for m, optimizer in zip((model, reference), optimizers):
            optimizer.zero_grad()
            m(x).pow(2).mean().backward()
            optimizer.step()
    for param, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, theirs)


def test_one_buffer_per_device_and_dtype(device):
    half = nn.Linear(4, 4).to(device=device, dtype=torch.float16)
    single = nn.Linear(4, 4).to(device)
    flat = FlatParams(list(half.parameters()) + list(single.parameters()))
    assert [b.dtype for b in flat.param_buffers] == [torch.float16, torch.float32]
    assert [b.dtype for b in flat.grad_buffers] == [torch.float16, torch.float32]
    assert {bucket.buffer_index for bucket in flat.buckets} == {0, 1}  # a dtype change starts a new bucket
    assert "coalesced into 2 buffers" in repr(flat)


def test_frozen_parameters_get_no_gradient_slot_until_unfrozen(device):
    model = small_model(device)
    model[0].weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    flat = FlatParams(model.parameters())
    with pytest.raises(KeyError):
        flat.grad_view(model[0].weight)
    frozen_bytes = model[0].weight.numel() * 4
    everything = sum(-(-p.numel() // 64) * 64 for p in model.parameters()) * 4
    assert flat.grad_buffers[0].numel() * 4 == everything - -(-frozen_bytes // 256) * 256  # no slot for it
    inputs = [torch.randn(2, 7, device=device) for _ in range(2)]
    for m in (model, reference):
        m(inputs[0]).sum().backward()
        m[0].weight.requires_grad_(True)  # unfreeze: the next backward gives it a plain gradient
        m(inputs[1]).sum().backward()
    flat.sync_grads()  # rebuilds the buffers with a slot for it, keeping every gradient
    assert model[0].weight.grad.data_ptr() == flat.grad_view(model[0].weight).data_ptr()
    for param, theirs in zip(model.parameters(), reference.parameters()):
        assert in_buffer(param.grad, flat.grad_buffers[0])
        torch.testing.assert_close(param.grad, theirs.grad)


def test_sync_grads_rehomes_a_hand_set_gradient(device):
    layer = nn.Linear(3, 2).to(device)
    flat = FlatParams(layer.parameters())
    layer.weight.grad = torch.full((2, 3), 7.0, device=device)
    flat.sync_grads()
    assert layer.weight.grad.data_ptr() == flat.grad_view(layer.weight).data_ptr()
    assert (layer.weight.grad == 7).all()


def test_tied_parameters_appear_once(device):
    embedding = nn.Embedding(10, 6).to(device)
    head = nn.Linear(6, 10, bias=False).to(device)
    head.weight = embedding.weight
    flat = FlatParams(list(embedding.parameters()) + list(head.parameters()))
    assert len(flat) == 1
    tokens = torch.tensor([[1, 2, 3]], device=device)
    head(embedding(tokens)).sum().backward()
    assert embedding.weight.grad.data_ptr() == flat.grad_view(embedding.weight).data_ptr()


def test_buckets_follow_backward_order_and_both_caps(device):
    layers = [nn.Linear(16, 16, bias=False).to(device) for _ in range(6)]  # 1 KB of float32 each
    params = [layer.weight for layer in layers]
    flat = FlatParams(params, bucket_mb=0.0025, max_params_per_bucket=2, align_bytes=4)
    ordered = [p for bucket in flat.buckets for p in bucket.params]
    assert [id(p) for p in ordered] == [id(p) for p in reversed(params)]  # reverse registration order
    assert all(1 <= len(b.params) <= 2 for b in flat.buckets)
    assert all(b.numel * 4 <= 2500 or len(b.params) == 1 for b in flat.buckets)
    assert flat.buckets[0].start == 0 and flat.buckets[-1].end == flat.grad_buffers[0].numel()
    assert all(a.end == b.start for a, b in zip(flat.buckets, flat.buckets[1:]))
    by_size = FlatParams([nn.Parameter(torch.randn(300, device=device)) for _ in range(4)], bucket_mb=0.003)
    assert [len(b.params) for b in by_size.buckets] == [2, 2]  # 2 x 1.28 KB (aligned) fit in 3 KB, 3 do not
    one_each = FlatParams([nn.Parameter(torch.randn(1000, device=device)) for _ in range(3)], bucket_mb=0.001)
    assert [len(b.params) for b in one_each.buckets] == [1, 1, 1]  # a parameter larger than the cap gets its own


def test_report_line_and_log(device, caplog):
    with caplog.at_level(logging.INFO, logger="tfuse.flat"):
        flat = FlatParams([nn.Parameter(torch.randn(1000, 1000, device=device)), nn.Parameter(torch.randn(10, device=device))])
    assert repr(flat) == "FlatParams(2 parameters (1.0M elements, 4.0 MB) coalesced into 1 buffer, 1 bucket)"
    assert "2 parameters (1.0M elements, 4.0 MB) coalesced into 1 buffer, 1 bucket" in caplog.text


def test_errors(device):
    with pytest.raises(ValueError, match=r"empty parameter list"):
        FlatParams([])
    with pytest.raises(TypeError, match=r"should be an iterable of Tensors, but got torch.FloatTensor|should be an iterable of Tensors"):
        FlatParams(nn.Parameter(torch.randn(3)))
    with pytest.raises(TypeError, match=r"parameter 1 is a str"):
        FlatParams([nn.Parameter(torch.randn(3, device=device)), "weight"])
    with pytest.raises(TypeError, match=r"dtype torch.int64"):
        FlatParams([torch.zeros(3, dtype=torch.int64, device=device)])
    with pytest.raises(TypeError, match=r"dtype torch.complex64"):
        FlatParams([nn.Parameter(torch.zeros(3, dtype=torch.complex64, device=device))])
    with pytest.raises(TypeError, match=r"sparse"):
        FlatParams([torch.eye(3, device=device).to_sparse()])
    with pytest.raises(ValueError, match=r"non-leaf"):
        FlatParams([nn.Parameter(torch.randn(3, device=device)) * 2])
    shared = nn.Parameter(torch.randn(3, device=device))
    first = FlatParams([shared])
    with pytest.raises(ValueError, match=r"already lives in another FlatParams"):
        FlatParams([shared])
    del first  # nothing keeps a FlatParams alive but its users: once it is gone, the parameter is free again
    gc.collect()
    assert flat_params_of(shared) is None
    FlatParams([shared])
    fresh = [nn.Parameter(torch.randn(3, device=device))]
    with pytest.raises(ValueError, match=r"bucket_mb must be a positive number"):
        FlatParams(fresh, bucket_mb=0)
    with pytest.raises(ValueError, match=r"max_params_per_bucket must be a positive int"):
        FlatParams(fresh, max_params_per_bucket=0)
    with pytest.raises(ValueError, match=r"align_bytes must be a power of two, got 100"):
        FlatParams(fresh, align_bytes=100)


def test_gradients_sit_at_their_parameters_offsets_and_frozen_parameters_come_last(device):
    model = small_model(device)
    model[2].weight.requires_grad_(False)
    flat = FlatParams(model.parameters())
    (group,) = flat.groups
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert [id(p) for p in group.params] == [id(p) for p in reversed(trainable)] + [id(model[2].weight)]
    assert group.n_trainable == len(trainable) and group.grad.numel() == group.offsets[len(trainable)]
    for param, offset in zip(group.params[: group.n_trainable], group.offsets):
        assert param.data_ptr() == group.data.data_ptr() + offset * 4
        assert flat.grad_view(param).data_ptr() == group.grad.data_ptr() + offset * 4


def test_a_new_layout_keeps_values_and_gradients_and_bumps_the_version(device):
    model = small_model(device)
    model[0].weight.requires_grad_(False)
    flat = FlatParams(model.parameters())
    model(torch.randn(2, 7, device=device)).sum().backward()
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    version = flat.layout_version
    model[0].weight.requires_grad_(True)
    flat.sync_grads()
    assert flat.layout_version == version + 1
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, values[name], rtol=0, atol=0)
        if name in grads:
            torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=0)
    assert flat.groups[0].n_trainable == len(list(model.parameters()))  # no frozen tail any more


def test_bad_arguments_get_errors_that_name_them(device):
    with pytest.raises(TypeError, match=r"params should be an iterable of Tensors .* or an nn.Module, but got NoneType"):
        FlatParams(None)
    with pytest.raises(TypeError, match=r"but got str"):
        FlatParams("weight")
    layer = nn.Linear(3, 2).to(device)
    with pytest.raises(TypeError, match=r"parameter 0 is a module \(Linear\), not a torch.Tensor; pass module.parameters\(\)"):
        FlatParams([layer])
    with pytest.raises(TypeError, match=r"parameter 1 \('mask'\) has dtype torch.bool"):
        FlatParams([("weight", layer.weight), ("mask", torch.ones(2, dtype=torch.bool, device=device))])
    fresh = [nn.Parameter(torch.randn(3, device=device))]
    with pytest.raises(ValueError, match=r"bucket_mb must be a positive number or None, got nan"):
        FlatParams(fresh, bucket_mb=float("nan"))
    with pytest.raises(ValueError, match=r"bucket_mb must be a positive number or None, got '1'"):
        FlatParams(fresh, bucket_mb="1")
    with pytest.raises(ValueError, match=r"max_params_per_bucket must be a positive int or None, got 2.0"):
        FlatParams(fresh, max_params_per_bucket=2.0)
    with pytest.raises(ValueError, match=r"align_bytes must be a power of two, got True"):
        FlatParams(fresh, align_bytes=True)
    named = FlatParams(layer)  # a module: its named parameters
    assert named.name_of(layer.weight) == "weight" and len(named) == 2


def test_plurals_in_the_report_line(device):
    assert repr(FlatParams([nn.Parameter(torch.randn(1, device=device))])) == (
        "FlatParams(1 parameter (1 element, 4 B) coalesced into 1 buffer, 1 bucket)"
    )
