"""Small models in the styles of real networks, for the fuse_model tests (each exercises a pattern or a hazard).

ResNet (basic and bottleneck blocks, a reused ReLU module, a downsample computed after the second norm),
MobileNetV2 (BN + ReLU6, and ReLU6 -> depthwise conv where no norm precedes it), EfficientNet (SiLU ->
depthwise conv), a transformer MLP block, and models whose forwards do not trace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, channels: int, downsample: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)  # one module, called twice (as torchvision's)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = (
            nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)) if downsample else None
        )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)  # computed after bn2: the fused layer must wait for it
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        inner = channels // 2
        self.conv1 = nn.Conv2d(channels, inner, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner)
        self.conv2 = nn.Conv2d(inner, inner, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(inner)
        self.conv3 = nn.Conv2d(inner, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return F.relu(x + self.bn3(self.conv3(out)))  # the residual on the left


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8), BasicBlock(8, downsample=True), Bottleneck(8))
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.layer1(self.stem(x)).mean((2, 3)))


class MobileNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
            nn.Conv2d(8, 12, 1, bias=False), nn.BatchNorm2d(12),
            nn.Conv2d(12, 12, 1, bias=False), nn.BatchNorm2d(12), nn.Hardswish(),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(12, 4))

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


class MLPBlock(nn.Module):
    """A transformer MLP block: LayerNorm, Linear + GELU (tanh form), Linear, residual; a BN1d + SiLU head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(4 * width, width)
        self.head_norm = nn.BatchNorm1d(width)
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x):
        x = x + self.down(self.act(self.up(self.norm(x))))
        h = F.silu(self.head_norm(x))
        # A bias add and an activation: tfuse.add_act, given shapes. Slope 0.25 is exact in float32, the type the
        # kernels take scalars in (docs/differences.md, "Numerics"): this test checks the rewrite, not that rounding.
        return F.leaky_relu(h + self.bias, 0.25)


def double(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.normal_(module.bias)
    return model.double()


class Reused(nn.Module):
    """One BatchNorm called twice, and a Linear whose output feeds a branch."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        a = F.relu(self.bn(x))
        b = F.relu(self.bn(x * 2))
        h = self.lin(a + b)
        return torch.tanh(h) + h


class Untraceable(nn.Module):
    """A forward with data-dependent control flow (torch.fx cannot trace it) around Sequential blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.GELU())
        self.other = nn.Sequential(nn.BatchNorm1d(8), nn.SELU())

    def forward(self, x):
        h = self.block(x)
        if h.sum() > 0:
            h = h * 2
        return self.other(h)


def dw(channels: int, kernel: int = 3, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(channels, channels, kernel, padding=kwargs.pop("padding", kernel // 2), groups=channels, **kwargs)


class MobileNetLite(nn.Module):
    """An inverted residual whose expansion has no norm: pointwise conv -> ReLU6 -> depthwise conv -> BN ->
    ReLU6 -> pointwise conv, plus the input."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(4, 8, 1)
        self.act1 = nn.ReLU6(inplace=True)  # in place on the expansion's output, which nothing else reads
        self.dw = dw(8, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act2 = nn.ReLU6(inplace=True)
        self.project = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return x + self.project(self.act2(self.bn(self.dw(self.act1(self.expand(x))))))


class EfficientNetish(nn.Module):
    """Stem conv -> SiLU -> depthwise 5x5 stride 2 -> squeeze-excitation -> LeakyReLU -> depthwise, dilated."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.SiLU()
        self.dw1 = dw(8, 5, stride=2)
        self.se_down, self.se_up = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)
        self.dw2 = dw(8, padding=2, dilation=2)

    def forward(self, x):
        h = self.dw1(self.act(self.stem(x)))
        scale = torch.sigmoid(self.se_up(F.silu(self.se_down(h.mean((2, 3), keepdim=True)))))  # dense convs
        return self.dw2(F.leaky_relu(h * scale, 0.25))  # 0.25: exact in float32 (see MLPBlock)


class FunctionalDepthwise(nn.Module):
    """F.relu on the input -> depthwise; an add -> tensor method relu -> depthwise (before tfuse.add_act)."""

    def __init__(self) -> None:
        super().__init__()
        self.dw1 = dw(6)
        self.dw2 = dw(6, bias=False)

    def forward(self, x):
        h = self.dw1(F.relu(x))
        return self.dw2((h + x).relu())


class NotFusable(nn.Module):
    """Activations before convolutions that cannot take them, each for its own reason."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = dw(4)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.multiplier = nn.Conv2d(4, 8, 3, padding=1, groups=4)
        self.reflect = dw(4, padding_mode="reflect")
        self.twice = dw(4)
        self.selu = dw(4)
        self.dense = nn.Conv2d(4, 4, 3, padding=1)
        self.in_place = dw(4)

    def forward(self, x):
        h = F.relu(x)
        y = self.branch(h) + h  # the activation's output is used twice
        y = self.grouped(F.silu(y)) + self.multiplier(torch.tanh(y))[:, :4] + self.reflect(F.gelu(y))
        y = self.twice(torch.sigmoid(y)) + self.twice(y) + self.selu(F.selu(y)) + self.dense(F.relu(y))
        z = y * 2
        return self.in_place(F.relu(z, inplace=True)) + z  # z must see the in-place relu


class UntraceableDepthwise(nn.Module):
    """Data-dependent control flow around Sequential blocks: conv -> ReLU6 -> depthwise; BN -> ReLU6 ->
    depthwise; an in-place activation first in its container (its input is the caller's tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(4, 8, 1), nn.ReLU6(inplace=True), dw(8), nn.BatchNorm2d(8), nn.ReLU6(inplace=True), dw(8),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Hardswish(inplace=True), dw(8))

    def forward(self, x):
        h = self.block(x)
        if h.sum() > 0:
            h = h * 2
        return self.head(h) + h
