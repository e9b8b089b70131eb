"""Modules for fused add + activation: ``FusedAddAct`` and ``FusedBiasAct``."""

from __future__ import annotations

import torch
from torch import nn

from tfuse import functional as F
from tfuse.ops._activations import check_activation


class FusedAddAct(nn.Module):
    """``act(x + others...)`` in one kernel launch (see :func:`tfuse.add_act`).

    Args:
        act: relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh or identity.
        negative_slope: slope of leaky_relu for negative inputs.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedAddAct
        >>> block_out = FusedAddAct("relu")
        >>> x, skip = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4)
        >>> block_out(x, skip).shape  # relu(x + skip), as a residual block ends
        torch.Size([2, 8, 4, 4])
    """

    def __init__(self, act: str = "relu", negative_slope: float = 0.01) -> None:
        super().__init__()
        self.act, self.negative_slope = check_activation("nn.FusedAddAct", act, negative_slope)

    def forward(self, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        return F.add_act(x, *others, act=self.act, negative_slope=self.negative_slope)

    def extra_repr(self) -> str:
        slope = f", negative_slope={self.negative_slope}" if self.act == "leaky_relu" else ""
        return f"act={self.act!r}{slope}"


class FusedBiasAct(nn.Module):
    """A learnable bias added along one dimension, then an activation, in one pass.

    ``y = act(x + bias)`` with ``bias`` of shape ``[num_features]`` broadcast
    along dimension ``dim`` of ``x`` (the last one for ``[..., C]`` features,
    1 for ``[N, C, H, W]`` feature maps). Backward produces the bias gradient
    with a fused two-stage float32 reduction.

    Args:
        num_features: size of ``x`` along ``dim``.
        act: relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh or identity.
        dim: the dimension of ``x`` the bias runs along (negative counts from the end).
        negative_slope: slope of leaky_relu for negative inputs.
        device, dtype: of the bias parameter.

    The parameter is named ``bias`` (initialised to zeros), so a state dict
    holding a ``bias`` of the same shape loads unchanged; to convert a bias you
    already have, use :meth:`from_bias`.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBiasAct
        >>> layer = FusedBiasAct(16, act="silu", dim=1)
        >>> layer(torch.randn(2, 16, 5, 5)).shape
        torch.Size([2, 16, 5, 5])
    """

    def __init__(
        self,
        num_features: int,
        act: str = "relu",
        dim: int = -1,
        negative_slope: float = 0.01,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"nn.FusedBiasAct: num_features must be a positive int, got {num_features!r}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"nn.FusedBiasAct: dim must be an int, got {type(dim).__name__}")
        self.num_features = num_features
        self.dim = dim
        self.act, self.negative_slope = check_activation("nn.FusedBiasAct", act, negative_slope)
        self.bias = nn.Parameter(torch.empty(num_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    @classmethod
    def from_bias(cls, bias: torch.Tensor, act: str = "relu", dim: int = -1, negative_slope: float = 0.01) -> FusedBiasAct:
        """A FusedBiasAct around an existing 1-D bias.

        An ``nn.Parameter`` is used as it is (not copied), so an optimizer that
        holds it keeps training it; a plain tensor becomes a new Parameter
        over the same storage.
        """
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
            raise ValueError(f"FusedBiasAct.from_bias: bias must be a 1-D tensor, got {getattr(bias, 'shape', type(bias).__name__)}")
        module = cls(bias.numel(), act=act, dim=dim, negative_slope=negative_slope, device="meta", dtype=bias.dtype)
        module.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"nn.FusedBiasAct: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or not -x.dim() <= self.dim < x.dim():
            raise ValueError(f"nn.FusedBiasAct: dim={self.dim} is out of range for an input with {x.dim()} dimensions")
        dim = self.dim % x.dim()
        if x.shape[dim] != self.num_features:
            raise ValueError(
                f"nn.FusedBiasAct: expected {self.num_features} features along dim {self.dim}, "
                f"got input of shape {list(x.shape)}"
            )
        bias = self.bias.view((self.num_features,) + (1,) * (x.dim() - dim - 1))
        return F.add_act(x, bias, act=self.act, negative_slope=self.negative_slope)

    def extra_repr(self) -> str:
        slope = f", negative_slope={self.negative_slope}" if self.act == "leaky_relu" else ""
        return f"{self.num_features}, act={self.act!r}, dim={self.dim}{slope}"
