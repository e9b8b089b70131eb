"""``FusedActDepthwiseConv2d``: a depthwise nn.Conv2d that applies the preceding activation on its input read."""

from __future__ import annotations

import torch
from torch import nn

from tfuse.nn._common import fx_leaf_call, resolve_activation, slope_value
from tfuse.ops.depthwise import relu_depthwise_conv2d


class FusedActDepthwiseConv2d(nn.Conv2d):
    """``act_out(conv2d(act_in(x)))`` for a depthwise ``nn.Conv2d`` (groups = in_channels = out_channels).

    PaddlePaddle's ``fuse_relu_depthwise_conv`` pass: the activation before a
    depthwise convolution (MobileNet's BN -> ReLU6 -> depthwise conv) is
    applied as the convolution reads its input, and backward recomputes it
    from the saved input, so the activation's output is never stored (one
    activation-sized tensor less per fused pair between forward and
    backward; see :func:`tfuse.functional.relu_depthwise_conv2d`).

    A drop-in ``nn.Conv2d``: the same positional and keyword arguments, the
    same parameters and state dict. ``groups`` defaults to ``in_channels``
    and must equal it, with ``out_channels == in_channels`` (depth multiplier
    1), and ``padding_mode`` must be ``"zeros"``. tfuse's options are
    keyword-only: ``act_in`` (default relu, the fusion's point), ``act_out``
    (default None) and ``negative_slope``. :meth:`from_conv` converts a
    trained layer, sharing its parameters. Under ``torch.fx`` the layer is a
    leaf (one ``call_module`` node).

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedActDepthwiseConv2d
        >>> layer = FusedActDepthwiseConv2d(32, 32, 3, padding=1, act_in="relu6")
        >>> layer(torch.randn(2, 32, 14, 14)).shape
        torch.Size([2, 32, 14, 14])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int | None = None,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        act_in: str = "relu",
        act_out: str | None = None,
        negative_slope: float | None = None,
    ) -> None:
        groups = in_channels if groups is None else groups
        if groups != in_channels or out_channels != in_channels:
            raise ValueError(
                "nn.FusedActDepthwiseConv2d is a depthwise convolution with depth multiplier 1: it needs "
                f"groups == in_channels == out_channels, got in_channels={in_channels}, "
                f"out_channels={out_channels}, groups={groups}"
            )
        if padding_mode != "zeros":
            raise ValueError(
                f"nn.FusedActDepthwiseConv2d supports padding_mode='zeros' only, got {padding_mode!r} "
                "(the activation is applied before the zero padding, as conv2d(act(x)) pads act(x))"
            )
        self._check_acts(act_in, act_out, negative_slope)
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode, device, dtype
        )
        self.act_in = act_in
        self.act_out = act_out
        self.negative_slope = negative_slope

    @staticmethod
    def _check_acts(act_in: object, act_out: object, negative_slope: object) -> None:
        if negative_slope is not None and "leaky_relu" not in (act_in, act_out):
            raise ValueError(
                f"nn.FusedActDepthwiseConv2d: negative_slope={negative_slope!r} has no effect with act_in={act_in!r}"
                f" and act_out={act_out!r}; it is the slope of leaky_relu only"
            )
        slope = negative_slope if act_in == "leaky_relu" else None
        resolve_activation("nn.FusedActDepthwiseConv2d", act_in, slope)
        if act_out is not None:
            resolve_activation(
                "nn.FusedActDepthwiseConv2d", act_out, negative_slope if act_out == "leaky_relu" else None
            )

    @classmethod
    def from_conv(
        cls,
        conv: nn.Conv2d,
        *,
        act_in: str = "relu",
        act_out: str | None = None,
        negative_slope: float | None = None,
    ) -> FusedActDepthwiseConv2d:
        """A FusedActDepthwiseConv2d sharing ``conv``'s parameters (an optimizer keeps training them).

        ``conv`` must be depthwise with depth multiplier 1 (``groups ==
        in_channels == out_channels``) and zero padding; ``act_in`` is the
        activation that preceded it (fuse_model passes the one it removed).

        Example:
            >>> import torch
            >>> from tfuse.nn import FusedActDepthwiseConv2d
            >>> conv = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
            >>> fused = FusedActDepthwiseConv2d.from_conv(conv, act_in="relu6")
            >>> fused.weight is conv.weight
            True
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"FusedActDepthwiseConv2d.from_conv expects an nn.Conv2d, got {type(conv).__name__}")
        module = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
            conv.bias is not None,
            conv.padding_mode,
            device="meta",
            act_in=act_in,
            act_out=act_out,
            negative_slope=negative_slope,
        )
        module.weight = conv.weight
        module.bias = conv.bias
        module.train(conv.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        traced = fx_leaf_call(self, x)
        if traced is not None:
            return traced
        return relu_depthwise_conv2d(
            x,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            self.dilation,
            act_in=self.act_in,
            act_out=self.act_out,
            negative_slope=self.negative_slope,
        )

    def extra_repr(self) -> str:
        parts = [super().extra_repr(), f"act_in={self.act_in!r}"]
        if self.act_out is not None:
            parts.append(f"act_out={self.act_out!r}")
        if self.negative_slope is not None:
            parts.append(f"negative_slope={slope_value(self.negative_slope)}")
        return ", ".join(parts)
