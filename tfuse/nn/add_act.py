"""Modules for fused add + activation: ``FusedAddAct`` and ``FusedBiasAct``."""

from __future__ import annotations

import torch
from torch import nn

from tfuse import functional as F
from tfuse.nn._common import act_kwargs, act_repr, fx_leaf_call, resolve_activation


class FusedAddAct(nn.Module):
    """``act(x + others...)`` in one kernel launch (see :func:`tfuse.add_act`).

    It replaces ``act(x + skip)`` written as an add followed by an activation
    module (``nn.ReLU()``, ``nn.GELU()``, ...); torch has no module class for
    the pair, so the signature is tfuse's own: the activation, positional or
    keyword, and its slope, keyword-only. The default is relu, the
    activation that ends a residual block; state it anyway for readability.

    Args:
        act: relu (default), leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh, relu6, hardtanh, hardswish,
            hardsigmoid, mish, elu or identity.
        negative_slope: slope of leaky_relu for negative inputs (default 0.01,
            as ``nn.LeakyReLU``); an error with any other activation, where it
            would have no effect.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedAddAct
        >>> block_out = FusedAddAct("relu")
        >>> x, skip = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4)
        >>> block_out(x, skip).shape  # relu(x + skip), as a residual block ends
        torch.Size([2, 8, 4, 4])
        >>> FusedAddAct("leaky_relu", negative_slope=0.2)
        FusedAddAct(act='leaky_relu', negative_slope=0.2)
    """

    def __init__(self, act: str = "relu", *, negative_slope: float | None = None) -> None:
        super().__init__()
        self.act, self.negative_slope = resolve_activation("nn.FusedAddAct", act, negative_slope)

    def forward(self, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        traced = fx_leaf_call(self, x, *others)
        if traced is not None:
            return traced
        return F.add_act(x, *others, **act_kwargs(self.act, self.negative_slope))

    def extra_repr(self) -> str:
        return act_repr(self.act, self.negative_slope)


class FusedBiasAct(nn.Module):
    """A learnable bias added along one dimension, then an activation, in one pass.

    ``y = act(x + bias)`` with ``bias`` of shape ``[num_features]`` broadcast
    along dimension ``dim`` of ``x`` (the last one for ``[..., C]`` features,
    1 for ``[N, C, H, W]`` feature maps). Backward produces the bias gradient
    with a fused two-stage float32 reduction.

    It replaces a bias parameter added by hand and then an activation module;
    torch has no module class for the pair, so the signature is tfuse's own:
    ``num_features`` and ``act`` positional or keyword, everything else
    keyword-only.

    Args:
        num_features: size of ``x`` along ``dim``.
        act: relu (default), leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh, relu6, hardtanh, hardswish,
            hardsigmoid, mish, elu or identity.
        dim: the dimension of ``x`` the bias runs along (negative counts from the end; default -1).
        negative_slope: slope of leaky_relu for negative inputs (default 0.01);
            an error with any other activation, where it would have no effect.
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
        >>> layer
        FusedBiasAct(16, act='silu', dim=1)
    """

    def __init__(
        self,
        num_features: int,
        act: str = "relu",
        *,
        dim: int = -1,
        negative_slope: float | None = None,
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
        self.act, self.negative_slope = resolve_activation("nn.FusedBiasAct", act, negative_slope)
        self.bias = nn.Parameter(torch.empty(num_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    @classmethod
    def from_bias(
        cls, bias: torch.Tensor, *, act: str = "identity", dim: int = -1, negative_slope: float | None = None
    ) -> FusedBiasAct:
        """A FusedBiasAct around an existing 1-D bias.

        An ``nn.Parameter`` is used as it is (not copied), so an optimizer that
        holds it keeps training it; a plain tensor becomes a new Parameter
        over the same storage.

        Like every tfuse converter, it adds no activation you did not name:
        ``act`` defaults to identity (``x + bias``, what the bias computed
        before); pass ``act="relu"`` (or another) to fuse one.

        Example:
            >>> import torch
            >>> from tfuse.nn import FusedBiasAct
            >>> trained = torch.nn.Parameter(torch.randn(8))
            >>> layer = FusedBiasAct.from_bias(trained, act="gelu", dim=1)
            >>> layer.bias is trained
            True
        """
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
            raise ValueError(
                f"FusedBiasAct.from_bias: bias must be a 1-D tensor, got {getattr(bias, 'shape', type(bias).__name__)}"
            )
        module = cls(bias.numel(), act=act, dim=dim, negative_slope=negative_slope, device="meta", dtype=bias.dtype)
        module.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        traced = fx_leaf_call(self, x)
        if traced is not None:
            return traced
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
        return F.add_act(x, bias, **act_kwargs(self.act, self.negative_slope))

    def extra_repr(self) -> str:
        return f"{self.num_features}, {act_repr(self.act, self.negative_slope)}, dim={self.dim}"
