"""Models that reproduce what made fuse_model silently wrong on real code (timm, torchvision, hostile use).

Each is small, in float64 on the PyTorch path in the tests, and says which real pattern it stands for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d (timm.layers.norm_act): a BatchNorm2d subclass that calls F.batch_norm and its
    activation itself, branching on ``self.training``. Its module path says timm, as the real one's does."""

    def __init__(self, channels: int, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__(channels)
        self.drop = nn.Identity()
        self.act = act()

    def forward(self, x):
        if self.momentum is None:
            factor = 0.0
        else:
            factor = self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = True if self.training else (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight, self.bias, bn_training, factor, self.eps,
        )  # fmt: skip
        return self.act(self.drop(x))


BatchNormAct2d.__module__ = "timm.layers.norm_act"


class MyNormAct(nn.BatchNorm2d):
    """A BatchNorm2d subclass of a user's own, computing something else (a scaled output): never fused."""

    def forward(self, x):
        y = super().forward(x)
        return y * 0.5 if self.training else y


class NormActNet(nn.Module):
    """timm's conv -> BatchNormAct2d blocks, and a user's subclass followed by an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = BatchNormAct2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = BatchNormAct2d(6, nn.SiLU)
        self.conv3 = nn.Conv2d(6, 6, 1, bias=False)
        self.bn3 = MyNormAct(6)

    def forward(self, x):
        return F.relu(self.bn3(self.conv3(self.bn2(self.conv2(self.bn1(self.conv1(x)))))))


class DropPath(nn.Module):
    """Stochastic depth (timm's DropPath, torchvision's StochasticDepth): identity in eval mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0], 1, 1, 1)).bernoulli_(1.0 - self.p)  # as timm's drop_path
        return x * keep / (1.0 - self.p)


class DropPathBlock(nn.Module):
    """A residual block with BN + ReLU and stochastic depth on the branch, and F.dropout in its forward."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.drop_path = DropPath(0.5)
        self.proj = nn.Linear(channels, 4)

    def forward(self, x):
        h = x + self.drop_path(F.relu(self.bn(self.conv(x))))
        h = F.dropout(h.mean((2, 3)), 0.3, training=self.training)  # the mode, baked into a trace
        return self.proj(h)


class AuxNet(nn.Module):
    """GoogLeNet's shape: an auxiliary head whose output the forward returns in training only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.aux = nn.Sequential(nn.Flatten(), nn.Linear(6 * 5 * 5, 3))
        self.head = nn.Sequential(nn.Conv2d(6, 6, 1, bias=False), nn.BatchNorm2d(6), nn.ReLU6())
        self.aux_logits = True

    def forward(self, x):
        h = self.body(x)
        out = self.head(h).mean((2, 3))
        if self.training and self.aux_logits:
            return out, self.aux(h)
        return out


class OutOfOrder(nn.Module):
    """Modules defined in another order than the forward calls them (a head before the body), a
    non-persistent buffer, and BN -> Identity -> act (timm's drop_block slot)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3)
        self.head_act = nn.GELU()
        self.body = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.drop_block = nn.Identity()
        self.act = nn.ReLU()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6), persistent=False)

    def forward(self, x):
        h = self.act(self.drop_block(self.norm(self.body(x)))) * self.scale
        return self.head_act(self.head(h))


class HalfTraceable(nn.Module):
    """A forward that writes to itself before the point where tracing fails (levit caches attention biases
    by device; timm's norm layers count batches): a trace must not leave anything behind."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.bias_cache: dict[str, torch.Tensor] = {}
        self.biases = nn.Parameter(torch.randn(6))

    def forward(self, x):
        self.calls.add_(1)
        self.bias_cache[str(x.device)] = self.biases * 2
        h = self.block(x) + self.bias_cache[str(x.device)]
        if h.sum() > 0:  # data-dependent control flow: torch.fx stops here
            h = h * 2
        return h


class ShapeChecked(nn.Module):
    """A forward that checks its input's shape (as many real models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x):
        torch._assert(x.shape[1] == 4, "expected 4 features")
        return F.relu(self.norm(self.lin(x)))


class Sliced(nn.Module):
    """Data-dependent control flow around a container used in parts: slices, indices, a child's child."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6),
                                      nn.ReLU())  # fmt: skip
        self.block = nn.Sequential(nn.BatchNorm1d(6), nn.ReLU())
        self.tail = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())

    def forward(self, x):
        a = self.features[:2](x)  # the first Linear and BatchNorm, without the ReLU
        if a.sum() > 0:
            a = a * 2
        b = self.features[2:](a)
        h = self.block[0](b)  # the batch norm alone
        if h.mean() > 0:
            h = self.block[1](h)
        return self.tail(h) + h


class Aliased(nn.Module):
    """``skip = x; x += bn(conv(inp))``: the in-place add must reach ``skip`` too; the same with a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 6, 1)
        self.conv = nn.Conv2d(3, 6, 1)
        self.bn = nn.BatchNorm2d(6)
        self.lin = nn.Linear(5, 5)

    def forward(self, inp):
        x = self.conv0(inp)
        skip = x
        x += self.bn(self.conv(inp))
        y = F.relu(x) + skip
        z = y * 1.0
        alias = z
        z += self.lin(y)
        return torch.tanh(z) + alias


class Hooked(nn.Module):
    """BatchNorm + ReLU pairs, for hooks on every part of them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.relu = nn.ReLU()
        self.block = nn.Sequential(nn.Conv2d(6, 6, 1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.bn2 = nn.BatchNorm2d(6)

    def forward(self, x):
        h = self.block(self.relu(self.bn(self.conv(x))))
        return F.relu(self.bn2(h))
