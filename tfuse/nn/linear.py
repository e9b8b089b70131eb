"""``FusedLinear``: nn.Linear with its bias and activation fused into one kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as torch_F
from torch import nn

from tfuse.ops._activations import check_activation, grad_from_output
from tfuse.ops.add_act import linear_epilogue


class FusedLinear(nn.Linear):
    """``act(x @ weight.T + bias)``: an ``nn.Linear`` followed by an activation.

    The matrix product stays with torch (cuBLAS on a GPU); the bias add and
    the activation run in one tfuse kernel, and in backward the activation
    derivative and the bias gradient come from one fused pass plus a small
    reduction. For relu, sigmoid, tanh, leaky_relu (slope >= 0) and identity
    the epilogue writes in place into the product, so the layer allocates one
    output instead of the two of ``nn.Linear`` + activation; for gelu,
    gelu_tanh and silu it keeps the product for backward, as torch keeps
    ``x @ W.T + b`` for its GELU.

    A subclass of ``nn.Linear`` with the same parameters (``weight``,
    ``bias``) and state dict: an ``nn.Linear`` state dict loads unchanged, and
    :meth:`from_linear` converts a trained layer. Under ``torch.autocast`` it
    computes in the autocast dtype, as ``nn.Linear`` does.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        act: relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh or identity.
        negative_slope: slope of leaky_relu for negative inputs.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedLinear
        >>> layer = FusedLinear(64, 256, act="gelu")
        >>> layer(torch.randn(8, 64)).shape
        torch.Size([8, 256])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        act: str = "relu",
        negative_slope: float = 0.01,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        act, negative_slope = check_activation("nn.FusedLinear", act, negative_slope)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.act = act
        self.negative_slope = negative_slope

    @classmethod
    def from_linear(cls, linear: nn.Linear, act: str = "relu", negative_slope: float = 0.01) -> FusedLinear:
        """A FusedLinear sharing ``linear``'s parameters (not copies: an optimizer keeps training them)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FusedLinear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        module = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, act=act,
            negative_slope=negative_slope, device="meta",
        )
        module.weight = linear.weight
        module.bias = linear.bias
        module.train(linear.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = torch_F.linear(x, self.weight)
        bias = self.bias
        if bias is None and self.act == "identity":
            return product
        if bias is not None and bias.dtype != product.dtype:
            if not torch.is_autocast_enabled(product.device.type):
                raise RuntimeError(
                    f"nn.FusedLinear: bias has dtype {bias.dtype} but the product of input and weight has "
                    f"{product.dtype}; keep the layer's parameters in one dtype (or use torch.autocast)"
                )
            bias = bias.to(product.dtype)  # nn.Linear's addmm casts its bias the same way
        # The product is ours alone: activations whose gradient follows from
        # their output overwrite it instead of allocating a second tensor.
        return linear_epilogue(product, bias, self.act, self.negative_slope, inplace=self._epilogue_in_place)

    @property
    def _epilogue_in_place(self) -> bool:
        return self.act == "identity" or grad_from_output(self.act, self.negative_slope)

    def extra_repr(self) -> str:
        slope = f", negative_slope={self.negative_slope}" if self.act == "leaky_relu" else ""
        return f"{super().extra_repr()}, act={self.act!r}{slope}"
