"""``FusedBatchNormAct1d`` / ``FusedBatchNormAct2d``: BatchNorm (+ residual) + activation in fused kernels."""

from __future__ import annotations

import torch
from torch import nn

from tfuse import functional as F
from tfuse.ops._activations import check_activation


class _FusedBatchNormActMixin:
    """forward(x, residual=None) = act(batch_norm(x) + residual), with torch's BatchNorm semantics."""

    act: str
    negative_slope: float

    def __init__(
        self,
        num_features: int,
        act: str = "relu",
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        negative_slope: float = 0.01,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.act, self.negative_slope = check_activation(type(self).__name__, act, negative_slope)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        self._check_input_dim(x)  # type: ignore[attr-defined]
        # Momentum and statistics choice exactly as torch's _BatchNorm.forward.
        if self.momentum is None:  # type: ignore[attr-defined]
            factor = 0.0
        else:
            factor = self.momentum  # type: ignore[attr-defined]
        if self.training and self.track_running_stats:  # type: ignore[attr-defined]
            if self.num_batches_tracked is not None:  # type: ignore[attr-defined]
                self.num_batches_tracked.add_(1)  # type: ignore[attr-defined]
                if self.momentum is None:  # cumulative moving average
                    factor = 1.0 / float(self.num_batches_tracked)  # type: ignore[attr-defined]
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)  # type: ignore[attr-defined]
        tracked = not self.training or self.track_running_stats  # type: ignore[attr-defined]
        return F.batch_norm_act(
            x,
            self.running_mean if tracked else None,  # type: ignore[attr-defined]
            self.running_var if tracked else None,  # type: ignore[attr-defined]
            self.weight,  # type: ignore[attr-defined]
            self.bias,  # type: ignore[attr-defined]
            training=use_batch_stats,
            momentum=factor,
            eps=self.eps,  # type: ignore[attr-defined]
            act=self.act,
            negative_slope=self.negative_slope,
            residual=residual,
        )

    @classmethod
    def from_batchnorm(cls, bn: nn.modules.batchnorm._BatchNorm, act: str = "relu", negative_slope: float = 0.01):
        """A fused layer sharing ``bn``'s parameters and running statistics (not copies)."""
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            raise TypeError(f"{cls.__name__}.from_batchnorm expects a BatchNorm layer, got {type(bn).__name__}")
        module = cls(
            bn.num_features, act=act, negative_slope=negative_slope, eps=bn.eps, momentum=bn.momentum,
            affine=bn.affine, track_running_stats=bn.track_running_stats, device="meta",
        )
        module.weight, module.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(module, name, getattr(bn, name))
        module.train(bn.training)
        return module

    def extra_repr(self) -> str:
        slope = f", negative_slope={self.negative_slope}" if self.act == "leaky_relu" else ""
        return f"{super().extra_repr()}, act={self.act!r}{slope}"  # type: ignore[misc]


class FusedBatchNormAct2d(_FusedBatchNormActMixin, nn.BatchNorm2d):
    """``act(BatchNorm2d(x) + residual)`` for ``[N, C, H, W]`` inputs, NCHW or channels_last.

    A subclass of ``nn.BatchNorm2d``: the same parameters and buffers
    (``weight``, ``bias``, ``running_mean``, ``running_var``,
    ``num_batches_tracked``) and the same training/eval semantics, so a
    BatchNorm2d state dict loads unchanged and :meth:`from_batchnorm` converts
    a trained layer. Statistics are float32 whatever the input dtype; the
    whole op is 3 launches forward in training (1 in eval) and backward makes
    two passes over the input.

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as ``nn.BatchNorm2d``.
        act: relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh or identity.
        negative_slope: slope of leaky_relu for negative inputs.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBatchNormAct2d
        >>> bn_relu = FusedBatchNormAct2d(16, act="relu")
        >>> x, skip = torch.randn(4, 16, 8, 8), torch.randn(4, 16, 8, 8)
        >>> bn_relu(x, residual=skip).shape  # relu(bn(x) + skip): a ResNet block's end
        torch.Size([4, 16, 8, 8])
    """


class FusedBatchNormAct1d(_FusedBatchNormActMixin, nn.BatchNorm1d):
    """``act(BatchNorm1d(x) + residual)`` for ``[N, C]`` or ``[N, C, L]`` inputs.

    The 1-D counterpart of :class:`FusedBatchNormAct2d`, a subclass of
    ``nn.BatchNorm1d`` with the same arguments, state dict and semantics.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBatchNormAct1d
        >>> FusedBatchNormAct1d(32, act="gelu")(torch.randn(8, 32)).shape
        torch.Size([8, 32])
    """
