"""FusionStrategy: which fusions :func:`tfuse.fuse_model` applies (PaddlePaddle's BuildStrategy switches)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FusionStrategy:
    """What :func:`tfuse.fuse_model` fuses and how :func:`tfuse.setup` trains; every fusion is on by default.

    The names follow PaddlePaddle's BuildStrategy and DistributedStrategy
    (``fuse_bn_act_ops``, ``fuse_bn_add_act_ops``, ``fuse_elewise_add_act_ops``,
    ``fuse_relu_depthwise_conv``, ``fuse_all_optimizer_ops``, ``fuse_all_reduce_ops``,
    ``fuse_grad_size_in_MB``, gradient merge, sharding, LocalSGD) in PyTorch terms.

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

    fuse_norm_act: bool = True
    """nn.GroupNorm or nn.LayerNorm followed by an activation -> ``FusedGroupNormAct`` / ``FusedLayerNormAct``
    (statistics, normalisation and activation in one pass forward, one backward); with a residual add between
    the norm and the activation (shapes from ``example_inputs``), ``residual=``; and timm's ``GroupNormAct``,
    ``GroupNorm1Act`` and ``LayerNormAct``. Exact types only: subclasses are reported, not fused."""

    fuse_linear_act: bool = True
    """nn.Linear followed by an activation -> ``FusedLinear`` (the bias add and the activation in one epilogue)."""

    fuse_add_act: bool = True
    """A tensor add followed by an activation (a bias or residual add) -> ``tfuse.add_act``. Needs
    ``example_inputs`` (which operand has the result's shape decides the call)."""

    fuse_relu_depthwise_conv: bool = True
    """An activation whose only user is a depthwise nn.Conv2d (groups = in_channels = out_channels, zero
    padding) -> ``FusedActDepthwiseConv2d`` with it as ``act_in`` (applied as the convolution reads its input,
    recomputed in backward: its output is never stored). Any tfuse activation, not only ReLU. A Linear fusion
    keeps its activation; a batch norm before it is the next switch's pattern."""

    fuse_bn_act_depthwise_conv: bool = True
    """nn.BatchNorm2d -> activation -> depthwise nn.Conv2d (MobileNetV2/V3, EfficientNet, MnasNet) -> the
    convolution becomes ``BatchNormBoundDepthwiseConv2d``: it normalises its input with the batch norm (which
    keeps its name and state) and applies the activation as it loads, so neither the normalised nor the
    activated tensor is written. Off: the batch norm takes the activation (``fuse_bn_act``)."""

    fuse_all_optimizer_ops: bool = True
    """:func:`tfuse.setup`: a tfuse fused optimizer (one update launch per flat buffer) rather than torch.optim's."""

    fuse_all_reduce_ops: bool = True
    """:func:`tfuse.setup`, under torch.distributed: ``FusedDataParallel`` (one all-reduce per bucket of a flat
    gradient buffer) rather than torch's ``DistributedDataParallel``."""

    fuse_grad_size_in_mb: float | None = 16
    """Bucket size cap in MB of the fused all-reduce (None: one bucket per flat buffer)."""

    max_params_per_bucket: int | None = None
    """Most parameters per all-reduce bucket (None: no count cap)."""

    gradient_merge_steps: int = 1
    """Backward passes whose gradients are accumulated before one all-reduce and one step (PaddlePaddle's
    gradient merge pass); ``gradient_merge_avg`` averages them (else sums)."""

    gradient_merge_avg: bool = True

    sharding: str = "none"
    """``"none"`` or ``"optimizer"``: :class:`~tfuse.distributed.ShardedOptimizer` (optimizer state and master
    weights split over the ranks)."""

    local_sgd_every: int | None = None
    """None, or k: :class:`~tfuse.distributed.LocalSGD`, parameters averaged every k iterations instead of
    gradients every iteration (after ``local_sgd_warmup`` iterations of every-step averaging)."""

    local_sgd_warmup: int = 0

    def __post_init__(self) -> None:
        for name in (f.name for f in dataclasses.fields(self) if f.type in (bool, "bool")):  # every switch
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"FusionStrategy.{name} must be a bool, got {value!r}")
        size = self.fuse_grad_size_in_mb
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
            raise ValueError(f"FusionStrategy.fuse_grad_size_in_mb must be a positive number or None, got {size!r}")
        for name, low in (("gradient_merge_steps", 1), ("local_sgd_warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"FusionStrategy.{name} must be an int >= {low}, got {value!r}")
        for name in ("max_params_per_bucket", "local_sgd_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"FusionStrategy.{name} must be None or an int >= 1, got {value!r}")
        if self.sharding not in ("none", "optimizer"):
            raise ValueError(f"FusionStrategy.sharding must be 'none' or 'optimizer', got {self.sharding!r}")
        if self.sharding == "optimizer" and self.local_sgd_every is not None:
            raise ValueError(
                "FusionStrategy: sharding='optimizer' and local_sgd_every exclude each other (a sharded optimizer "
                "needs the gradients of every step on the shards' owners; LocalSGD communicates every k steps)"
            )
        if self.local_sgd_every is not None and self.gradient_merge_steps != 1:
            raise ValueError(
                "FusionStrategy: local_sgd_every with gradient_merge_steps > 1 is not supported: accumulate "
                "gradients with more local steps instead (local steps already communicate nothing)"
            )
