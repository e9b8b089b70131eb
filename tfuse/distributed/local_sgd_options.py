"""The options of :class:`~tfuse.distributed.LocalSGD`: the outer optimizer and the adaptive interval."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer of DiLoCo-style training: SGD (with Nesterov momentum) on the pseudo-gradient.

    At every sync the snapshot ``S`` takes ``S -= lr * (G + momentum * buf)``
    (Nesterov) or ``S -= lr * buf`` (heavy ball), ``buf = momentum * buf + G``,
    ``G = mean over ranks of (S - param)``: torch.optim.SGD's maths with
    ``G`` as the gradient. ``OuterSGD(lr=1.0, momentum=0.0, nesterov=False)``
    is plain model averaging; the defaults (lr 0.7, Nesterov momentum 0.9) are
    DiLoCo's.

    Example:
        >>> from tfuse.distributed import OuterSGD
        >>> OuterSGD(lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's choice
        OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"OuterSGD: lr must be a positive finite number, got {self.lr!r}")
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"OuterSGD: momentum must be in [0, 1), got {self.momentum!r}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("OuterSGD: nesterov=True needs a momentum > 0")


@dataclasses.dataclass(frozen=True)
class AdaptiveInterval:
    """A rule that lengthens or shortens ``sync_every`` from the parameter divergence measured at each sync.

    At a sync, before averaging, the ranks' spread is measured as the relative
    divergence ``d = sqrt(mean_r |p_r - p_mean|^2) / |p_mean|`` over every
    trainable element (one extra 2-element all-reduce, in float64, so every
    rank computes the same ``d`` and takes the same decision). Then the
    interval doubles when ``d < target / 2`` (replicas barely drifted: sync
    less) and halves when ``d > 2 * target`` (they drift apart: sync more),
    within ``[min_every, max_every]``. In the spirit of Paddle's adaptive
    LocalSGD, which sets the interval from the training state; this rule
    reads the quantity an average actually corrects.

    Example:
        >>> from tfuse.distributed import AdaptiveInterval
        >>> AdaptiveInterval(target=1e-3, min_every=1, max_every=64).next_interval(8, 1e-4)
        16
    """

    target: float = 1e-3
    min_every: int = 1
    max_every: int = 256

    def __post_init__(self) -> None:
        if not (isinstance(self.target, (int, float)) and math.isfinite(self.target) and self.target > 0):
            raise ValueError(f"AdaptiveInterval: target must be a positive finite number, got {self.target!r}")
        for name in ("min_every", "max_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AdaptiveInterval: {name} must be an int >= 1, got {value!r}")
        if self.min_every > self.max_every:
            raise ValueError(f"AdaptiveInterval: min_every {self.min_every} > max_every {self.max_every}")

    def next_interval(self, current: int, divergence: float) -> int:
        """The interval after a sync that measured ``divergence`` with ``current`` iterations between syncs."""
        if divergence < self.target / 2:
            current *= 2
        elif divergence > 2 * self.target:
            current //= 2
        return max(self.min_every, min(self.max_every, current))
