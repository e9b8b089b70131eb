"""tfuse.fuse_model: patterns found in what the forward computes, the report, and nothing broken.

Models written here in the styles of ResNet (basic and bottleneck blocks, a
reused ReLU module, a downsample computed after the second norm), MobileNetV2
(BN + ReLU6, and ReLU6 -> depthwise conv where no norm precedes it),
EfficientNet (SiLU -> depthwise conv) and a transformer MLP block. Each fused
model is compared with the original in float64: outputs and gradients, in
train and eval mode, and state dicts loaded both ways.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import tfuse
from tfuse import FusionStrategy, fuse_model
from tfuse.nn import (
    BatchNormBoundDepthwiseConv2d,
    FusedActDepthwiseConv2d,
    FusedBatchNormAct1d,
    FusedBatchNormAct2d,
    FusedLinear,
)

from fusion_models import (
    EfficientNetish,
    FunctionalDepthwise,
    MLPBlock,
    MobileNetish,
    MobileNetLite,
    NotFusable,
    ResNetish,
    Reused,
    Untraceable,
    UntraceableDepthwise,
    double,
)


CASES = {
    "resnet": (ResNetish, (4, 3, 6, 6)),
    "mobilenet": (MobileNetish, (4, 3, 6, 6)),
    "mlp": (MLPBlock, (6, 16)),
}


def assert_same_computation(original: nn.Module, fused: nn.Module, shape, train: bool) -> None:
    """Outputs, gradients of parameters and input, and buffers after the call: equal within float64 rounding."""
    reference, candidate = copy.deepcopy(original), copy.deepcopy(fused)
    reference.train(train)
    candidate.train(train)
    x = torch.randn(shape, dtype=torch.float64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outputs = [reference(xs[0]), candidate(xs[1])]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-12)
    dy = torch.randn_like(outputs[0])
    for out in outputs:
        out.backward(dy)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-9, atol=1e-11)
    theirs = dict(reference.named_parameters())
    for name, param in candidate.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")
    theirs = dict(reference.named_buffers())
    for name, buffer in candidate.named_buffers():
        torch.testing.assert_close(buffer, theirs[name], rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def assert_fused_like_the_original(model: nn.Module, fused: nn.Module, shape) -> None:
    """The same computation in train and eval mode, state dicts loading both ways, the original untouched."""
    for train in (True, False):
        assert_same_computation(model, fused, shape, train)
    # Checkpoints load both ways, strictly (same keys, same shapes).
    fused.load_state_dict(copy.deepcopy(model.state_dict()))
    model.load_state_dict(copy.deepcopy(fused.state_dict()))
    # The original is untouched: its layers are torch's; the fused model shares its parameters.
    assert not any(type(m).__module__.startswith("tfuse") for m in model.modules())
    assert {id(p) for p in fused.parameters()} == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("with_shapes", [False, True], ids=["no-shapes", "example-inputs"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_models_compute_what_the_originals_do(case, with_shapes):
    make, shape = CASES[case]
    model = double(make())
    example = torch.randn(shape, dtype=torch.float64) if with_shapes else None
    fused, report = fuse_model(model, example_inputs=example)
    assert report.method == "fx" and report.fused
    assert_fused_like_the_original(model, fused, shape)


def test_resnet_report_names_every_fusion():
    model = ResNetish()
    fused, report = fuse_model(model, example_inputs=torch.randn(2, 3, 6, 6))
    # stem, 2 x bn1 of the basic blocks, 2 x (bn2 + residual), bottleneck bn1, bn2, bn3 + residual (left operand)
    assert report.counts() == {"BatchNorm2d+ReLU": 8}
    assert sum(f.residual for f in report.fused) == 3
    assert str(report) == "fused 8 BatchNorm2d+ReLU (3 with residual) (torch.fx)"
    assert not report.skipped
    for name in ("stem.1", "layer1.0.bn1", "layer1.0.bn2", "layer1.1.bn2", "layer1.2.bn3"):
        assert isinstance(fused.get_submodule(name), FusedBatchNormAct2d), name
    assert type(fused.get_submodule("layer1.1.downsample.1")) is nn.BatchNorm2d  # followed by the add, not an act
    assert fused.get_submodule("layer1.1.bn2").act == "relu"


def test_without_shapes_the_residual_patterns_are_reported_not_guessed():
    _, report = fuse_model(ResNetish())
    assert report.counts() == {"BatchNorm2d+ReLU": 5}
    reasons = {s.where: s.reason for s in report.skipped}
    assert set(reasons) == {"layer1.0.bn2", "layer1.1.bn2", "layer1.2.bn3"}
    assert all("needs example_inputs" in r for r in reasons.values())


def test_mobilenet_relu6_and_hardswish_are_fused():
    model = MobileNetish()
    fused, report = fuse_model(model)
    assert report.counts() == {
        "BatchNorm2d+ReLU6+depthwise Conv2d": 1, "BatchNorm2d+ReLU6": 1, "BatchNorm2d+Hardswish": 1,
    }
    # BN -> ReLU6 -> depthwise conv: the convolution normalises and activates its input as it loads; the batch
    # norm stays (uncalled) under its name, so the state dict keeps every key.
    conv = fused.get_submodule("features.3")
    assert type(conv) is BatchNormBoundDepthwiseConv2d and conv.act_in == "relu6"
    assert conv.batch_norm is fused.get_submodule("features.1") and type(conv.batch_norm) is nn.BatchNorm2d
    assert list(fused.state_dict()) == list(model.state_dict())
    assert [fused.get_submodule(f"features.{i}").act for i in (4, 9)] == ["relu6", "hardswish"]
    assert type(fused.get_submodule("features.7")) is nn.BatchNorm2d  # a linear bottleneck: no activation
    assert not report.skipped
    assert_same_computation(double(model), double(fused), (3, 3, 8, 8), train=True)
    assert_same_computation(double(model), double(fused), (3, 3, 8, 8), train=False)
    # Without that fusion, the batch norm keeps its activation and the convolution stays torch's.
    fused, report = fuse_model(model, FusionStrategy(fuse_bn_act_depthwise_conv=False))
    assert report.counts() == {"BatchNorm2d+ReLU6": 2, "BatchNorm2d+Hardswish": 1}
    assert [fused.get_submodule(f"features.{i}").act for i in (1, 4, 9)] == ["relu6", "relu6", "hardswish"]
    assert type(fused.get_submodule("features.3")) is nn.Conv2d
    assert not report.skipped


def test_activations_without_a_kernel_and_other_parameters_are_skipped_with_their_reason():
    model = nn.Sequential(
        nn.Linear(4, 4), nn.SELU(), nn.Linear(4, 4), nn.ELU(alpha=0.5), nn.BatchNorm1d(4), nn.Hardtanh(-2.0, 2.0),
        nn.Linear(4, 4), nn.Hardtanh(0.0, 6.0), nn.Linear(4, 4), nn.ELU(),
    )
    fused, report = fuse_model(model)
    assert report.counts() == {"Linear+ReLU6": 1, "Linear+ELU": 1}  # Hardtanh(0, 6) is ReLU6; ELU at alpha 1
    assert {s.where: s.reason for s in report.skipped} == {
        "0": "is followed by SELU, which has no fused kernel in tfuse yet",
        "2": "is followed by ELU(alpha=0.5), which has no fused kernel in tfuse yet",
        "4": "is followed by Hardtanh(min_val=-2.0, max_val=2.0), which has no fused kernel in tfuse yet",
    }
    assert_same_computation(double(model), double(fused), (6, 4), train=True)


def test_mlp_block_fuses_linear_gelu_batch_norm_silu_and_the_bias_add():
    model = MLPBlock()
    fused, report = fuse_model(model, example_inputs=torch.randn(6, 16))
    assert report.counts() == {"Linear+GELU(tanh)": 1, "BatchNorm1d+SiLU": 1, "add+LeakyReLU": 1}
    assert isinstance(fused.up, FusedLinear) and fused.up.act == "gelu_tanh"
    assert isinstance(fused.head_norm, FusedBatchNormAct1d) and fused.head_norm.act == "silu"
    calls = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert tfuse.functional.add_act in calls


def test_reused_modules_and_branches_are_left_alone_and_reported():
    model = double(Reused())
    fused, report = fuse_model(model)
    assert report.fused == []
    reasons = {s.where: s.reason for s in report.skipped}
    assert reasons["bn"] == "is used 2 times (one module called at several places)"
    assert reasons["lin"].startswith("has its output used besides the activation")
    assert "skipped 3: bn is used 2 times" in str(report)  # once per activation that follows it, then the branch
    assert_same_computation(model, fused, (5, 4), train=True)


def test_an_untraceable_forward_falls_back_to_sequential_neighbours():
    model = double(Untraceable())
    fused, report = fuse_model(model)
    assert report.method == "structural"
    assert "torch.fx could not trace the forward" in report.note
    assert report.counts() == {"BatchNorm1d+ReLU": 1, "Linear+GELU": 1}
    assert [s.where for s in report.skipped] == ["other.0"]
    assert type(fused) is Untraceable and isinstance(fused.block[1], FusedBatchNormAct1d)
    assert isinstance(fused.block[2], nn.Identity) and isinstance(fused.block[3], FusedLinear)
    assert isinstance(model.block[1], nn.BatchNorm1d) and isinstance(model.block[2], nn.ReLU)  # original untouched
    for train in (True, False):
        assert_same_computation(model, fused, (6, 4), train)
    fused.load_state_dict(model.state_dict())
    model.load_state_dict(fused.state_dict())
    assert "(nn.Sequential neighbours; the forward did not trace)" in str(report)


def test_strategy_switches_reach_the_rewrite():
    model = MLPBlock()
    example = torch.randn(6, 16)
    _, report = fuse_model(model, FusionStrategy(fuse_linear_act=False), example)
    assert "Linear+GELU(tanh)" not in report.counts()
    _, report = fuse_model(model, FusionStrategy(fuse_bn_act=False, fuse_add_act=False), example)
    assert report.counts() == {"Linear+GELU(tanh)": 1}
    _, report = fuse_model(ResNetish(), FusionStrategy(fuse_bn_add_act=False), torch.randn(2, 3, 6, 6))
    assert report.counts() == {"BatchNorm2d+ReLU": 5} and sum(f.residual for f in report.fused) == 0


def test_training_the_fused_model_with_a_fused_optimizer_follows_torch():
    torch.manual_seed(0)
    model = double(ResNetish())
    reference = copy.deepcopy(model)
    fused, _ = fuse_model(model, example_inputs=torch.randn(2, 3, 6, 6, dtype=torch.float64))
    optimizer = tfuse.optim.FusedAdam(fused.parameters(), lr=1e-2)
    torch_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
        for net, opt in ((fused, optimizer), (reference, torch_optimizer)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):  # shared with fused
        torch.testing.assert_close(ours, theirs, rtol=1e-8, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_the_fused_model_copies_and_pickles():
    fused, _ = fuse_model(ResNetish(), example_inputs=torch.randn(2, 3, 6, 6))
    copied = copy.deepcopy(fused)
    x = torch.randn(2, 3, 6, 6)
    fused.eval()
    copied.eval()
    torch.testing.assert_close(copied(x), fused(x))
    assert isinstance(copied, fx.GraphModule)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        fuse_model("resnet")
    with pytest.raises(TypeError, match="strategy must be a tfuse.FusionStrategy, got dict"):
        fuse_model(nn.Linear(2, 2), {"fuse_bn_act": True})
    with pytest.raises(TypeError, match="FusionStrategy.fuse_bn_act must be a bool, got 1"):
        FusionStrategy(fuse_bn_act=1)
    with pytest.raises(TypeError, match="FusionStrategy.fuse_relu_depthwise_conv must be a bool, got 'no'"):
        FusionStrategy(fuse_relu_depthwise_conv="no")


# ---------------------------------------------------------------- activation -> depthwise convolution


@pytest.fixture
def torch_path():
    """The fused depthwise convolution on the PyTorch path (Triton's interpreter is slow; the kernels have
    their own tests): these tests check the rewrite."""
    with tfuse.use_backend("torch"):
        yield


DEPTHWISE_CASES = {
    "mobilenet-lite": (MobileNetLite, (3, 4, 6, 6), {"ReLU6+depthwise Conv2d": 1, "BatchNorm2d+ReLU6": 1}),
    "efficientnet": (
        EfficientNetish,
        (2, 3, 8, 8),
        {"SiLU+depthwise Conv2d": 1, "LeakyReLU+depthwise Conv2d": 1},
    ),
    "functional": (FunctionalDepthwise, (2, 6, 5, 5), {"ReLU+depthwise Conv2d": 2}),
}


@pytest.mark.parametrize("with_shapes", [False, True], ids=["no-shapes", "example-inputs"])
@pytest.mark.parametrize("case", list(DEPTHWISE_CASES))
def test_activations_fuse_into_the_depthwise_conv_after_them(case, with_shapes, torch_path):
    make, shape, counts = DEPTHWISE_CASES[case]
    model = double(make())
    example = torch.randn(shape, dtype=torch.float64) if with_shapes else None
    fused, report = fuse_model(model, example_inputs=example)
    # The same fusions with or without shapes: the add -> relu of "functional" goes to the convolution.
    assert report.method == "fx" and report.counts() == counts and not report.skipped
    convs = [m for m in fused.modules() if isinstance(m, FusedActDepthwiseConv2d)]
    assert len(convs) == sum(n for kind, n in counts.items() if kind.endswith("depthwise Conv2d"))
    assert_fused_like_the_original(model, fused, shape)


def test_the_depthwise_report_names_the_pair_and_the_modules_keep_their_names(torch_path):
    model = MobileNetLite()
    fused, report = fuse_model(model)
    assert str(report) == "fused 1 ReLU6+depthwise Conv2d, 1 BatchNorm2d+ReLU6 (torch.fx)"
    assert report.fused[0] == tfuse.fusion.Fused("ReLU6+depthwise Conv2d", ("act1", "dw"), "FusedActDepthwiseConv2d")
    assert isinstance(fused.dw, FusedActDepthwiseConv2d) and fused.dw.act_in == "relu6" and fused.dw.act_out is None
    assert fused.dw.weight is model.dw.weight and fused.dw.bias is None
    # The activation module stays (unused) under its name; the graph no longer calls it. (A copy of the
    # original's: the fused model's modules are its own, so that .eval() or a hook on it leaves the original be.)
    assert type(fused.act1) is nn.ReLU6 and fused.act1 is not model.act1 and "act1" in dict(fused.named_modules())
    assert "act1" not in [n.target for n in fused.graph.nodes if n.op == "call_module"]
    efficient, report = fuse_model(EfficientNetish())
    assert efficient.dw2.act_in == "leaky_relu" and efficient.dw2.negative_slope == 0.25
    assert [f.where for f in report.fused] == [("act", "dw1"), ("leaky_relu", "dw2")]


def test_bn_relu6_depthwise_keeps_the_batch_norm_fusion_unless_it_is_off(torch_path):
    model = double(MobileNetish())
    fused, report = fuse_model(model, FusionStrategy(fuse_bn_act=False))
    assert report.counts() == {"ReLU6+depthwise Conv2d": 1}  # the depthwise conv takes the ReLU6 after BN
    assert type(fused.get_submodule("features.1")) is nn.BatchNorm2d
    assert isinstance(fused.get_submodule("features.3"), FusedActDepthwiseConv2d)
    assert fused.get_submodule("features.3").act_in == "relu6"
    assert_fused_like_the_original(model, fused, (2, 3, 6, 6))


def test_the_strategy_switch_turns_the_depthwise_fusion_off():
    off = FusionStrategy(fuse_relu_depthwise_conv=False)
    fused, report = fuse_model(MobileNetLite(), off)
    assert report.counts() == {"BatchNorm2d+ReLU6": 1} and not report.skipped
    assert type(fused.dw) is nn.Conv2d
    _, report = fuse_model(FunctionalDepthwise(), off, torch.randn(2, 6, 5, 5))
    assert report.counts() == {"add+ReLU": 1}  # the add -> relu goes to tfuse.add_act instead
    fused, report = fuse_model(Untraceable(), off)  # the structural path too
    assert report.method == "structural" and "depthwise" not in str(report)


def test_convolutions_that_cannot_take_the_activation_are_left_alone_and_reported(torch_path):
    model = double(NotFusable())
    fused, report = fuse_model(model)
    assert report.counts() == {}
    reasons = {s.where: s.reason for s in report.skipped if not s.where.startswith("add")}
    assert reasons == {
        "branch": "follows ReLU, whose output is used besides the convolution (by add)",
        "grouped": "follows SiLU but is a grouped convolution (groups=2 for 4 channels), not a depthwise one",
        "multiplier": "follows Tanh but has depth multiplier 2 (out_channels=8, in_channels=4); the fused kernel "
        "needs 1",
        "reflect": "follows GELU but pads with padding_mode='reflect'; the fused kernel pads with zeros",
        "twice": "is used 2 times (one module called at several places)",
        "selu": "follows selu, which has no fused kernel in tfuse yet",
        "in_place": "follows an in-place ReLU on a tensor that may be read elsewhere (fusing would leave it "
        "unchanged)",
    }  # the dense convolution is no candidate: not reported
    assert not any(isinstance(m, FusedActDepthwiseConv2d) for m in fused.modules())
    assert "skipped" in str(report) and "branch follows ReLU" in str(report)
    assert_same_computation(model, fused, (2, 4, 5, 5), train=True)


def test_an_untraceable_forward_fuses_act_depthwise_neighbours(torch_path):
    model = double(UntraceableDepthwise())
    fused, report = fuse_model(model)
    assert report.method == "structural"
    assert report.counts() == {"ReLU6+depthwise Conv2d": 1, "BatchNorm2d+ReLU6": 1}
    assert report.fused[0].where == ("block.1", "block.2")
    assert [s.where for s in report.skipped] == ["head.1"]
    assert "in-place Hardswish" in report.skipped[0].reason
    assert isinstance(fused.block[1], nn.Identity) and fused.block[2].act_in == "relu6"
    assert isinstance(fused.block[3], FusedBatchNormAct2d) and type(fused.block[5]) is nn.Conv2d
    assert_fused_like_the_original(model, fused, (2, 4, 5, 5))
