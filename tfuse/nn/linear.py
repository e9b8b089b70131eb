"""``FusedLinear``: nn.Linear with its bias and activation fused into one kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as torch_F
from torch import nn

from tfuse.nn._common import act_repr, fx_leaf_call, resolve_activation, slope_value
from tfuse.ops import Activation, GradSource
from tfuse.ops.add_act import linear_epilogue


class FusedLinear(nn.Linear):
    """``act(x @ weight.T + bias)``: an ``nn.Linear``, optionally followed by a fused activation.

    A drop-in ``nn.Linear``: the same positional and keyword arguments
    (``in_features, out_features, bias=True, device=None, dtype=None``), the
    same parameters and state dict, and by default the same result, since
    ``act`` defaults to identity (then the layer runs exactly ``nn.Linear``'s
    ``F.linear``). Swapping one for an ``nn.Linear`` - a logits layer, say -
    changes nothing until you ask for an activation with the keyword-only
    ``act``.

    With an activation, the matrix product stays with torch (cuBLAS on a
    GPU); the bias add and the activation run in one tfuse kernel, and in
    backward the activation derivative and the bias gradient come from one
    fused pass plus a small reduction. For relu, sigmoid, tanh, leaky_relu
    (slope >= 0) the epilogue writes in place into the product, so the layer
    allocates one output instead of the two of ``nn.Linear`` + activation;
    for gelu, gelu_tanh and silu it keeps the product for backward, as torch
    keeps ``x @ W.T + b`` for its GELU. Under ``torch.autocast`` it computes
    in the autocast dtype, as ``nn.Linear`` does. :meth:`from_linear`
    converts a trained layer; under ``torch.fx`` the layer is traced as a
    leaf (one ``call_module`` node), as ``nn.Linear`` is.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        act: (keyword-only) identity (default), relu, leaky_relu, gelu,
            gelu_tanh, silu, sigmoid or tanh.
        negative_slope: (keyword-only) slope of leaky_relu for negative inputs
            (default 0.01); an error with any other activation, where it would
            have no effect.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedLinear
        >>> layer = FusedLinear(64, 256, act="gelu")
        >>> layer(torch.randn(8, 64)).shape
        torch.Size([8, 256])
        >>> FusedLinear(64, 10)  # no act: computes what nn.Linear(64, 10) computes
        FusedLinear(in_features=64, out_features=10, bias=True, act='identity')
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        act: str = "identity",
        negative_slope: float | None = None,
    ) -> None:
        act, negative_slope = resolve_activation("nn.FusedLinear", act, negative_slope)
        super().__init__(in_features, out_features, bias, device, dtype)
        self.act = act
        self.negative_slope = negative_slope

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, act: str | None = None, negative_slope: float | None = None
    ) -> FusedLinear:
        """A FusedLinear sharing ``linear``'s parameters (not copies: an optimizer keeps training them).

        The converter never adds an activation you did not name: without
        ``act`` the result computes what ``linear`` computed (identity for an
        ``nn.Linear``; the same activation for a FusedLinear).

        Example:
            >>> import torch
            >>> from tfuse.nn import FusedLinear
            >>> hidden = FusedLinear.from_linear(torch.nn.Linear(16, 64), act="gelu")
            >>> logits = FusedLinear.from_linear(torch.nn.Linear(64, 10))  # act='identity'
            >>> logits.act
            'identity'
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FusedLinear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        if act is None:
            if negative_slope is not None:
                raise ValueError(f"FusedLinear.from_linear: negative_slope={negative_slope!r} needs act='leaky_relu'")
            act, negative_slope = getattr(linear, "act", "identity"), getattr(linear, "negative_slope", None)
        module = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            device="meta",
            act=act,
            negative_slope=negative_slope,
        )
        module.weight = linear.weight
        module.bias = linear.bias
        module.train(linear.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        traced = fx_leaf_call(self, x)
        if traced is not None:
            return traced
        bias = self.bias
        act = Activation.from_name(self.act)
        if act is Activation.IDENTITY:
            if bias is not None and x.dtype == self.weight.dtype:
                self._check_bias_dtype(bias, self.weight.dtype, x.device)
            return torch_F.linear(x, self.weight, bias)  # exactly nn.Linear
        product = torch_F.linear(x, self.weight)
        if bias is not None and bias.dtype != product.dtype:
            self._check_bias_dtype(bias, product.dtype, product.device)
            bias = bias.to(product.dtype)  # nn.Linear's addmm casts its bias the same way under autocast
        # The product is ours alone: activations whose gradient follows from
        # their output overwrite it instead of allocating a second tensor.
        return linear_epilogue(product, bias, act, slope_value(self.negative_slope), inplace=self._epilogue_in_place)

    @staticmethod
    def _check_bias_dtype(bias: torch.Tensor, product_dtype: torch.dtype, device: torch.device) -> None:
        if bias.dtype != product_dtype and not torch.is_autocast_enabled(device.type):
            raise RuntimeError(
                f"nn.FusedLinear: bias has dtype {bias.dtype} but the product of input and weight has "
                f"{product_dtype}; keep the layer's parameters in one dtype (or use torch.autocast)"
            )

    @property
    def _epilogue_in_place(self) -> bool:
        """The activation's backward needs no pre-activation, so the product may be overwritten."""
        source = Activation.from_name(self.act).grad_source(slope_value(self.negative_slope))
        return source is not GradSource.INPUT

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {act_repr(self.act, self.negative_slope)}"
