"""``FusedBatchNormActDepthwiseConv2d``: batch norm -> activation -> depthwise convolution, the normalised
activation never written (:func:`tfuse.functional.batch_norm_act_depthwise_conv2d`)."""

from __future__ import annotations

import torch
from torch import nn

from tfuse.nn._common import batch_norm_call, fx_leaf_call, resolve_activation, slope_value
from tfuse.nn.depthwise import FusedActDepthwiseConv2d
from tfuse.ops.bn_depthwise import batch_norm_act_depthwise_conv2d


def _check_pair(bn: object, conv: object, owner: str) -> None:
    if type(bn) is not nn.BatchNorm2d:  # a subclass (tfuse's fused layers too) may compute something else
        raise TypeError(f"{owner}: bn must be an nn.BatchNorm2d (not a subclass), got {type(bn).__name__}")
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"{owner}: conv must be an nn.Conv2d, got {type(conv).__name__}")
    if not (conv.groups == conv.in_channels == conv.out_channels == bn.num_features):
        raise ValueError(
            f"{owner}: conv must be a depthwise convolution over the batch norm's {bn.num_features} channels "
            f"(groups == in_channels == out_channels), got in_channels={conv.in_channels}, "
            f"out_channels={conv.out_channels}, groups={conv.groups}"
        )
    if conv.padding_mode != "zeros":
        raise ValueError(f"{owner}: conv must pad with zeros, got padding_mode={conv.padding_mode!r}")


def _run(bn: nn.BatchNorm2d, conv: nn.Conv2d, x: torch.Tensor, act: str, negative_slope: float | None):
    """The block's call with ``bn``'s statistics choice and momentum exactly as ``nn.BatchNorm2d.forward``."""
    return batch_norm_act_depthwise_conv2d(
        x,
        bn_weight=bn.weight,
        bn_bias=bn.bias,
        conv_weight=conv.weight,
        conv_bias=conv.bias,
        eps=bn.eps,
        **batch_norm_call(bn),
        act=act,
        negative_slope=negative_slope,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
    )


class FusedBatchNormActDepthwiseConv2d(nn.Module):
    """``conv(act(bn(x)))`` for a ``nn.BatchNorm2d`` and a depthwise ``nn.Conv2d``: the MobileNetV2/V3 and
    EfficientNet block, with the normalised activation never written.

    In training, batch norm's statistics pass reads ``x``; then the
    depthwise kernel reads ``x`` again, normalising each value, applying the
    activation and convolving as it loads. Backward keeps ``x`` and the
    statistics, no normalised or activated tensor (eager BN + activation +
    conv keeps one or two more activation-sized tensors). The submodules are
    a plain ``bn`` (``nn.BatchNorm2d``) and ``conv`` (``nn.Conv2d``, groups =
    channels), so the state dict is theirs under ``bn.`` and ``conv.``, and
    running statistics, ``momentum=None``, ``affine=False`` and
    ``track_running_stats=False`` behave as in ``nn.BatchNorm2d``.
    :meth:`from_modules` fuses trained modules, sharing their parameters;
    :func:`tfuse.fuse_model` finds the pattern in a model and keeps its
    state-dict keys.

    Args:
        channels: the batch norm's features and the convolution's channels.
        kernel_size, stride, padding, dilation, bias: the depthwise
            convolution's (``nn.Conv2d``'s; bias defaults to False, as
            MobileNet's).
        act: the activation between them (default relu6).
        negative_slope: leaky_relu's slope; an error with another activation.
        eps, momentum, affine, track_running_stats: the batch norm's.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBatchNormActDepthwiseConv2d
        >>> block = FusedBatchNormActDepthwiseConv2d(32, 3, stride=2, padding=1, act="relu6")
        >>> block(torch.randn(4, 32, 14, 14)).shape
        torch.Size([4, 32, 7, 7])
        >>> sorted(block.state_dict())[:2]
        ['bn.bias', 'bn.num_batches_tracked']
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        bias: bool = False,
        *,
        act: str = "relu6",
        negative_slope: float | None = None,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.act, self.negative_slope = resolve_activation("nn.FusedBatchNormActDepthwiseConv2d", act, negative_slope)
        self.bn = nn.BatchNorm2d(channels, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.conv = nn.Conv2d(
            channels, channels, kernel_size, stride, padding, dilation, channels, bias, device=device, dtype=dtype
        )

    @classmethod
    def from_modules(
        cls, bn: nn.BatchNorm2d, conv: nn.Conv2d, *, act: str = "relu6", negative_slope: float | None = None
    ) -> FusedBatchNormActDepthwiseConv2d:
        """The block over ``bn`` and ``conv`` themselves (the same module objects: parameters, statistics and
        mode shared, an optimizer keeps training them).

        Example:
            >>> import torch
            >>> bn, conv = torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
            >>> from tfuse.nn import FusedBatchNormActDepthwiseConv2d
            >>> block = FusedBatchNormActDepthwiseConv2d.from_modules(bn, conv, act="silu")
            >>> block.conv is conv and block.bn is bn
            True
        """
        _check_pair(bn, conv, "FusedBatchNormActDepthwiseConv2d.from_modules")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.act, module.negative_slope = resolve_activation(
            "FusedBatchNormActDepthwiseConv2d.from_modules", act, negative_slope
        )
        module.bn, module.conv = bn, conv
        module.train(bn.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        traced = fx_leaf_call(self, x)
        if traced is not None:
            return traced
        return _run(self.bn, self.conv, x, self.act, self.negative_slope)

    def extra_repr(self) -> str:
        text = f"act={self.act!r}"
        if self.negative_slope is not None:
            text += f", negative_slope={slope_value(self.negative_slope)}"
        return text


class BatchNormBoundDepthwiseConv2d(FusedActDepthwiseConv2d):
    """What :func:`tfuse.fuse_model` puts in place of the depthwise convolution of a BN -> activation ->
    depthwise conv block: the convolution (its own parameters, so the state dict keeps its keys), which
    normalises its input with the batch norm module that stays at its own name in the model, and applies the
    activation, as it loads (:func:`tfuse.functional.batch_norm_act_depthwise_conv2d`).

    The batch norm is referenced, not registered as a submodule: its parameters, statistics and mode belong
    to it, under its own name; the fused model no longer calls it.

    Example:
        >>> import torch
        >>> from tfuse.nn import BatchNormBoundDepthwiseConv2d
        >>> bn, conv = torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        >>> fused = BatchNormBoundDepthwiseConv2d.from_modules(bn, conv, act="relu6")
        >>> fused.weight is conv.weight and fused.batch_norm is bn and "bn" not in dict(fused.named_children())
        True
    """

    @classmethod
    def from_modules(
        cls, bn: nn.BatchNorm2d, conv: nn.Conv2d, *, act: str = "relu6", negative_slope: float | None = None
    ) -> BatchNormBoundDepthwiseConv2d:
        """The convolution ``conv`` (parameters shared) bound to ``bn`` (referenced, not registered)."""
        _check_pair(bn, conv, "BatchNormBoundDepthwiseConv2d.from_modules")
        module = cls.from_conv(conv, act_in=act, negative_slope=negative_slope)
        module.__dict__["batch_norm"] = bn  # not nn.Module.__setattr__: that would register it, and its keys
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        traced = fx_leaf_call(self, x)
        if traced is not None:
            return traced
        return _run(self.batch_norm, self, x, self.act_in, self.negative_slope)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", normalised on load by its batch norm"
