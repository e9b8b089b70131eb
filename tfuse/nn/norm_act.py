"""Group norm and layer norm (+ residual) + activation modules: drop-in subclasses of ``nn.GroupNorm`` and
``nn.LayerNorm`` running :func:`tfuse.functional.group_norm_act` / :func:`tfuse.functional.layer_norm_act`."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tfuse import functional as F
from tfuse.nn._common import act_kwargs, act_repr, fx_leaf_call, resolve_activation

#: Whether this torch's GroupNorm takes ``bias=`` (2.13 does; older versions may not); tfuse's layer takes it
#: either way.
_TORCH_GROUPNORM_HAS_BIAS = "bias" in inspect.signature(nn.GroupNorm.__init__).parameters


def _activation_of(norm: nn.Module, owner: str, act: str | None, negative_slope: float | None):  # type: ignore[no-untyped-def]
    """The activation a converted layer computes: ``act``, or (None) the one ``norm`` already applies."""
    if act is None:
        if negative_slope is not None:
            raise ValueError(f"{owner}: negative_slope={negative_slope!r} needs act='leaky_relu'")
        return getattr(norm, "act", "identity"), getattr(norm, "negative_slope", None)
    return act, negative_slope


class FusedGroupNormAct(nn.GroupNorm):
    """``act(GroupNorm(x) + residual)``: a drop-in subclass of ``nn.GroupNorm``.

    The same constructor (positional and keyword, ``bias=`` included), parameters (``weight``,
    ``bias``), state dict and ``reset_parameters``; ``act`` (default
    identity: exactly ``nn.GroupNorm``) and ``negative_slope`` are keyword-only.
    ``forward(x, residual=None)``. NCHW and channels_last inputs are read in
    place. Diffusion UNets' and ResNet-GN's GroupNorm + SiLU is
    ``FusedGroupNormAct(32, C, act="silu")``.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedGroupNormAct
        >>> layer = FusedGroupNormAct(4, 8, act="silu")
        >>> x = torch.randn(2, 8, 5, 5)
        >>> eager = torch.nn.functional.silu(torch.nn.GroupNorm(4, 8)(x))
        >>> torch.allclose(layer(x), eager, atol=1e-5)
        True
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device=None,  # type: ignore[no-untyped-def]
        dtype=None,
        *,
        bias: bool = True,
        act: str = "identity",
        negative_slope: float | None = None,
    ) -> None:
        act, negative_slope = resolve_activation(type(self).__name__, act, negative_slope)
        extra = {"bias": bias} if _TORCH_GROUPNORM_HAS_BIAS else {}
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype, **extra)
        if not _TORCH_GROUPNORM_HAS_BIAS and not bias and self.affine:
            self.register_parameter("bias", None)
        self.act, self.negative_slope = act, negative_slope

    def reset_parameters(self) -> None:
        # torch 2.13's own, which also serves torch versions whose GroupNorm has no bias=False.
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        traced = fx_leaf_call(self, x, residual)
        if traced is not None:
            return traced
        return F.group_norm_act(
            x, self.num_groups, self.weight, self.bias, self.eps, residual=residual,
            **act_kwargs(self.act, self.negative_slope),
        )  # fmt: skip

    @classmethod
    def from_groupnorm(
        cls, norm: nn.GroupNorm, *, act: str | None = None, negative_slope: float | None = None
    ) -> FusedGroupNormAct:
        """A fused layer sharing ``norm``'s parameters (the same objects, not copies); ``act=None`` computes
        what ``norm`` computed (identity for ``nn.GroupNorm``).

        Example:
            >>> import torch
            >>> from tfuse.nn import FusedGroupNormAct
            >>> FusedGroupNormAct.from_groupnorm(torch.nn.GroupNorm(4, 8), act="silu")
            FusedGroupNormAct(4, 8, eps=1e-05, affine=True, bias=True, act='silu')
        """
        if not isinstance(norm, nn.GroupNorm):
            raise TypeError(f"{cls.__name__}.from_groupnorm expects an nn.GroupNorm, got {type(norm).__name__}")
        act, negative_slope = _activation_of(norm, f"{cls.__name__}.from_groupnorm", act, negative_slope)
        module = cls(
            norm.num_groups, norm.num_channels, norm.eps, norm.affine, device="meta",
            bias=norm.bias is not None or not norm.affine, act=act, negative_slope=negative_slope,
        )  # fmt: skip
        module.weight, module.bias = norm.weight, norm.bias
        module.train(norm.training)
        return module

    def extra_repr(self) -> str:
        base = super().extra_repr()
        if "bias=" not in base and self.affine:
            base += f", bias={self.bias is not None}"  # torch versions without GroupNorm(bias=) do not say
        return f"{base}, {act_repr(self.act, self.negative_slope)}"


class FusedLayerNormAct(nn.LayerNorm):
    """``act(LayerNorm(x) + residual)``: a drop-in subclass of ``nn.LayerNorm``.

    The same constructor (positional and keyword, ``bias=`` included),
    parameters, state dict and ``reset_parameters``; ``act`` (default
    identity: exactly ``nn.LayerNorm``) and ``negative_slope`` are keyword-only.
    ``forward(x, residual=None)``.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedLayerNormAct
        >>> layer = FusedLayerNormAct(16, act="gelu")
        >>> x = torch.randn(4, 16)
        >>> torch.allclose(layer(x), torch.nn.functional.gelu(torch.nn.LayerNorm(16)(x)), atol=1e-5)
        True
    """

    def __init__(
        self,
        normalized_shape,  # type: ignore[no-untyped-def]
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        act: str = "identity",
        negative_slope: float | None = None,
    ) -> None:
        act, negative_slope = resolve_activation(type(self).__name__, act, negative_slope)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.act, self.negative_slope = act, negative_slope

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        traced = fx_leaf_call(self, x, residual)
        if traced is not None:
            return traced
        return F.layer_norm_act(
            x, self.normalized_shape, self.weight, self.bias, self.eps, residual=residual,
            **act_kwargs(self.act, self.negative_slope),
        )  # fmt: skip

    @classmethod
    def from_layernorm(
        cls, norm: nn.LayerNorm, *, act: str | None = None, negative_slope: float | None = None
    ) -> FusedLayerNormAct:
        """A fused layer sharing ``norm``'s parameters (the same objects, not copies); ``act=None`` computes
        what ``norm`` computed (identity for ``nn.LayerNorm``).

        Example:
            >>> import torch
            >>> from tfuse.nn import FusedLayerNormAct
            >>> FusedLayerNormAct.from_layernorm(torch.nn.LayerNorm(16), act="gelu")
            FusedLayerNormAct((16,), eps=1e-05, elementwise_affine=True, bias=True, act='gelu')
        """
        if not isinstance(norm, nn.LayerNorm):
            raise TypeError(f"{cls.__name__}.from_layernorm expects an nn.LayerNorm, got {type(norm).__name__}")
        act, negative_slope = _activation_of(norm, f"{cls.__name__}.from_layernorm", act, negative_slope)
        module = cls(
            norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None or not
            norm.elementwise_affine, device="meta", act=act, negative_slope=negative_slope,
        )  # fmt: skip
        module.weight, module.bias = norm.weight, norm.bias
        module.train(norm.training)
        return module

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {act_repr(self.act, self.negative_slope)}"
