"""fuse_model is never silently wrong: each pattern that made it so on real code (timm, torchvision, hostile
use), reproduced by a small model in tests/fusion_hazards.py and checked against the unfused model with every
invariant of tests/fusion_invariants.py, fused in train and in eval mode."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import tfuse
from fusion_hazards import (
    Aliased,
    AuxNet,
    DropPathBlock,
    HalfTraceable,
    Hooked,
    NormActNet,
    OutOfOrder,
    ShapeChecked,
    Sliced,
)
from fusion_invariants import assert_fuse_invariants, assert_same_over_modes, assert_untouched, double, snapshot
from tfuse import fuse_model
from tfuse.nn import FusedBatchNormAct2d


@pytest.fixture(autouse=True)
def torch_path():
    """The fused layers on the PyTorch path: these tests check the rewrite (the kernels have their own)."""
    with tfuse.use_backend("torch"):
        yield


MODES = ["train", "eval"]


@pytest.mark.parametrize("fuse_in", MODES)
def test_timm_style_norm_act_is_fused_and_a_subclass_of_ones_own_is_not(fuse_in):
    model, fused, report = assert_fuse_invariants(NormActNet, (2, 3, 5, 5), fuse_in=fuse_in)
    assert report.counts() == {"BatchNormAct2d(ReLU)": 1, "BatchNormAct2d(SiLU)": 1}
    assert isinstance(fused.bn1, FusedBatchNormAct2d) and fused.bn1.act == "relu" and fused.bn2.act == "silu"
    assert {s.where for s in report.skipped} == {"bn3"}
    assert "a subclass of nn.BatchNorm2d" in report.skipped[0].reason
    # The num_batches_tracked entries stay (timm's norm layers lost them once): the same keys as the original.
    assert "bn1.num_batches_tracked" in fused.state_dict()


@pytest.mark.parametrize("fuse_in", MODES)
def test_stochastic_depth_and_functional_dropout_follow_the_mode(fuse_in):
    model, fused, report = assert_fuse_invariants(DropPathBlock, (4, 6, 5, 5), fuse_in=fuse_in)
    assert report.counts() == {"BatchNorm2d+ReLU": 1}
    assert fused.eval_graph is not None  # the forward differs between the modes: one graph each


@pytest.mark.parametrize("fuse_in", MODES)
def test_an_auxiliary_output_returned_in_training_only(fuse_in):
    model, fused, report = assert_fuse_invariants(AuxNet, (2, 3, 5, 5), fuse_in=fuse_in)
    assert report.counts() == {"BatchNorm2d+ReLU": 1, "BatchNorm2d+ReLU6": 1}
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    assert isinstance(fused.train()(x), tuple) and isinstance(fused.eval()(x), torch.Tensor)


def test_mixed_modes_in_a_two_graph_model_are_an_error_not_a_choice():
    _, fused, _ = assert_fuse_invariants(DropPathBlock, (4, 6, 5, 5))
    fused.train()
    fused.drop_path.eval()  # its code was traced into the graphs, which follow the whole model's mode
    with pytest.raises(RuntimeError, match="submodule 'drop_path' is not"):
        fused(torch.randn(4, 6, 5, 5, dtype=torch.float64))


@pytest.mark.parametrize("fuse_in", MODES)
def test_order_keys_and_persistence_are_the_originals(fuse_in):
    model, fused, report = assert_fuse_invariants(OutOfOrder, (5, 4), fuse_in=fuse_in)
    assert report.counts() == {"BatchNorm1d+ReLU": 1, "Linear+GELU": 1}  # through the nn.Identity
    assert [n for n, _ in fused.named_parameters()][:2] == ["head.weight", "head.bias"]  # defined first
    assert "scale" not in fused.state_dict() and "scale" in dict(fused.named_buffers())
    # An optimizer checkpoint of the original is a checkpoint of the fused model (state dicts are positional).
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    sgd.step()
    again = torch.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9)
    again.load_state_dict(sgd.state_dict())
    for param in fused.parameters():
        assert torch.equal(again.state[param]["momentum_buffer"], sgd.state[param]["momentum_buffer"])


def test_a_forward_that_fails_to_trace_half_way_leaves_nothing_behind():
    model = double(HalfTraceable())
    before = snapshot(model)
    fused, report = fuse_model(model)
    assert_untouched(model, before)  # no counted call, no Proxy in the cache
    assert model.bias_cache == {} and int(model.calls) == 0
    assert report.method == "structural" and report.counts() == {"BatchNorm1d+ReLU": 1}
    again, _ = fuse_model(model)  # a second fuse works (a Proxy left in the cache once broke it)
    assert_same_over_modes(model, again, (5, 4))
    assert_same_over_modes(model, fused, (5, 4))


def test_wrong_example_inputs_are_an_error_naming_their_shapes():
    with pytest.raises(ValueError, match=r"forward failed on example_inputs \(tensor of shape \[5, 3\]"):
        fuse_model(ShapeChecked(), example_inputs=torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"tensor of shape \[5, 3\]"):  # also where the forward does not trace
        fuse_model(HalfTraceable(), example_inputs=torch.randn(5, 3))
    fused, report = fuse_model(ShapeChecked(), example_inputs=torch.randn(5, 4))
    assert report.counts() == {"BatchNorm1d+ReLU": 1}


def test_slices_indices_and_parts_of_containers_in_an_untraced_forward_are_left_alone():
    model, fused, report = assert_fuse_invariants(Sliced, (5, 4))
    assert report.method == "structural"
    assert report.counts() == {"BatchNorm1d+ReLU": 1}  # the tail, which the forward calls whole
    assert {s.where for s in report.skipped} == {"features", "block"}
    assert all("calling it whole" in s.reason for s in report.skipped)


@pytest.mark.parametrize("fuse_in", MODES)
def test_in_place_adds_into_a_tensor_read_elsewhere_are_not_fused(fuse_in):
    model, fused, report = assert_fuse_invariants(Aliased, (2, 3, 5, 5), fuse_in=fuse_in, example=True)
    assert report.fused == []
    assert sum("added in place" in s.reason for s in report.skipped) == 2


HOOKS = ["forward", "forward_pre", "full_backward", "full_backward_pre"]


def _register(module: nn.Module, kind: str, calls: list) -> None:
    """A hook of ``kind`` that counts its calls and changes what it sees (so a skipped hook would show)."""
    if kind == "forward":
        module.register_forward_hook(lambda m, args, out: (calls.append(kind), out * 1.5)[1])
    elif kind == "forward_pre":
        module.register_forward_pre_hook(lambda m, args: (calls.append(kind), (args[0] - 0.25,))[1])
    elif kind == "full_backward":
        module.register_full_backward_hook(lambda m, gin, gout: (calls.append(kind), tuple(g * 2 for g in gin))[1])
    else:
        module.register_full_backward_pre_hook(lambda m, gout: (calls.append(kind), tuple(g * 3 for g in gout))[1])


@pytest.mark.parametrize("where", ["bn", "relu", "block", "block.1", "block.2", ""])
@pytest.mark.parametrize("kind", HOOKS)
def test_every_kind_of_hook_still_runs(kind, where):
    model = double(Hooked())
    calls: list = []
    _register(model.get_submodule(where), kind, calls)
    fused, report = fuse_model(model)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    for train in (True, False):
        reference_calls = len(calls)
        assert_same_over_modes(model, fused, (2, 3, 5, 5), modes=("train" if train else "eval",))
        ran = len(calls) - reference_calls
        assert ran > 0 and ran % 2 == 0, (kind, where, ran)  # as often in the fused model as in the original
    if where in ("bn", "relu"):  # the pair is left alone, and reported
        assert any(s.where == "bn" and "hook" in s.reason for s in report.skipped)
    if where.startswith("block."):
        assert any(s.where == "block.1" and "hook" in s.reason for s in report.skipped)
    assert report.counts().get("BatchNorm2d+ReLU", 0) >= 1  # bn2 + F.relu has no hook: still fused
    del x


def test_nothing_to_fuse_returns_the_model_itself():
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=1))  # no activation tfuse fuses
    fused, report = fuse_model(model)
    assert fused is model and report.fused == [] and "nothing fused" in report.note


@pytest.mark.parametrize("make", [DropPathBlock, OutOfOrder, NormActNet], ids=lambda m: m.__name__)
def test_fused_models_copy_and_pickle_with_their_graphs(make):
    model, fused, _ = assert_fuse_invariants(make, (4, 6, 5, 5) if make is DropPathBlock else
                                             ((5, 4) if make is OutOfOrder else (2, 3, 5, 5)))
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused)), loaded):
        assert list(other.state_dict()) == list(fused.state_dict())
        assert (other.eval_graph is None) == (fused.eval_graph is None)
        shape = next(iter(_shapes(make)))
        assert_same_over_modes(fused, other, shape)


def _shapes(make):
    return {DropPathBlock: [(4, 6, 5, 5)], OutOfOrder: [(5, 4)], NormActNet: [(2, 3, 5, 5)]}[make]


def test_the_fused_model_leaves_the_originals_modes_and_hooks_alone():
    model = double(Hooked()).train()
    fused, _ = fuse_model(model)
    fused.eval()
    fused.conv.register_forward_hook(lambda *args: None)
    assert all(m.training for m in model.modules())
    assert not model.conv._forward_hooks
