"""The lean gradient path: gradients accumulate in place into the flat buffers, ``grad is None`` as in torch.

``zero_grad()`` is one fill per gradient buffer; backward attaches each
parameter's zeroed slot as its ``.grad`` just before autograd accumulates
into it, so no gradient is copied. These tests check the op counts of both,
and that every observable ``param.grad`` (None or not, and its values) and
every optimizer step matches torch's on the same model: parameters that get
no gradient, ``set_to_none`` either way, accumulation over several
backwards, clipping, GradScaler, foreign ``zero_grad``, hand-set gradients,
``torch.autograd.grad``, ``create_graph`` and freezing.
"""

from __future__ import annotations

import collections
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tfuse
from tfuse.flat import FlatParams
from tfuse.optim import FusedAdam, FusedAdamW, FusedMomentum, FusedSGD

TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64 throughout: only the order of a few operations differs
ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    """A trunk used every step, a head used on some steps only, and a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)
        self.sometimes = nn.Linear(6, 2)
        self.never = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))
        out = self.head(hidden).pow(2).mean()
        return out + self.sometimes(hidden).pow(2).mean() if use_sometimes else out


def pair(device) -> tuple[Net, Net]:
    torch.manual_seed(0)
    model = Net().to(device=device, dtype=torch.float64)
    return model, copy.deepcopy(model)


class CountOps(TorchDispatchMode):
    """aten ops by name (views left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in ("detach", "lift_fresh"):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def same_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert (mine.grad is None) == (theirs.grad is None), name
        if mine.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


def in_slot(flat: FlatParams, param: nn.Parameter) -> bool:
    return param.grad is not None and param.grad.data_ptr() == flat._view(param).data_ptr()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_is_one_fill_per_buffer_and_backward_copies_nothing(set_to_none, device):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
    other = nn.Linear(4, 2).to(device=device, dtype=torch.float64)  # a second buffer
    params = list(model.parameters()) + list(other.parameters())
    flat = FlatParams(params)
    x = torch.randn(5, 4, device=device)
    for step in range(3):
        with CountOps() as zeroing:
            flat.zero_grad(set_to_none=set_to_none)
        assert zeroing.counts == {"zero_": 2}  # one fill per gradient buffer, no op per parameter
        if step > 0:
            assert all(p.grad is None for p in params) if set_to_none else all(in_slot(flat, p) for p in params)
        for buffer in (g.grad for g in flat.groups):
            assert not buffer.any()
        with CountOps() as backward:
            (model(x).sum() + other(x.double()).sum()).backward()
        assert backward.counts["copy_"] == 0 and backward.counts["zero_"] == 0, backward.counts
        assert all(in_slot(flat, p) for p in params)


def test_gradients_match_torch_and_unreached_parameters_keep_none(device):
    model, reference = pair(device)
    flat = FlatParams(model.parameters())
    x = torch.randn(4, 5, device=device, dtype=torch.float64)
    model(x, use_sometimes=False).backward()
    reference(x, use_sometimes=False).backward()
    same_grads(model, reference)
    assert model.sometimes.weight.grad is None and model.never.weight.grad is None
    # A second backward without zero_grad accumulates; the head used now gets its first gradient.
    model(x, use_sometimes=True).backward()
    reference(x, use_sometimes=True).backward()
    same_grads(model, reference)
    assert all(in_slot(flat, p) for p in model.parameters() if p.grad is not None)
    flat.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    # torch.autograd.grad accumulates nothing: every .grad stays None, the buffers stay zero.
    grads = torch.autograd.grad(model(x, use_sometimes=True), list(model.parameters()), allow_unused=True)
    assert grads[0] is not None and all(p.grad is None for p in model.parameters())
    assert not flat._groups[0].grad.any()


def test_autograd_makes_each_forwards_accumulate_grad_node_as_in_torch(device):
    """Coalescing keeps no AccumulateGrad node alive. autograd makes one per forward, on that forward's stream;
    a node kept from an earlier forward stays on the stream it was made on, which breaks a CUDA graph captured
    on another stream (seen on an H100). A hook a user put on a dropped node must die with it, as in torch."""
    from torch.autograd.graph import get_gradient_edge

    model, reference = pair(device)
    flat = FlatParams(model.parameters())
    calls = []
    for module in (model, reference):
        node = get_gradient_edge(module.trunk.weight).node
        node.register_prehook(lambda grad_outputs, module=module: calls.append(module))
        del node  # the last reference: the node and its hook go
    x = torch.randn(4, 5, device=device, dtype=torch.float64)
    model(x, use_sometimes=True).backward()
    reference(x, use_sometimes=True).backward()
    assert calls == []
    same_grads(model, reference)
    assert all(in_slot(flat, p) for p in model.parameters() if p.grad is not None)


def test_backward_with_inputs_accumulates_those_and_autograd_grad_announces_nothing(device):
    """The gradient hook acts only where autograd accumulates: ``backward(inputs=...)`` into the named leaves,
    ``torch.autograd.grad`` into none (and a data-parallel receiver hears of no parameter)."""
    model, reference = pair(device)
    flat = FlatParams(model.parameters())
    heard = []
    flat.set_grad_receiver(heard.append)
    x = torch.randn(4, 5, device=device, dtype=torch.float64)
    torch.autograd.grad(model(x, use_sometimes=True), [model.trunk.weight, model.head.bias])
    assert heard == [] and all(p.grad is None for p in model.parameters())
    named = [model.trunk.weight, model.head.bias]
    model(x, use_sometimes=True).backward(inputs=named)
    reference(x, use_sometimes=True).backward(inputs=[reference.trunk.weight, reference.head.bias])
    same_grads(model, reference)
    assert {id(p) for p in heard} == {id(p) for p in named} and len(heard) == 2
    assert all(in_slot(flat, p) for p in named)
    flat.set_grad_receiver(None)


OPTIMIZERS = [
    (FusedSGD, torch.optim.SGD, dict(lr=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05)),
    (FusedMomentum, torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.1, weight_decay=0.05)),
    (FusedAdam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.05, amsgrad=True)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
]

# Per step: (zero_grad set_to_none, backward passes (use_sometimes each), clip). A head without a gradient
# must be skipped (no momentum, no weight decay, no state created), as torch's optimizers skip it.
SCHEDULE = [
    (True, [False], None),
    (True, [True, False], 0.5),  # accumulation over two backwards; clipped
    (False, [False], None),  # zeros kept: the head's gradient is a zero tensor, updated (decayed) as in torch
    (True, [False], 0.05),
    (True, [True], None),
]


@pytest.mark.parametrize("fused_cls,torch_cls,options", OPTIMIZERS,
                         ids=["sgd", "sgd_nesterov_wd", "momentum_dampening_wd", "adam_amsgrad_wd", "adamw"])
def test_none_semantics_and_steps_match_torch_for_every_optimizer(fused_cls, torch_cls, options, device):
    model, reference = pair(device)
    fused = fused_cls(model.parameters(), **options)
    theirs = torch_cls(reference.parameters(), foreach=False, **options)
    torch.manual_seed(1)
    for set_to_none, passes, clip in SCHEDULE:
        fused.zero_grad(set_to_none=set_to_none)
        theirs.zero_grad(set_to_none=set_to_none)
        same_grads(model, reference)
        for use_sometimes in passes:
            x = torch.randn(4, 5, device=device, dtype=torch.float64)
            model(x, use_sometimes).backward()
            reference(x, use_sometimes).backward()
        same_grads(model, reference)
        if clip is not None:
            torch.testing.assert_close(tfuse.optim.clip_grad_norm_(fused, clip),
                                       torch.nn.utils.clip_grad_norm_(reference.parameters(), clip), **TIGHT)
            same_grads(model, reference)
        fused.step()
        theirs.step()
        for (name, mine), other in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(mine, other, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
            assert (mine in fused.state and bool(fused.state[mine])) == bool(theirs.state.get(other)), name
    assert model.never.weight.grad is None and not fused.state.get(model.never.weight)


def test_grad_scaler_with_a_parameter_that_gets_no_gradient(device):
    model, reference = pair(device)
    fused = FusedAdam(model.parameters(), lr=0.01, weight_decay=0.05)
    theirs = torch.optim.Adam(reference.parameters(), lr=0.01, weight_decay=0.05, foreach=False)
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0**8, growth_interval=1) for _ in range(2)]
    for step in range(4):
        x = torch.randn(4, 5, device=device, dtype=torch.float64)
        for net, opt, scaler in ((model, fused, scalers[0]), (reference, theirs, scalers[1])):
            opt.zero_grad()
            scaler.scale(net(x, use_sometimes=step == 2)).backward()
            if step == 1:  # an overflow: both skip the step and lower the scale
                net.trunk.weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
        same_grads(model, reference)
        for opt, scaler in ((fused, scalers[0]), (theirs, scalers[1])):
            scaler.step(opt)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for mine, other in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, other, **TIGHT)


def test_a_slot_that_may_hold_old_values_is_zeroed_before_autograd_adds_into_it(device):
    model, reference = pair(device)
    flat = FlatParams(model.parameters())
    x = torch.randn(4, 5, device=device, dtype=torch.float64)

    def both(use_sometimes: bool = True) -> None:
        model(x, use_sometimes).backward()
        reference(x, use_sometimes).backward()

    both()
    # Foreign zero_grad (torch's, through the Module): grads None, the buffer not filled. With no gradient
    # left in the buffer, the first parameter to get one fills the whole buffer once; nothing is copied.
    model.zero_grad()
    reference.zero_grad()
    with CountOps() as ops:
        both()
    assert ops.counts["zero_"] == 1 and ops.counts["copy_"] == 0, ops.counts
    same_grads(model, reference)
    # Some gradients still live: only the slots that get a new gradient are zeroed, one by one.
    model.head.weight.grad = None
    model.head.bias.grad = None
    reference.head.weight.grad = None
    reference.head.bias.grad = None
    with CountOps() as ops:
        both()
    assert ops.counts["zero_"] == 2 and ops.counts["copy_"] == 0, ops.counts
    same_grads(model, reference)
    # A slot handed out by grad_view() and written: its parameter's next gradient does not see what was written.
    flat.zero_grad()
    reference.zero_grad()
    model.trunk.bias.grad = flat.grad_view(model.trunk.bias)
    model.trunk.bias.grad.fill_(5.0)
    model.trunk.bias.grad = None
    both()
    same_grads(model, reference)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_hand_set_gradients_and_create_graph_stay_outside_until_synced(device):
    model, reference = pair(device)
    flat = FlatParams(model.parameters())
    x = torch.randn(4, 5, device=device, dtype=torch.float64)
    # A gradient set by hand: autograd accumulates into it, as in torch; sync_grads brings it into its slot.
    hand = torch.full_like(model.trunk.weight, 0.5)
    model.trunk.weight.grad = hand
    reference.trunk.weight.grad = hand.clone()
    model(x, True).backward()
    reference(x, True).backward()
    assert model.trunk.weight.grad is hand
    same_grads(model, reference)
    flat.sync_grads()
    assert all(in_slot(flat, p) for p in model.parameters() if p.grad is not None)
    same_grads(model, reference)
    # create_graph=True: autograd accumulates out of place (grad mode on), the gradients keep their graph;
    # whether .grad was None or the (zeroed) view before.
    for set_to_none in (True, False):
        flat.zero_grad(set_to_none)
        reference.zero_grad(set_to_none)
        assert all(in_slot(flat, p) for p in model.parameters() if p.grad is not None)
        model(x, True).backward(create_graph=True)
        reference(x, True).backward(create_graph=True)
        same_grads(model, reference)
        assert model.trunk.weight.grad.requires_grad and not in_slot(flat, model.trunk.weight)
        penalties = [sum(p.grad.pow(2).sum() for p in net.parameters() if p.grad is not None)
                     for net in (model, reference)]
        first = torch.autograd.grad(penalties[0], model.trunk.weight)[0]
        torch.testing.assert_close(first, torch.autograd.grad(penalties[1], reference.trunk.weight)[0], **TIGHT)
        flat.sync_grads()  # (a fused optimizer's step does this) copies them in, detached
        assert all(in_slot(flat, p) and not p.grad.requires_grad for p in model.parameters() if p.grad is not None)
        same_grads(model, reference)
        for p in reference.parameters():
            if p.grad is not None:
                p.grad = p.grad.detach()  # break create_graph's reference cycles (ours were synced: detached)


def test_freezing_and_unfreezing_lay_out_again_with_none_semantics_kept(device):
    model, reference = pair(device)
    for net in (model, reference):
        net.head.requires_grad_(False)
    fused = FusedMomentum(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05, foreach=False)
    for step in range(4):
        if step == 2:
            for net in (model, reference):
                net.head.requires_grad_(True)  # the next step lays the buffers out again, gradients kept
        fused.zero_grad()
        theirs.zero_grad()
        x = torch.randn(4, 5, device=device, dtype=torch.float64)
        model(x, step % 2 == 1).backward()
        reference(x, step % 2 == 1).backward()
        same_grads(model, reference)
        fused.step()
        theirs.step()
        same_grads(model, reference)
        for mine, other in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, other, **TIGHT)
    flat = fused.flat_params[0]
    assert flat.layout_version == 2 and in_slot(flat, model.head.weight)
    # Frozen again, then unfrozen with a plain gradient: zero_grad lays out again and resets it, as torch's.
    model.head.requires_grad_(False)
    flat.sync_grads()
    model.head.requires_grad_(True)
    model.head.weight.grad = torch.ones_like(model.head.weight)
    fused.zero_grad()
    assert flat.layout_version == 4 and all(p.grad is None for p in model.parameters())


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.skipif(not (ROOT / "benchmarks" / "grad_path.py").is_file(), reason="needs the source tree")
def test_grad_path_benchmark_times_every_mode():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # benchmarks/ lives at the repository root
    from benchmarks import grad_path

    rows = grad_path.measure(1)
    modes = [row["mode"] for row in rows]
    assert modes[0].startswith("plain") and "torch DDP" in modes and sum("FusedDataParallel" in m for m in modes) == 2
    for row in rows:
        assert row["gradients"] == 2 * grad_path.LAYERS and row["samples"] == grad_path.STEPS_PER_ROUND
        assert 0 < row["backward_ms"] <= row["step_ms"] and row["step_q1"] <= row["step_ms"] <= row["step_q3"]
    assert rows[0]["extra_us_per_gradient"] == 0
    assert grad_path.markdown(rows).startswith("| mode |")
    assert not torch.distributed.is_initialized()  # its world-size-1 group is gone again
