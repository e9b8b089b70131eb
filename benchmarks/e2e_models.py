"""The models the end-to-end benchmark trains: ResNet-50, MobileNetV2 and a GPT-2-small stack.

Where torchvision imports (the GPU image has it) the two CNNs are
torchvision's own; otherwise an in-repo definition with the same structure
(the same module types in the same order, the same ``out += identity``
residual merge, so ``fuse_model`` finds the same patterns), which also
serves the CPU runs at reduced width. The GPT-2 stack is defined here in
every case: token and position embeddings, pre-norm blocks (LayerNorm,
causal attention through ``scaled_dot_product_attention``, an MLP with
tanh-GELU), a final LayerNorm and a head tied to the token embedding.

Example:
    >>> import torch
    >>> from benchmarks.e2e_models import build
    >>> spec = build("resnet50", scale="tiny")
    >>> spec.make().__class__.__name__, spec.input_shape(2)
    ('ResNet', (2, 3, 32, 32))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Model name -> what it is, for tables.
DESCRIPTIONS = {
    "resnet50": "ResNet-50 (torchvision layout): 53 BatchNorm2d, 49 followed by ReLU, 16 residual merges",
    "mobilenet_v2": "MobileNetV2: BatchNorm2d + ReLU6 before every depthwise convolution",
    "gpt2": "GPT-2 small: 12 pre-norm blocks, d=768, 12 heads, tanh-GELU MLP, tied head",
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How to build one model and its batches.

    Attributes:
        name: ``resnet50``, ``mobilenet_v2`` or ``gpt2``.
        make: builds the model (random init, float32, on the CPU).
        source: ``torchvision`` or ``in-repo``.
        image_size: side of the square input images (CNNs), or the sequence length (GPT-2).
        classes: classes (CNNs) or vocabulary size (GPT-2).
        tokens: True for GPT-2 (inputs are token ids; one sample is ``image_size`` tokens).
    """

    name: str
    make: Callable[[], nn.Module]
    source: str
    image_size: int
    classes: int
    tokens: bool = False

    def input_shape(self, batch: int) -> tuple[int, ...]:
        """The shape of one batch of inputs."""
        return (batch, self.image_size) if self.tokens else (batch, 3, self.image_size, self.image_size)

    def batch(self, batch: int, device: torch.device, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) drawn from ``generator`` on the CPU, then moved to ``device``."""
        if self.tokens:
            ids = torch.randint(0, self.classes, (batch, self.image_size + 1), generator=generator)
            return ids[:, :-1].to(device), ids[:, 1:].to(device)
        images = torch.randn(self.input_shape(batch), generator=generator)
        labels = torch.randint(0, self.classes, (batch,), generator=generator)
        return images.to(device), labels.to(device)


def build(name: str, scale: str = "full", prefer_torchvision: bool = True) -> ModelSpec:
    """The :class:`ModelSpec` of ``name`` at ``scale`` (``full``: the published sizes; ``tiny``: for CPUs).

    ``tiny`` shrinks widths, depth of the GPT-2 stack, image size and classes so that a CPU step takes
    milliseconds while every module type and fusion pattern of the full model is still there.
    """
    tiny = scale == "tiny"
    if scale not in ("full", "tiny"):
        raise ValueError(f"e2e models: scale must be 'full' or 'tiny', got {scale!r}")
    tv = _torchvision() if prefer_torchvision and not tiny else None
    if name == "resnet50":
        if tv is not None:
            return ModelSpec(name, tv.models.resnet50, "torchvision", 224, 1000)
        width, classes, size = (8, 10, 32) if tiny else (64, 1000, 224)
        return ModelSpec(name, lambda: ResNet((3, 4, 6, 3), width, classes), "in-repo", size, classes)
    if name == "mobilenet_v2":
        if tv is not None:
            return ModelSpec(name, tv.models.mobilenet_v2, "torchvision", 224, 1000)
        width_mult, classes, size = (0.25, 10, 32) if tiny else (1.0, 1000, 224)
        return ModelSpec(name, lambda: MobileNetV2(width_mult, classes), "in-repo", size, classes)
    if name == "gpt2":
        layers, width, heads, vocab, length = (2, 64, 4, 128, 32) if tiny else (12, 768, 12, 50257, 1024)
        return ModelSpec(name, lambda: GPT2(layers, width, heads, vocab, length), "in-repo", length, vocab, True)
    raise ValueError(f"e2e models: unknown model {name!r}; expected one of {', '.join(DESCRIPTIONS)}")


def _torchvision():  # type: ignore[no-untyped-def]
    """torchvision, or None where it does not import (with any exception: a mismatched build raises RuntimeError)."""
    try:
        import torchvision
        import torchvision.models
    except Exception:
        return None
    return torchvision


# ----------------------------------------------------------------------------------------------- ResNet


class Bottleneck(nn.Module):
    """torchvision's Bottleneck: 1x1, 3x3 (stride), 1x1 convolutions, each with BatchNorm, ``out += identity``."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A torchvision-layout bottleneck ResNet (``layers=(3, 4, 6, 3)``, ``width=64`` is ResNet-50)."""

    def __init__(self, layers: tuple[int, ...], width: int = 64, num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._stage(width, layers[0], 1)
        self.layer2 = self._stage(width * 2, layers[1], 2)
        self.layer3 = self._stage(width * 4, layers[2], 2)
        self.layer4 = self._stage(width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def _stage(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        stage = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        stage += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ------------------------------------------------------------------------------------------- MobileNetV2


def _divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _conv_bn_relu6(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """Expand (1x1 conv, BN, ReLU6), depthwise (3x3, BN, ReLU6), project (1x1 conv, BN), residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = [_conv_bn_relu6(cin, hidden, 1)] if expand != 1 else []
        layers += [_conv_bn_relu6(hidden, hidden, 3, stride, hidden), nn.Conv2d(hidden, cout, 1, bias=False),
                   nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision's MobileNetV2 layout (``width_mult=1.0`` is the published network)."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, width_mult: float = 1.0, num_classes: int = 1000) -> None:
        super().__init__()
        cin = _divisible(32 * width_mult)
        last = _divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [_conv_bn_relu6(3, cin, stride=2)]
        for expand, channels, repeats, stride in self.SETTINGS:
            cout = _divisible(channels * width_mult)
            for index in range(repeats):
                features.append(InvertedResidual(cin, cout, stride if index == 0 else 1, expand))
                cin = cout
        features.append(_conv_bn_relu6(cin, last, 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


# ------------------------------------------------------------------------------------------------- GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 (``layers=12, width=768, heads=12, vocab=50257, length=1024`` is GPT-2 small): logits per token."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, length: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(length, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.register_buffer("positions", torch.arange(length), persistent=False)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(param, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(self.positions[: ids.shape[1]])
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))
