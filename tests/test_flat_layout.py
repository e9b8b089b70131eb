"""The flat layout FlatParams states: ranges, buckets as views, shards, finding a parameter's FlatParams, the grad receiver."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from tfuse.flat import FlatParams, GradHome, ParamRange, flat_params_of


def mixed_model(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Conv2d(3, 4, 3), nn.Linear(5, 2)).to(device)
    model[1].weight.data = model[1].weight.data.to(memory_format=torch.channels_last)
    model[0].bias.requires_grad_(False)
    return model


def test_ranges_say_where_every_parameter_lives(device):
    model = mixed_model(device)
    flat = FlatParams(model)
    ranges = flat.ranges()
    assert len(ranges) == len(list(model.parameters()))
    for param in model.parameters():
        where = flat.range_of(param)
        assert isinstance(where, ParamRange) and where.numel == param.numel()
        buffer = flat.param_buffers[where.buffer]
        view = where.view(buffer)
        assert view.data_ptr() == param.data_ptr() and view.stride() == param.stride()  # memory format kept
        assert torch.equal(view, param)
        assert where.trainable == param.requires_grad
        if param.requires_grad:
            assert where.view(flat.groups[where.buffer].grad).data_ptr() == flat.grad_view(param).data_ptr()
    # Ranges never overlap and start aligned (256 bytes = 64 float32 elements).
    spans = sorted((r.buffer, r.start, r.end) for r in ranges)
    assert all(a[2] <= b[1] for a, b in zip(spans, spans[1:]) if a[0] == b[0])
    assert all(r.start % 64 == 0 for r in ranges)
    with pytest.raises(KeyError, match="not coalesced"):
        flat.range_of(nn.Parameter(torch.zeros(2)))


def test_buckets_are_views_of_the_gradient_buffer(device):
    model = mixed_model(device)
    flat = FlatParams(model, bucket_mb=200e-6)
    assert len(flat.buckets) > 1
    for bucket in flat.buckets:
        grad = flat.grad_buffers[bucket.buffer_index]
        assert bucket.grad.numel() == bucket.numel
        assert bucket.grad.data_ptr() == grad[bucket.start :].data_ptr()
        for param in bucket.params:
            where = flat.range_of(param)
            assert bucket.start <= where.start and where.end <= bucket.end
    flat.grad_buffers[0].fill_(3.0)
    assert all(bool((b.grad == 3.0).all()) for b in flat.buckets)  # same memory, no copy


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_shards_are_equal_aligned_and_cover_every_trainable_element(world_size, device):
    model = mixed_model(device)
    flat = FlatParams(model, world_size=world_size)
    version = flat.layout_version
    shards = flat.shards(world_size)
    assert flat.layout_version == version  # laid out for this world size already: nothing moves
    for index, group in enumerate(flat.groups):
        per_rank = shards[index]
        if group.grad is None:
            assert per_rank == []
            continue
        assert [s.rank for s in per_rank] == list(range(world_size))
        sizes = {s.numel for s in per_rank}
        assert len(sizes) == 1 and sizes.pop() % 64 == 0  # equal, and a whole number of 256-byte blocks
        assert per_rank[0].start == 0 and per_rank[-1].end == group.grad.numel()
        assert all(a.end == b.start for a, b in zip(per_rank, per_rank[1:]))
        # Every trainable element of every parameter is in exactly one shard's pieces.
        covered = {}
        for shard in per_rank:
            for param, start, end in shard.ranges:
                assert shard.start <= start < end <= shard.end
                covered.setdefault(id(param), 0)
                covered[id(param)] += end - start
        trainable = group.params[: group.n_trainable]
        assert covered == {id(p): p.numel() for p in trainable}
        # Frozen parameters lie after the padded trainable range: gathering shards never overwrites them.
        assert all(flat.range_of(p).start >= group.grad.numel() for p in group.params[group.n_trainable :])


def test_shards_for_a_new_world_size_pad_the_buffers_and_keep_values_and_gradients(device):
    model = mixed_model(device)
    flat = FlatParams(model)
    model[2](model[0](torch.randn(3, 7, device=device))).sum().backward()
    before = {name: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()}
    version = flat.layout_version
    numel = flat.grad_buffers[0].numel()
    world = next(w for w in range(2, 64) if numel % (64 * w))  # one the unpadded buffer does not split evenly for
    shards = flat.shards(world)
    assert flat.layout_version > version
    assert len({s.numel for s in shards[0]}) == 1
    for name, param in model.named_parameters():
        value, grad = before[name]
        assert torch.equal(param, value)
        assert (grad is None and param.grad is None) or torch.equal(param.grad, grad)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        flat.shards(0)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        FlatParams([nn.Parameter(torch.zeros(3, device=device))], world_size=True)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_shards_of_whole_parameters_split_none_and_balance_the_ranks(world_size, device):
    """whole_params=True (sharded Muon): every trainable parameter inside one shard, ranks holding consecutive
    parameters in buffer order, the largest load at most an even share plus the largest parameter; values and
    gradients kept through the re-layout, and later calls without the flag get the same shards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 4), nn.Conv2d(4, 9, 3), nn.Linear(9, 2)).to(device)
    model[0].bias.requires_grad_(False)  # a frozen parameter stays after the trainable range
    flat = FlatParams(model)
    model[1](model[0](torch.randn(3, 30, device=device))).sum().backward()
    before = {n: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    shards = flat.shards(world_size, whole_params=True)[0]
    group = flat.groups[0]
    trainable = group.params[: group.n_trainable]
    owner = {id(param): shard.rank for shard in shards for param, _, _ in shard.ranges}
    for shard in shards:
        for param, start, end in shard.ranges:
            assert (start, end) == (flat.range_of(param).start, flat.range_of(param).end)  # whole, not a piece
    assert sorted(owner) == sorted(id(p) for p in trainable)
    ranks = [owner[id(p)] for p in sorted(trainable, key=lambda p: flat.range_of(p).start)]
    assert ranks == sorted(ranks)  # consecutive parameters per rank, in buffer order
    aligned = [-(-p.numel() // 64) * 64 for p in trainable]
    assert shards[0].numel <= -(-sum(aligned) // world_size) + max(aligned)
    assert len({s.numel for s in shards}) == 1 and shards[-1].end == group.grad.numel()
    assert all(flat.range_of(p).start >= group.grad.numel() for p in group.params[group.n_trainable :])
    for name, param in model.named_parameters():
        value, grad = before[name]
        assert torch.equal(param, value) and ((grad is None and param.grad is None) or torch.equal(param.grad, grad))
    version = flat.layout_version
    assert flat.shards(world_size) == flat.shards(world_size, whole_params=True) and flat.layout_version == version


def test_a_parameter_leads_to_its_flat_params_and_nothing_keeps_it_alive(device):
    model = mixed_model(device)
    flat = FlatParams(model)
    frozen = model[0].bias
    assert all(flat_params_of(p) is flat for p in model.parameters())  # frozen ones too
    assert flat_params_of(nn.Parameter(torch.zeros(2, device=device))) is None
    assert flat_params_of(flat.param_buffers[0]) is None  # the buffer itself is not a coalesced parameter
    ref = weakref.ref(flat)
    del flat
    gc.collect()
    assert ref() is None  # no registry holds it
    assert flat_params_of(frozen) is None
    again = FlatParams(model)  # the parameters are free to be coalesced again
    assert flat_params_of(frozen) is again
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        flat_params_of("weight")


def test_the_grad_receiver_gets_each_gradient_already_in_the_buffer(device):
    # Gradients accumulate in place into the flat buffer (the views are attached before autograd
    # accumulates), so the receiver finds each one home already; a gradient set by hand is brought in.
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(device)
    reference = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(device)
    reference.load_state_dict(model.state_dict())
    flat = FlatParams(model)
    received = []

    def receiver(param):
        home = param.grad is not None and param.grad.data_ptr() == flat.grad_view(param).data_ptr()
        received.append((param, home, flat.bring_home(param) is GradHome.IN_BUFFER))

    flat.set_grad_receiver(receiver)
    assert flat.grad_receiver is receiver
    x = torch.randn(5, 4, device=device)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert {id(p) for p, _, _ in received} == {id(p) for p in model.parameters()}
    assert all(home and brought for _, home, brought in received)  # accumulated in place: nothing to copy
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert mine.grad.data_ptr() == flat.grad_view(mine).data_ptr()
        torch.testing.assert_close(mine.grad, theirs.grad)
    received.clear()
    hand_set = model[0].weight
    once = reference[0].weight.grad.clone()
    hand_set.grad = torch.full_like(hand_set, 2.0)  # set by hand: autograd accumulates into it, outside the buffer
    model(x).sum().backward()
    assert [(home, brought) for p, home, brought in received if p is hand_set] == [(False, True)]
    assert hand_set.grad.data_ptr() == flat.grad_view(hand_set).data_ptr()  # brought in by bring_home
    torch.testing.assert_close(hand_set.grad, once + 2.0)
    flat.set_grad_receiver(None)
    received.clear()
    model.zero_grad()
    model(x).sum().backward()
    reference.zero_grad()
    reference(x).sum().backward()
    assert not received
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_training_steps_look_nothing_up(monkeypatch, device):
    """The optimizer binds to its FlatParams once; steps and clipping use the FlatParams they were handed."""
    from tfuse.optim import FusedAdam, clip_grad_norm_

    model = mixed_model(device)
    flat = FlatParams(model)
    optimizer = FusedAdam(model.parameters(), lr=1e-3)  # finds the FlatParams its parameters live in, once
    assert optimizer.flat_params == (flat,)
    lookups = []
    holds = FlatParams.holds
    monkeypatch.setattr(FlatParams, "holds", lambda self, param: lookups.append(param) or holds(self, param))
    x = torch.randn(3, 7, device=device)
    for _ in range(3):
        model[2](model[0](x)).sum().backward()
        clip_grad_norm_(optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert lookups == []
