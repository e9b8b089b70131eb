"""The fused optimizers' core on its own: FlatState (flat state over a range of a buffer, torch-format views),
the family update functions over element ranges (against torch.optim in float64), state names declared per
class, and the optimizer's binding to the FlatParams it updates (``FusedAdam(flat)``, ``flat_params``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from optim_helpers import clear_of_cancellation, make_pair, run_side_by_side
from torch import nn

import tfuse
from tfuse.flat import FlatParams, flat_params_of
from tfuse.optim import FusedAdam, FusedAdamW, FusedMomentum, FusedSGD
from tfuse.optim._state import FlatState
from tfuse.optim._update import ADAM, SGD, AdamStep, FlatBuffers, RunTable, SGDStep, adam_update, sgd_update

BACKENDS = ["triton", "torch"]


class Mixed(nn.Module):
    """Odd sizes, a channels_last convolution weight, a zero-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.linear = nn.Linear(7, 11)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.conv(x).mean(dim=(2, 3)).repeat(1, 2)[:, :7]) * self.scale


def mixed_group(device: torch.device) -> tuple[FlatParams, object]:
    model = Mixed().to(device).to(memory_format=torch.channels_last)
    flat = FlatParams(model)
    (group,) = flat.groups
    return flat, group


def fill_by_parameter(state: FlatState, name: str, group) -> None:
    """Writes each covered parameter's values into its torch-format view of state ``name``."""
    for param in group.params:
        if state.covers(param):
            state.view(name, param).copy_(param.detach() * 3 + 1)


# ---------------------------------------------------------------------------- FlatState


def test_flat_state_over_a_range_keeps_that_range_only(device):
    flat, group = mixed_group(device)
    first, second, third = group.params[:3]
    whole = FlatState(group)
    assert whole.ensure("exp_avg").numel() == group.data.numel()
    # From the second parameter's offset to the middle of the third one's: one parameter whole, one cut.
    start = flat.range_of(second).start
    end = flat.range_of(third).start + third.numel() // 2
    part = FlatState(group, start, end)
    buffer = part.ensure("exp_avg")
    assert buffer.numel() == end - start < group.data.numel()  # memory for the range, not the buffer
    assert part.covers(second) and not part.covers(first) and not part.covers(third)
    assert part.span(first) == (0, 0)
    assert part.span(second) == (0, second.numel())
    assert part.span(third) == (flat.range_of(third).start - start, end - start)
    with pytest.raises(ValueError, match="not inside the state's range"):
        part.view("exp_avg", third)
    with pytest.raises(ValueError, match="not within the buffer"):
        FlatState(group, 0, group.data.numel() + 1)
    with pytest.raises(KeyError, match="does not live in the state's flat buffer"):
        part.view("exp_avg", nn.Parameter(torch.zeros(3)))


def test_flat_state_for_each_shard_of_a_flat_params(device):
    """The shards FlatParams states for a world size: each owner's FlatState is its shard's size, and the
    owners' per-parameter spans tile every parameter exactly once."""
    model = Mixed().to(device)
    flat = FlatParams(model, world_size=3)
    (shards,) = flat.shards(3)
    group = flat.groups[0]
    states = [FlatState(group, shard.start, shard.end) for shard in shards]
    assert {state.ensure("exp_avg_sq").numel() for state in states} == {shards[0].numel}
    for param in group.params[: group.n_trainable]:
        spans = [state.span(param) for state in states]
        assert sum(hi - lo for lo, hi in spans) == param.numel()
        for state, shard, (lo, hi) in zip(states, shards, spans):
            clipped = [(s, e) for p, s, e in shard.ranges if p is param]
            assert clipped == ([(lo + state.start, hi + state.start)] if hi > lo else [])


def test_flat_state_views_are_torch_format_and_pair_with_the_flat_layout(device):
    """A view has its parameter's shape and strides (channels_last kept), and element for element it is the
    parameter's slot of the flat buffer: the same values written through views of the whole-buffer state and of
    a range's state land at the same flat positions."""
    flat, group = mixed_group(device)
    whole, part = FlatState(group), FlatState(group, flat.range_of(group.params[1]).start)
    for state in (whole, part):
        state.ensure("momentum_buffer").fill_(float("nan"))
        fill_by_parameter(state, "momentum_buffer", group)
    assert model_has_channels_last(group)
    for param in group.params:
        view = whole.view("momentum_buffer", param)
        assert view.shape == param.shape and view.stride() == param.stride()
        torch.testing.assert_close(view, param.detach() * 3 + 1, rtol=0, atol=0)
        # The slot of the parameter in the flat buffer holds the same values in the same memory order.
        where = flat.range_of(param)
        slot = whole.buffers["momentum_buffer"][where.start : where.end]
        assert torch.equal(slot, group.data[where.start : where.end] * 3 + 1)
        if part.covers(param):
            assert part.view("momentum_buffer", param).stride() == param.stride()
            assert torch.equal(part.view("momentum_buffer", param), view)
            local = part.buffers["momentum_buffer"][where.start - part.start : where.end - part.start]
            assert torch.equal(local, slot)
    second = group.params[1]
    step = part.step(second)
    assert step.shape == () and step.dtype == torch.float32 and step.device.type == "cpu"
    part.steps += 1
    assert float(step) == 1.0  # step views follow the counts


def model_has_channels_last(group) -> bool:
    return any(p.dim() == 4 and not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
               for p in group.params)


def test_flat_state_masters_are_float32_copies_of_the_range(device):
    model = Mixed().to(device=device, dtype=torch.bfloat16)
    flat = FlatParams(model)
    (group,) = flat.groups
    state = FlatState(group, flat.range_of(group.params[1]).start, master_weights=True)
    assert state.ensure("exp_avg").dtype == torch.float32
    master = state.ensure_master()
    assert master.dtype == torch.float32 and master.numel() == state.numel
    torch.testing.assert_close(state.master_view(group.params[1]), group.params[1].detach().float(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="master_weights=True"):
        FlatState(group).ensure_master()


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "range"])
def test_flat_state_follows_a_new_layout(ranged, device):
    """A layer unfrozen: the FlatParams lays its buffer out again, and each parameter's state, master and step
    count move to its new offsets."""
    model = Mixed().to(device=device, dtype=torch.bfloat16)
    model.linear.weight.requires_grad_(False)
    flat = FlatParams(model)
    (group,) = flat.groups
    start = flat.range_of(group.params[1]).start if ranged else 0
    state = FlatState(group, start, master_weights=True)
    state.ensure("exp_avg")
    state.ensure_master().add_(0.25)  # masters that differ from the parameters: they must move, not be remade
    fill_by_parameter(state, "exp_avg", group)
    before = {id(p): state.view("exp_avg", p).clone() for p in group.params if state.covers(p)}
    for index in range(len(group.params)):
        state.steps[index] = index + 1
    steps = {id(p): float(state.step(p)) for p in group.params}
    version = flat.layout_version
    model.linear.weight.requires_grad_(True)
    flat.sync_grads()
    assert flat.layout_version > version
    (new_group,) = flat.groups
    assert [id(p) for p in new_group.params] != [id(p) for p in group.params]  # the order changed
    new_start = flat.range_of(group.params[1]).start if ranged else 0
    state.follow(new_group, new_start)
    assert state.group is new_group and state.buffers["exp_avg"].numel() == state.numel
    for param in new_group.params:
        assert float(state.step(param)) == steps[id(param)]
        if state.covers(param) and id(param) in before:
            torch.testing.assert_close(state.view("exp_avg", param), before[id(param)], rtol=0, atol=0)
            torch.testing.assert_close(state.master_view(param), param.detach().float() + 0.25, rtol=0, atol=0)


# ---------------------------------------------------------------------------- the update functions


def reference_steps(torch_cls, options: dict, start: torch.Tensor, grads: list[torch.Tensor]) -> tuple:
    """torch.optim's for-loop implementation in float64 over the given elements, one step per gradient."""
    param = nn.Parameter(start.detach().double().clone())
    optimizer = torch_cls([param], **options, foreach=False)
    for grad in grads:
        param.grad = grad.double().clone()
        optimizer.step()
    return param.detach(), optimizer.state[param]


ADAM_OPTIONS = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True, maximize=True),
    dict(lr=1e-2, weight_decay=0.2, decoupled_weight_decay=True),
]
SGD_OPTIONS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02, maximize=True),
]


def adam_row(options: dict, step: int) -> AdamStep:
    betas = options.get("betas", (0.9, 0.999))
    return AdamStep(lr=options["lr"], beta1=betas[0], beta2=betas[1], eps=options.get("eps", 1e-8),
                    weight_decay=options.get("weight_decay", 0.0), step=step, amsgrad=options.get("amsgrad", False),
                    maximize=options.get("maximize", False),
                    decoupled_weight_decay=options.get("decoupled_weight_decay", False))


def sgd_row(options: dict, step: int) -> SGDStep:
    return SGDStep(lr=options["lr"], momentum=options.get("momentum", 0.0), dampening=options.get("dampening", 0.0),
                   weight_decay=options.get("weight_decay", 0.0), nesterov=options.get("nesterov", False),
                   maximize=options.get("maximize", False), first_step=step == 1)


FAMILIES = [
    *(pytest.param(adam_update, adam_row, torch.optim.Adam, o, id=f"adam-{i}") for i, o in enumerate(ADAM_OPTIONS)),
    *(pytest.param(sgd_update, sgd_row, torch.optim.SGD, o, id=f"sgd-{i}") for i, o in enumerate(SGD_OPTIONS)),
]
# Against float64 references. float32: the update computes in float32 on randn-sized operands (up to ~5), over
# three steps; where terms cancel (a momentum buffer near zero) a few roundings of such operands remain, ~1e-6.
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-6, atol=2e-6)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("update_fn,row,torch_cls,options", FAMILIES)
def test_the_update_over_a_sub_range_is_torchs_and_leaves_the_rest_alone(update_fn, row, torch_cls, options, aligned,
                                                                       dtype, backend, device):
    """The family function over [a, b) of flat buffers equals torch.optim (float64) on those elements, step
    after step; parameters, gradients and state outside the range keep their bits (state there is NaN-poisoned,
    so reading it would show)."""
    n = 9001
    a, b = (4096 - 16, 4096 + 2000) if aligned else (37, 5000 + 3)
    param = torch.randn(n, device=device, dtype=dtype)
    names = adam_row(options, 1).state_names if update_fn is adam_update else sgd_row(options, 1).state_names
    state = {name: torch.full((n,), float("nan"), device=device, dtype=dtype) for name in names}
    for buffer in state.values():
        buffer[a:b] = 0  # torch's state starts at zero (SGD's momentum buffer is written before it is read)
    start = param.clone()
    table = RunTable([(a, b, 0)], start_align=16 if aligned else 1)
    grads = []
    with tfuse.use_backend(backend):
        for step in (1, 2, 3):
            grad = torch.randn(n, device=device, dtype=dtype)
            if dtype == torch.float32:  # well-conditioned data for the float32 comparison (see optim_helpers)
                clear_of_cancellation(grad[a:b], param[a:b], options)
            grads.append(grad[a:b].clone())
            before = param.clone(), grad.clone(), {k: v.clone() for k, v in state.items()}
            update_fn(FlatBuffers(param, grad, state), table, [row(options, step)])
            outside = torch.ones(n, dtype=torch.bool, device=device)
            outside[a:b] = False
            assert torch.equal(param[outside], before[0][outside])
            assert torch.equal(grad, before[1])  # no grad scale: gradients are only read
            for name, buffer in state.items():
                assert buffer[outside].isnan().all(), name  # never written (and a NaN read would show inside)
            expected, expected_state = reference_steps(torch_cls, options, start[a:b], grads)
            torch.testing.assert_close(param[a:b], expected.to(dtype), **TOLERANCE[dtype])
            for name in names:
                torch.testing.assert_close(state[name][a:b], expected_state[name].to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_rows_in_one_update_and_masters_with_a_grad_scale(backend, device):
    """Two ranges with different hyperparameters (different step counts) in one call, bfloat16 parameters with
    float32 masters and state, gradients scaled by 64: each range follows torch's float64 Adam on the unscaled
    gradients, the parameters are the masters rounded, and the gradients are left unscaled."""
    n, scale = 6000, 64.0
    ranges = [(0, 1000), (1024, 4000)]
    master = torch.randn(n, device=device)
    param = master.to(torch.bfloat16)
    master = param.float()
    start = master.clone()
    state = {"exp_avg": torch.zeros(n, device=device), "exp_avg_sq": torch.zeros(n, device=device)}
    table = RunTable([(a, b, row) for row, (a, b) in enumerate(ranges)], start_align=8)
    options = [dict(lr=1e-2), dict(lr=3e-2, weight_decay=0.1, decoupled_weight_decay=True)]
    grads = {0: [], 1: []}
    with tfuse.use_backend(backend):
        for step in (1, 2):
            unscaled = torch.randn(n, device=device).to(torch.bfloat16)
            grad = (unscaled.float() * scale).to(torch.bfloat16)
            for row, (a, b) in enumerate(ranges):
                grads[row].append(unscaled[a:b].clone())
            rows = [adam_row(options[0], step), adam_row(options[1], step + 4)]  # the second range is 4 steps on
            adam_update(FlatBuffers(param, grad, state, master), table, rows,
                        grad_scale=torch.tensor(scale, device=device))
            for a, b in ranges:  # unscaled in place (exactly: the scale is a power of two)
                torch.testing.assert_close(grad[a:b], unscaled[a:b], rtol=0, atol=0)
            assert torch.equal(grad[4000:], (unscaled[4000:].float() * scale).to(torch.bfloat16))  # outside: as given
    torch.testing.assert_close(param, master.to(torch.bfloat16), rtol=0, atol=0)
    for row, (a, b) in enumerate(ranges):
        reference = nn.Parameter(start[a:b].double().clone())
        optimizer = torch.optim.Adam([reference], **options[row], foreach=False)
        if row == 1:
            optimizer.state[reference] = {"step": torch.tensor(4.0), "exp_avg": torch.zeros_like(reference),
                                          "exp_avg_sq": torch.zeros_like(reference)}
        for grad in grads[row]:
            reference.grad = grad.double()
            optimizer.step()
        torch.testing.assert_close(master[a:b], reference.detach().float(), **TOLERANCE[torch.float32])
    untouched = torch.ones(n, dtype=torch.bool, device=device)
    for a, b in ranges:
        untouched[a:b] = False
    assert torch.equal(master[untouched], start[untouched])


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_owners_with_their_flat_state_reproduce_torchs_adam(backend, device):
    """Each of three owners keeps a FlatState for its equal contiguous share [start, end) of the flat buffer
    and runs the update over it alone (the ZeRO-1 layout): together they train the model like torch.optim.Adam,
    and none keeps state beyond its share."""
    model, reference = make_pair(device, torch.float64)
    flat = FlatParams(model)
    (group,) = flat.groups
    size = group.trainable_numel
    cuts = [0, size // 3 // 16 * 16, 2 * size // 3 // 16 * 16, size]
    owners = [FlatState(group, cuts[i], cuts[i + 1]) for i in range(3)]
    for state in owners:
        state.ensure("exp_avg")
        state.ensure("exp_avg_sq")
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    with tfuse.use_backend(backend):
        for step in (1, 2, 3):
            x = torch.randn(4, 5, device=device, dtype=torch.float64)
            for net in (model, reference):
                net(x, use_aux=True).pow(2).mean().backward()
            flat.sync_grads()
            for state in owners:
                table = RunTable([(0, state.numel, 0)], start_align=16)
                adam_update(state.buffers_for_update(), table, [AdamStep(lr=1e-2, weight_decay=0.1, step=step)])
            torch_opt.step()
            for p in (*model.parameters(), *reference.parameters()):
                p.grad = None
    for mine, other in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, other, rtol=1e-10, atol=1e-12)
    assert sum(state.buffers["exp_avg"].numel() for state in owners) == size


def test_run_tables_refuse_alignment_hints_the_runs_break():
    with pytest.raises(ValueError, match="does not respect start_align=16"):
        RunTable([(0, 100, 0), (104, 200, 1)], start_align=16)
    with pytest.raises(ValueError, match="does not respect"):
        RunTable([(0, 100, 0)], start_align=16, end_align=16)
    with pytest.raises(ValueError, match="powers of two"):
        RunTable([(0, 96, 0)], start_align=32)
    table = RunTable([(0, 10000, 0), (10016, 10100, 1)], start_align=16)
    starts, ends, rows = table.blocks(torch.device("cpu"))
    assert starts.tolist() == [0, 4096, 8192, 10016] and ends.tolist() == [4096, 8192, 10000, 10100]
    assert rows.tolist() == [0, 0, 0, 1]


# ---------------------------------------------------------------------------- the optimizer classes


def test_state_names_are_declared_per_class_and_cover_every_option(device):
    assert FusedAdam.state_names == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert FusedAdamW.state_names == FusedAdam.state_names
    assert FusedSGD.state_names == FusedMomentum.state_names == ("momentum_buffer",)
    assert FusedAdam.family is ADAM and FusedSGD.family is SGD
    for cls, options in [(FusedAdam, o) for o in ADAM_OPTIONS] + [(FusedSGD, o) for o in SGD_OPTIONS]:
        model = make_pair(device)[0]
        optimizer = cls(model.parameters(), **options)
        model(torch.randn(3, 5, device=device), use_aux=True).sum().backward()
        optimizer.step()
        kept = {name for entry in optimizer.state.values() for name in entry} - {"step"}
        assert kept <= set(cls.state_names), (cls.__name__, options, kept)
        assert kept == set(optimizer.update_row(optimizer.param_groups[0], 1, True).state_names)


def test_load_state_dict_checks_the_shapes_of_the_declared_state(device):
    model, reference = make_pair(device)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference(torch.randn(3, 5, device=device), use_aux=True).sum().backward()
    torch_opt.step()
    state = torch_opt.state_dict()
    state["state"][1]["momentum_buffer"] = torch.zeros(2, 2)
    optimizer = FusedMomentum(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of shape \(2, 2\) for a parameter of shape \(7, 5\)"):
        optimizer.load_state_dict(state)


@pytest.mark.parametrize("as_group", [False, True], ids=["params", "group"])
def test_an_optimizer_given_a_flat_params_binds_to_it(as_group, device):
    model, reference = make_pair(device)
    flat = FlatParams(model)
    pointers = [p.data_ptr() for p in model.parameters()]
    params = [{"params": flat, "lr": 1e-2}] if as_group else flat
    optimizer = FusedAdam(params, lr=1e-2)
    assert optimizer.flat_params == (flat,) and optimizer.flat_params[0] is flat
    assert [p.data_ptr() for p in model.parameters()] == pointers  # nothing coalesced again
    (buffer,) = flat.param_buffers
    before = buffer.clone()
    run_side_by_side(model, reference, optimizer, torch.optim.Adam(reference.parameters(), lr=1e-2), 2, device,
                     torch.float32)
    assert not torch.equal(buffer, before)  # the update went into that FlatParams' buffer


def test_the_optimizer_holds_the_flat_params_it_updates(device):
    """No registry keeps a FlatParams alive: the optimizer does, for those it was given and those it made."""
    model = make_pair(device)[0]
    optimizer = FusedSGD(FlatParams(model), lr=0.1)  # nobody else holds this FlatParams
    other = nn.Linear(3, 3).to(device)
    optimizer.add_param_group({"params": other.parameters()})  # loose: the optimizer coalesces them
    refs = [weakref.ref(flat) for flat in optimizer.flat_params]
    gc.collect()
    assert len(refs) == 2 and all(ref() is not None for ref in refs)
    assert flat_params_of(model.first.weight) is optimizer.flat_params[0]
    assert flat_params_of(other.weight) is optimizer.flat_params[1]
    with pytest.raises(AttributeError):
        optimizer.flat_params = ()


def test_flat_params_lists_every_flat_params_once(device):
    model = make_pair(device)[0]
    first = FlatParams([model.first.weight, model.first.bias])
    second = FlatParams([model.second.weight, model.second.bias])
    loose = [model.scale, model.aux.weight, model.aux.bias]
    optimizer = FusedAdam([{"params": [model.first.weight, model.second.weight]},
                           {"params": [model.first.bias, model.second.bias, *loose], "lr": 0.1}], lr=1e-2)
    flats = optimizer.flat_params
    assert len(flats) == 3 and flats[0] is first and flats[1] is second
    assert all(flats[2].holds(p) for p in loose)
    assert "3 flat buffers" in optimizer.describe()


@pytest.mark.parametrize("skip", [0.0, 1.0], ids=["step", "found_inf"])
def test_adagrads_foreach_maths_equal_torchs_adagrad(skip):
    """The PyTorch path of Adagrad off the CPU (torch's foreach ops; the CPU runs torch._fused_adagrad_):
    every option, a GradScaler's scale and found_inf, against torch.optim.Adagrad's for-loop in float64 on
    the unscaled gradients (found_inf: nothing changes, the gradients stay scaled)."""
    from tfuse.optim._adagrad_family import AdagradStep, _foreach_adagrad

    options = dict(lr=0.05, lr_decay=0.2, weight_decay=0.1, eps=1e-6, maximize=True)
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), ()]
    params = [torch.randn(s, dtype=torch.float64) for s in shapes]
    grads = [torch.randn(s, dtype=torch.float64) * 4 for s in shapes]
    sums = [torch.rand(s, dtype=torch.float64) for s in shapes]
    ours = [[t.clone() for t in ts] for ts in (params, grads, sums)]
    scale, found_inf = torch.tensor(4.0, dtype=torch.float64), torch.tensor(skip)
    _foreach_adagrad(AdagradStep(**options, step=3), torch.tensor(3.0), *ours, scale, found_inf)
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    reference = torch.optim.Adagrad(leaves, **options, foreach=False)
    for leaf, grad, total in zip(leaves, grads, sums):
        leaf.grad = grad if skip else grad / 4
        reference.state[leaf]["sum"].copy_(total)
        reference.state[leaf]["step"].fill_(2)  # the step taken is the third
    if not skip:
        reference.step()
    expected = ([leaf.detach() for leaf in leaves], [leaf.grad for leaf in leaves],
                [reference.state[leaf]["sum"] for leaf in leaves])
    for mine, theirs in zip(ours, expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-14, atol=1e-15)
