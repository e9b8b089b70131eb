"""fuse_model: GroupNorm / LayerNorm -> activation into FusedGroupNormAct / FusedLayerNormAct.

Small models in the styles of a diffusion UNet residual block (Conv2d -> GroupNorm -> SiLU, and a ResNet-GN
residual add before the activation), a transformer-style MLP head (Linear -> LayerNorm -> GELU), a layer norm
over two trailing dimensions, and timm's norm + activation modules, emulated here (a class of timm's name
whose module path says timm, as the real one's does: the tests do not need timm). Each fused model is checked
against the original in float64 with every invariant of tests/fusion_invariants.py (outputs, input and
parameter gradients in train and eval mode, state-dict keys, parameter order and identity).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tfuse
from fusion_invariants import assert_fuse_invariants, assert_same_over_modes
from tfuse import FusionStrategy, fuse_model
from tfuse.nn import FusedGroupNormAct, FusedLayerNormAct


@pytest.fixture(autouse=True)
def torch_path():
    """The fused layers on the PyTorch path: these tests check the rewrite (the kernels have their own tests;
    one test below runs the Triton path)."""
    with tfuse.use_backend("torch"):
        yield


def prepare(model: nn.Module) -> nn.Module:
    """Float64, with every norm's affine parameters drawn away from ones and zeros (their gradients show)."""
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, (nn.GroupNorm, nn.LayerNorm)):
            for param in (module.weight, module.bias):
                if param is not None:
                    nn.init.uniform_(param, 0.5, 1.5)
    return model.double()


def invariants(make, shape, **kwargs):
    return assert_fuse_invariants(make, shape, prepare=prepare, **kwargs)


# ---------------------------------------------------------------- models


class ResBlock(nn.Module):
    """A diffusion UNet residual block (GroupNorm -> SiLU -> Conv2d twice, one SiLU module called twice, dropout
    between), then a ResNet-GN style norm -> residual add -> SiLU."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, c)
        self.act = nn.SiLU()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, c, bias=False)
        self.dropout = nn.Dropout(0.25)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.norm3 = nn.GroupNorm(4, c, affine=False)

    def forward(self, x):
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.act(self.norm3(h) + x)


class MLPHead(nn.Module):
    """Linear -> LayerNorm -> GELU (twice: the second norm without bias, tanh GELU as a function) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.ln1 = nn.LayerNorm(16)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(16, 16)
        self.ln2 = nn.LayerNorm(16, bias=False)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.gelu(self.ln1(self.fc1(x)))
        return self.fc3(F.gelu(self.ln2(self.fc2(h)), approximate="tanh"))


class TrailingDims(nn.Module):
    """LayerNorm over the two trailing dimensions of an NCHW tensor, -> LeakyReLU(0.2); one without affine
    parameters -> relu as a tensor method."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.ln = nn.LayerNorm((4, 5))
        self.leaky = nn.LeakyReLU(0.2)
        self.plain = nn.LayerNorm([4, 5], elementwise_affine=False)

    def forward(self, x):
        return self.plain(self.leaky(self.ln(self.conv(x)))).relu()


def _timm(cls: type) -> type:
    cls.__module__ = "timm.layers.norm_act"
    return cls


@_timm
class GroupNormAct(nn.GroupNorm):
    """timm's GroupNormAct: F.group_norm, then ``drop``, then ``act`` (channels first in its constructor)."""

    def __init__(self, channels: int, groups: int, act: type[nn.Module] = nn.ReLU, drop: nn.Module | None = None,
                 fast: bool = False) -> None:  # fmt: skip
        super().__init__(groups, channels)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act()
        self._fast_norm = fast

    def forward(self, x):
        return self.act(self.drop(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)))


@_timm
class GroupNorm1Act(GroupNormAct):
    """timm's GroupNorm1Act: GroupNormAct with one group."""

    def __init__(self, channels: int, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__(channels, 1, act)


@_timm
class LayerNormAct(nn.LayerNorm):
    """timm's LayerNormAct: F.layer_norm, then ``drop``, then ``act``."""

    def __init__(self, shape, act: type[nn.Module] = nn.ReLU) -> None:  # type: ignore[no-untyped-def]
        super().__init__(shape)
        self.drop = nn.Identity()
        self.act = act()
        self._fast_norm = False

    def forward(self, x):
        return self.act(self.drop(F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)))


@_timm
class LayerNormAct2d(LayerNormAct):
    """timm's LayerNormAct2d: a layer norm over the channels of an NCHW tensor (permuted there and back)."""

    def forward(self, x):
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return self.act(self.drop(x.permute(0, 3, 1, 2)))


class LocalGroupNormAct(GroupNormAct):
    """A class of one's own computing something else; renamed below to timm's name but not in timm's package."""

    def forward(self, x):
        return super().forward(x) * 2.0


LocalGroupNormAct.__name__ = LocalGroupNormAct.__qualname__ = "GroupNormAct"
LocalGroupNormAct.__module__ = __name__


class TimmNormActNet(nn.Module):
    """timm-style conv -> norm-act blocks: two that fuse, and the forms that do not."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = GroupNormAct(8, 4, nn.SiLU)  # fuses
        self.gn1 = GroupNorm1Act(8, nn.Hardswish)  # fuses
        self.ln = LayerNormAct(8, nn.GELU)  # fuses (over the channels, permuted by the forward)
        self.ln2d = LayerNormAct2d(8, nn.ReLU)  # reported: a permuting layer norm
        self.fast = GroupNormAct(8, 2, nn.ReLU, fast=True)  # reported: timm's fast norm
        self.selu = GroupNormAct(8, 2, nn.SELU)  # reported: no kernel for SELU
        self.dropped = GroupNormAct(8, 2, nn.ReLU, drop=nn.Dropout(0.25))  # a drop that does something: left
        self.local = LocalGroupNormAct(8, 2, nn.ReLU)  # timm's name, not timm's package: left
        self.plain = GroupNormAct(8, 4, nn.Identity)  # no activation: a group norm, left

    def forward(self, x):
        h = self.gn1(self.gn(self.conv(x)))
        h = self.ln(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.plain(self.local(self.dropped(self.selu(self.fast(self.ln2d(h))))))


class MyGroupNorm(nn.GroupNorm):
    """A GroupNorm subclass of one's own (computing something else): never fused."""

    def forward(self, x):
        return super().forward(x) + 1.0


class LayerNorm2d(nn.LayerNorm):
    """torchvision's convnext.LayerNorm2d: a layer norm over the channels of an NCHW tensor, by permuting."""

    def forward(self, x):
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


LayerNorm2d.__module__ = "torchvision.models.convnext"


class Subclassed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.gn = MyGroupNorm(2, 4)
        self.ln2d = LayerNorm2d(4)

    def forward(self, x):
        return F.gelu(self.ln2d(F.silu(self.gn(self.conv(x)))))


class Untraceable(nn.Module):
    """A forward torch.fx cannot trace, calling its nn.Sequential blocks whole."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: does not trace
            x = x * 0.5
        return self.head(self.conv(x))


# ---------------------------------------------------------------- tests

MODES = ["train", "eval"]


@pytest.mark.parametrize("fuse_in", MODES)
def test_unet_block_group_norm_silu_with_and_without_a_residual(fuse_in):
    model, fused, report = invariants(ResBlock, (2, 8, 4, 4), fuse_in=fuse_in, example=True)
    assert report.method == "fx" and not report.skipped
    assert report.counts() == {"GroupNorm+SiLU": 3}
    assert [(f.where, f.replacement, f.residual) for f in report.fused] == [
        (("norm1", "act"), "FusedGroupNormAct", False),
        (("norm2", "silu"), "FusedGroupNormAct", False),
        (("norm3", "add", "act_1"), "FusedGroupNormAct", True),
    ]
    assert str(report) == "fused 3 GroupNorm+SiLU (1 with residual) (torch.fx)"
    for name in ("norm1", "norm2", "norm3"):
        layer, original = fused.get_submodule(name), model.get_submodule(name)
        assert type(layer) is FusedGroupNormAct and layer.act == "silu", name
        assert layer.weight is original.weight and layer.bias is original.bias, name  # shared, not copies
        assert layer.training == original.training
    assert fused.norm2.bias is None and fused.norm3.weight is None
    assert not any(n.op == "call_module" and n.target == "act" for n in fused.graph.nodes)


def test_a_residual_needs_example_inputs():
    fused, report = fuse_model(prepare(ResBlock()))
    assert report.counts() == {"GroupNorm+SiLU": 2}
    assert [(s.where, s.reason) for s in report.skipped] == [
        ("norm3", "is followed by an add and an activation: fusing them needs example_inputs (shapes)")
    ]
    assert type(fused.norm3) is nn.GroupNorm


@pytest.mark.parametrize("fuse_in", MODES)
def test_mlp_linear_layer_norm_gelu(fuse_in):
    model, fused, report = invariants(MLPHead, (5, 6), fuse_in=fuse_in)
    assert report.counts() == {"LayerNorm+GELU": 1, "LayerNorm+GELU(tanh)": 1} and not report.skipped
    assert type(fused.ln1) is FusedLayerNormAct and fused.ln1.act == "gelu"
    assert type(fused.ln2) is FusedLayerNormAct and fused.ln2.act == "gelu_tanh" and fused.ln2.bias is None
    assert type(fused.fc1) is nn.Linear  # followed by the norm, not an activation
    assert fused.ln1.weight is model.ln1.weight and fused.ln1.bias is model.ln1.bias


@pytest.mark.parametrize("fuse_in", MODES)
def test_layer_norm_over_two_trailing_dimensions(fuse_in):
    model, fused, report = invariants(TrailingDims, (2, 3, 4, 5), fuse_in=fuse_in)
    assert report.counts() == {"LayerNorm+LeakyReLU": 1, "LayerNorm+ReLU": 1} and not report.skipped
    assert fused.ln.normalized_shape == (4, 5) and fused.ln.act == "leaky_relu" and fused.ln.negative_slope == 0.2
    assert fused.plain.normalized_shape == (4, 5) and fused.plain.weight is None and fused.plain.act == "relu"


@pytest.mark.parametrize("fuse_in", MODES)
def test_timm_group_norm_act_and_layer_norm_act(fuse_in):
    model, fused, report = invariants(TimmNormActNet, (2, 3, 4, 4), fuse_in=fuse_in)
    assert report.counts() == {"GroupNormAct(SiLU)": 1, "GroupNorm1Act(Hardswish)": 1, "LayerNormAct(GELU)": 1}
    assert [f.where for f in report.fused] == [("gn",), ("gn1",), ("ln",)]
    assert type(fused.gn1) is FusedGroupNormAct and fused.gn1.num_groups == 1 and fused.gn1.act == "hardswish"
    assert type(fused.gn) is FusedGroupNormAct and fused.gn.act == "silu" and fused.gn.num_groups == 4
    assert type(fused.ln) is FusedLayerNormAct and fused.ln.act == "gelu" and fused.ln.normalized_shape == (8,)
    assert fused.gn.weight is model.gn.weight and fused.ln.bias is model.ln.bias
    reasons = {s.where: s.reason for s in report.skipped}
    assert reasons == {
        "ln2d": "is timm's LayerNormAct2d: it normalises the channels of an NCHW tensor (permuted to the last "
        "dimension and back), which no fused layer computes",
        "fast": "is timm's GroupNormAct with fast norm on (it normalises in 16 bits under autocast, the fused "
        "layer in float32)",
        "selu": "is followed by SELU, which has no fused kernel in tfuse yet",
    }
    for name in ("ln2d", "fast", "selu", "dropped", "local", "plain"):
        assert type(fused.get_submodule(name)) is type(model.get_submodule(name)), name
    # The fused layer has no drop and act children; the state dict keeps every key (they hold no tensors).
    assert "gn.act" not in dict(fused.named_modules()) and "ln2d.act" in dict(fused.named_modules())


def test_the_strategy_switch_turns_norm_act_fusion_off():
    off = FusionStrategy(fuse_norm_act=False)
    assert off.fuse_bn_act and not off.fuse_norm_act and FusionStrategy().fuse_norm_act
    model = prepare(ResBlock())
    fused, report = fuse_model(model, off, torch.randn(2, 8, 4, 4, dtype=torch.float64))
    assert fused is model and report.fused == []  # nothing else to fuse: the model comes back as it is
    assert {s.where: s.reason for s in report.skipped} == {
        "norm1": "is followed by SiLU; fuse_norm_act is off in the strategy",
        "norm2": "is followed by SiLU; fuse_norm_act is off in the strategy",
        "norm3": "is added to a residual before SiLU; fuse_norm_act is off",
    }
    _, report = fuse_model(MLPHead(), off)
    assert report.fused == []
    _, report = fuse_model(TimmNormActNet(), off)  # timm's forms too, and their reasons
    assert report.fused == [] and report.skipped == []
    _, report = fuse_model(Untraceable(), off)  # and the structural path
    assert report.method == "structural" and report.fused == []
    # The other switches leave it on.
    _, report = fuse_model(MLPHead(), FusionStrategy(fuse_bn_act=False, fuse_linear_act=False))
    assert report.counts() == {"LayerNorm+GELU": 1, "LayerNorm+GELU(tanh)": 1}
    with pytest.raises(TypeError, match="FusionStrategy.fuse_norm_act must be a bool, got 1"):
        FusionStrategy(fuse_norm_act=1)


@pytest.mark.parametrize("fuse_in", MODES)
def test_subclasses_are_not_fused_and_are_reported(fuse_in):
    model, fused, report = invariants(Subclassed, (2, 3, 3, 3), fuse_in=fuse_in)
    assert report.fused == []
    assert {s.where: s.reason for s in report.skipped} == {
        "gn": "is a MyGroupNorm, a subclass of nn.GroupNorm: only nn.GroupNorm itself is fused (a subclass may "
        "compute something else)",
        "ln2d": "is a LayerNorm2d, a subclass of nn.LayerNorm: only nn.LayerNorm itself is fused (a subclass may "
        "compute something else)",
    }


def test_hooks_are_not_fused_and_still_run():
    calls = []
    model = prepare(ResBlock())
    model.norm1.register_forward_hook(lambda *_: calls.append("norm1"))
    model.act.register_forward_pre_hook(lambda *_: calls.append("act"))  # the SiLU after norm1 and norm3
    mlp = prepare(MLPHead())
    mlp.gelu.register_forward_hook(lambda *_: calls.append("gelu"))
    timm = prepare(TimmNormActNet())
    timm.gn.act.register_forward_hook(lambda *_: calls.append("gn.act"))  # a hook inside the norm-act module
    fused, report = fuse_model(model, example_inputs=torch.randn(2, 8, 4, 4, dtype=torch.float64))
    assert report.counts() == {"GroupNorm+SiLU": 1}  # norm2, followed by F.silu
    assert {s.where: s.reason for s in report.skipped} == {
        "norm1": "has a forward hook on GroupNorm (a fused call would not run it)",
        "norm3": "has a forward pre hook on SiLU (a fused call would not run it)",
    }
    fused_mlp, report = fuse_model(mlp)
    assert report.counts() == {"LayerNorm+GELU(tanh)": 1}
    assert [s.where for s in report.skipped] == ["ln1"] and "forward hook on GELU" in report.skipped[0].reason
    fused_timm, report = fuse_model(timm)
    assert report.counts() == {"GroupNorm1Act(Hardswish)": 1, "LayerNormAct(GELU)": 1}
    assert [(s.where, s.reason) for s in report.skipped if s.where == "gn"] == [
        ("gn", "has a forward hook on SiLU (a fused call would not run it)")
    ]
    calls.clear()
    fused(torch.randn(2, 8, 4, 4, dtype=torch.float64))
    fused_mlp(torch.randn(5, 6, dtype=torch.float64))
    fused_timm(torch.randn(2, 3, 4, 4, dtype=torch.float64))
    assert calls == ["norm1", "act", "act", "gelu", "gn.act"]
    assert_same_over_modes(model, fused, (2, 8, 4, 4))
    assert_same_over_modes(mlp, fused_mlp, (5, 6))


@pytest.mark.parametrize("fuse_in", MODES)
def test_an_untraceable_forward_fuses_norm_act_neighbours(fuse_in):
    model, fused, report = invariants(Untraceable, (2, 3, 5, 5), fuse_in=fuse_in)
    assert report.method == "structural"
    assert report.counts() == {"GroupNorm+SiLU": 1, "LayerNorm+GELU": 1}
    assert [f.where for f in report.fused] == [("conv.1", "conv.2"), ("head.2", "head.3")]
    assert type(fused.conv[1]) is FusedGroupNormAct and type(fused.conv[2]) is nn.Identity
    assert type(fused.head[2]) is FusedLayerNormAct and fused.head[2].act == "gelu"


def test_the_fused_model_on_the_triton_path(device):
    """The same model through the kernels (Triton's interpreter on a CPU): the rewrite's calls reach them."""
    model = prepare(ResBlock(4)).to(device)
    with tfuse.use_backend("triton"):
        example = torch.randn(1, 4, 3, 3, dtype=torch.float64, device=device)
        fused, report = fuse_model(model, example_inputs=example)
        assert report.counts() == {"GroupNorm+SiLU": 3}
        assert_same_over_modes(
            model, fused, (1, 4, 3, 3), modes=("train", "eval"), rtol=1e-9, atol=1e-11, device=device
        )


def _timm_activation(name, forward):
    """A class of timm's activation name whose module path says timm (``timm.layers.activations``)."""
    cls = type(name, (nn.Module,), {"forward": lambda self, x: forward(x)})
    cls.__module__ = "timm.layers.activations"
    return cls


TimmGELU = _timm_activation("GELU", F.gelu)
TimmGELUTanh = _timm_activation("GELUTanh", lambda x: F.gelu(x, approximate="tanh"))
TimmSwish = _timm_activation("Swish", lambda x: x * x.sigmoid())
TimmQuickGELU = _timm_activation("QuickGELU", lambda x: x * torch.sigmoid(1.702 * x))


class TimmActivations(nn.Module):
    """What timm's create_act_layer builds for "gelu", "gelu_tanh", "swish" and "quick_gelu"."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.act = TimmGELUTanh()
        self.ln = nn.LayerNorm(8)
        self.gelu = TimmGELU()
        self.gn = nn.GroupNorm(2, 8)
        self.swish = TimmSwish()
        self.ln2 = nn.LayerNorm(8)
        self.quick = TimmQuickGELU()

    def forward(self, x):
        x = self.gelu(self.ln(self.act(self.fc(x))))
        x = self.swish(self.gn(x))
        return self.quick(self.ln2(x))


@pytest.mark.parametrize("fuse_in", MODES)
def test_timm_activation_modules_fuse(fuse_in):
    model, fused, report = invariants(TimmActivations, (5, 6), fuse_in=fuse_in)
    assert report.counts() == {"Linear+GELU(tanh)": 1, "LayerNorm+GELU": 1, "GroupNorm+SiLU": 1}
    assert [(s.where, s.reason) for s in report.skipped] == [
        ("ln2", "is followed by QuickGELU, which has no fused kernel in tfuse yet")
    ]
    assert fused.ln.act == "gelu" and fused.gn.act == "silu"


def test_every_strategy_switch_must_be_a_bool():
    import dataclasses

    switches = [f.name for f in dataclasses.fields(FusionStrategy) if f.type in (bool, "bool")]
    assert {"fuse_norm_act", "fuse_bn_act_depthwise_conv", "fuse_bn_act"} <= set(switches)
    for name in switches:
        with pytest.raises(TypeError, match=f"FusionStrategy.{name} must be a bool"):
            FusionStrategy(**{name: 1})
