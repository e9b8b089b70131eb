"""FusionStrategy: which fusions :func:`tfuse.fuse_model` applies (the seeds' BuildStrategy switches)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FusionStrategy:
    """Which patterns :func:`tfuse.fuse_model` fuses; every switch is on by default.

    The names follow PaddlePaddle's BuildStrategy (``fuse_bn_act_ops``,
    ``fuse_bn_add_act_ops``, ``fuse_elewise_add_act_ops``) in PyTorch terms.

    Example:
        >>> import tfuse
        >>> strategy = tfuse.FusionStrategy(fuse_linear_act=False)  # leave Linear + activation alone
        >>> strategy.fuse_bn_act, strategy.fuse_linear_act
        (True, False)
    """

    fuse_bn_act: bool = True
    """BatchNorm1d/2d followed by an activation -> ``FusedBatchNormAct1d/2d`` (one pass forward, one backward)."""

    fuse_bn_add_act: bool = True
    """BatchNorm, a residual add, then an activation (ResNet blocks) -> the fused layer with ``residual=``.
    Needs ``example_inputs`` (the residual must have the batch norm's shape, which only shapes can show)."""

    fuse_linear_act: bool = True
    """nn.Linear followed by an activation -> ``FusedLinear`` (the bias add and the activation in one epilogue)."""

    fuse_add_act: bool = True
    """A tensor add followed by an activation (a bias or residual add) -> ``tfuse.add_act``. Needs
    ``example_inputs`` (which operand has the result's shape decides the call)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise TypeError(f"FusionStrategy.{field.name} must be a bool, got {value!r}")
