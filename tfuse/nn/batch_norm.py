"""Batch norm (+ residual) + activation modules.

``FusedBatchNormAct1d`` / ``FusedBatchNormAct2d`` run it in fused kernels;
``FusedSyncBatchNormAct`` is their ``nn.SyncBatchNorm`` counterpart, which
:func:`convert_sync_batchnorm` (and ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
once tfuse.nn is imported) puts in their place.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
from torch import nn

from tfuse import functional as F
from tfuse.nn._common import act_kwargs, act_repr, batch_norm_call, fx_leaf_call, resolve_activation, torch_activation

#: Whether this torch's BatchNorm takes ``bias=`` (2.13 does; older versions may not);
#: tfuse's layers take it either way.
_TORCH_BATCHNORM_HAS_BIAS = "bias" in inspect.signature(nn.modules.batchnorm._NormBase.__init__).parameters


class _FusedBatchNormActMixin:
    """forward(x, residual=None) = act(batch_norm(x) + residual), with torch's BatchNorm semantics."""

    act: str
    negative_slope: float | None

    def _init_fused(
        self, base_args: tuple, base_kwargs: dict, bias: bool, act: str, negative_slope: float | None
    ) -> None:
        """``base.__init__(*base_args, **base_kwargs)``, then ``bias=False`` (where torch lacks it), the activation."""
        act, negative_slope = resolve_activation(type(self).__name__, act, negative_slope)
        if _TORCH_BATCHNORM_HAS_BIAS:
            base_kwargs = dict(base_kwargs, bias=bias)
        super().__init__(*base_args, **base_kwargs)  # type: ignore[call-arg]
        if not _TORCH_BATCHNORM_HAS_BIAS and not bias and self.affine:  # type: ignore[attr-defined]
            self.register_parameter("bias", None)  # type: ignore[attr-defined]
        self.act, self.negative_slope = act, negative_slope

    def reset_parameters(self) -> None:
        # torch 2.13's own, which also serves torch versions whose BatchNorm has no bias=False.
        self.reset_running_stats()  # type: ignore[attr-defined]
        if self.affine:  # type: ignore[attr-defined]
            nn.init.ones_(self.weight)  # type: ignore[attr-defined]
            if self.bias is not None:  # type: ignore[attr-defined]
                nn.init.zeros_(self.bias)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        traced = fx_leaf_call(self, x, residual)
        if traced is not None:
            return traced
        return self._fused_forward(x, residual)

    def _fused_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        self._check_input_dim(x)  # type: ignore[attr-defined]
        return F.batch_norm_act(
            x,
            weight=self.weight,  # type: ignore[attr-defined]
            bias=self.bias,  # type: ignore[attr-defined]  (None with bias=False: a weight alone, as F.batch_norm takes)
            eps=self.eps,  # type: ignore[attr-defined]
            **batch_norm_call(self),
            residual=residual,
            **act_kwargs(self.act, self.negative_slope),
        )

    def _share_state_of(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        """Takes ``bn``'s parameters, running statistics, mode and qconfig (the same objects, not copies)."""
        self.weight, self.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(self, name, getattr(bn, name))
        self.train(bn.training)  # type: ignore[attr-defined]
        if hasattr(bn, "qconfig"):
            self.qconfig = bn.qconfig

    @classmethod
    def from_batchnorm(
        cls, bn: nn.modules.batchnorm._BatchNorm, *, act: str | None = None, negative_slope: float | None = None
    ):
        """A fused layer sharing ``bn``'s parameters and running statistics (not copies).

        The converter never adds an activation you did not name: without
        ``act`` the result computes what ``bn`` computed (identity for a torch
        BatchNorm; the same activation for a tfuse fused layer). Pass
        ``act="relu"`` (or another) to fuse the activation that follows ``bn``.

        Example:
            >>> import torch
            >>> from tfuse.nn import FusedBatchNormAct2d
            >>> trained = torch.nn.BatchNorm2d(8)
            >>> FusedBatchNormAct2d.from_batchnorm(trained, act="relu")
            FusedBatchNormAct2d(8, eps=1e-05, momentum=0.1, affine=True, bias=True,
                                track_running_stats=True, act='relu')
        """
        return cls._converted(bn, act, negative_slope)

    @classmethod
    def _converted(
        cls, bn: nn.modules.batchnorm._BatchNorm, act: str | None, negative_slope: float | None, **base_kwargs
    ):
        """``cls`` built like ``bn`` (``act=None``: ``bn``'s own activation), holding ``bn``'s state."""
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            raise TypeError(f"{cls.__name__}.from_batchnorm expects a BatchNorm layer, got {type(bn).__name__}")
        if act is None:
            if negative_slope is not None:
                raise ValueError(
                    f"{cls.__name__}.from_batchnorm: negative_slope={negative_slope!r} needs act='leaky_relu'"
                )
            act, negative_slope = getattr(bn, "act", "identity"), getattr(bn, "negative_slope", None)
        module = cls(
            bn.num_features,
            eps=bn.eps,
            momentum=bn.momentum,
            affine=bn.affine,
            track_running_stats=bn.track_running_stats,
            device="meta",
            bias=bn.bias is not None or not bn.affine,
            act=act,
            negative_slope=negative_slope,
            **base_kwargs,
        )
        module._share_state_of(bn)
        return module

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        if "bias=" not in base and self.affine and self.bias is None:  # type: ignore[attr-defined]
            base += ", bias=False"  # torch versions without BatchNorm(bias=) do not say
        return f"{base}, {act_repr(self.act, self.negative_slope)}"


class FusedBatchNormAct2d(_FusedBatchNormActMixin, nn.BatchNorm2d):
    """``act(BatchNorm2d(x) + residual)`` for ``[N, C, H, W]`` inputs, NCHW or channels_last.

    A drop-in subclass of ``nn.BatchNorm2d``: the same constructor
    (positional and keyword), parameters and buffers (``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``num_batches_tracked``), state dict
    and training/eval semantics. ``act`` is keyword-only and defaults to
    identity, so the layer computes exactly what ``nn.BatchNorm2d`` computes
    until you ask for an activation: a model built with it as its norm layer
    (``norm_layer=FusedBatchNormAct2d``) is the model built with
    ``nn.BatchNorm2d``. Name the activation to fuse it, e.g.
    ``FusedBatchNormAct2d(64, act="relu")`` for a ResNet's conv-bn-relu, and
    pass the skip path as ``residual`` for the end of a block.

    Statistics are float32 whatever the input dtype; the whole op is 2
    launches forward in training (1 in eval) and 2 backward (1 when x needs
    no gradient, and in eval). :meth:`from_batchnorm` converts a trained layer;
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` turns the layer into a
    :class:`FusedSyncBatchNormAct` (activation and residual kept); under
    ``torch.fx`` the layer is traced as a leaf (one ``call_module`` node), as
    ``nn.BatchNorm2d`` is. ``copy.deepcopy``, pickling and ``torch.save`` work
    as for any module.

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype:
            as ``nn.BatchNorm2d``, in the same positional order.
        bias: (keyword-only, as in torch 2.13's BatchNorm) False for a layer with a
            learnable scale but no learnable shift (when ``affine``); tfuse
            takes it with every torch version.
        act: (keyword-only) identity (default), relu, leaky_relu, gelu,
            gelu_tanh, silu, sigmoid or tanh.
        negative_slope: (keyword-only) slope of leaky_relu for negative inputs
            (default 0.01); an error with any other activation, where it would
            have no effect.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBatchNormAct2d
        >>> bn_relu = FusedBatchNormAct2d(16, act="relu")
        >>> x, skip = torch.randn(4, 16, 8, 8), torch.randn(4, 16, 8, 8)
        >>> bn_relu(x, residual=skip).shape  # relu(bn(x) + skip): a ResNet block's end
        torch.Size([4, 16, 8, 8])
        >>> FusedBatchNormAct2d(16, 1e-3, 0.01)  # nn.BatchNorm2d's positional order; no activation
        FusedBatchNormAct2d(16, eps=0.001, momentum=0.01, affine=True, bias=True,
                            track_running_stats=True, act='identity')
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        act: str = "identity",
        negative_slope: float | None = None,
    ) -> None:
        self._init_fused(
            (num_features, eps, momentum, affine, track_running_stats),
            {"device": device, "dtype": dtype},
            bias,
            act,
            negative_slope,
        )


class FusedBatchNormAct1d(_FusedBatchNormActMixin, nn.BatchNorm1d):
    """``act(BatchNorm1d(x) + residual)`` for ``[N, C]`` or ``[N, C, L]`` inputs.

    The 1-D counterpart of :class:`FusedBatchNormAct2d`: a drop-in subclass
    of ``nn.BatchNorm1d`` with the same constructor, state dict and
    semantics, and the keyword-only ``act`` (identity by default, so the
    layer is ``nn.BatchNorm1d`` until you name an activation).

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype:
            as ``nn.BatchNorm1d``, in the same positional order.
        bias: (keyword-only, as in torch 2.13's BatchNorm) False for a layer with a
            learnable scale but no learnable shift (when ``affine``); tfuse
            takes it with every torch version.
        act: (keyword-only) identity (default), relu, leaky_relu, gelu,
            gelu_tanh, silu, sigmoid or tanh.
        negative_slope: (keyword-only) slope of leaky_relu for negative inputs
            (default 0.01); an error with any other activation, where it would
            have no effect.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBatchNormAct1d
        >>> FusedBatchNormAct1d(32, act="gelu")(torch.randn(8, 32)).shape
        torch.Size([8, 32])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        act: str = "identity",
        negative_slope: float | None = None,
    ) -> None:
        self._init_fused(
            (num_features, eps, momentum, affine, track_running_stats),
            {"device": device, "dtype": dtype},
            bias,
            act,
            negative_slope,
        )


class FusedSyncBatchNormAct(_FusedBatchNormActMixin, nn.SyncBatchNorm):
    """``act(SyncBatchNorm(x) + residual)``: the ``nn.SyncBatchNorm`` form of the fused layers.

    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)`` (once tfuse.nn
    is imported) and :func:`tfuse.nn.convert_sync_batchnorm` turn every
    :class:`FusedBatchNormAct2d` / :class:`FusedBatchNormAct1d` into this
    layer, sharing its parameters and statistics and keeping its activation
    and ``residual`` argument, so the model computes what it computed.

    When statistics are synchronised - training, with a process group of
    more than one rank - it runs ``nn.SyncBatchNorm``'s forward (torch's
    all-gathered statistics, CUDA inputs only, as in torch), then adds the
    residual and applies the activation with torch ops. Otherwise (eval, a
    single process, a group of one) nothing needs synchronising and it runs
    tfuse's fused kernels, as :class:`FusedBatchNormAct2d` does.

    A subclass of ``nn.SyncBatchNorm`` with its constructor (positional and
    keyword) and state dict.

    Args:
        num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype:
            as ``nn.SyncBatchNorm``, in the same positional order.
        bias, act, negative_slope: keyword-only, as for :class:`FusedBatchNormAct2d`.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBatchNormAct2d, FusedSyncBatchNormAct
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), FusedBatchNormAct2d(8, act="relu"))
        >>> model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        >>> model[1]
        FusedSyncBatchNormAct(8, eps=1e-05, momentum=0.1, affine=True, bias=True, track_running_stats=True, act='relu')
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: object | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        act: str = "identity",
        negative_slope: float | None = None,
    ) -> None:
        self._init_fused(
            (num_features, eps, momentum, affine, track_running_stats, process_group),
            {"device": device, "dtype": dtype},
            bias,
            act,
            negative_slope,
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        traced = fx_leaf_call(self, x, residual)
        if traced is not None:
            return traced
        if not self._synchronises():
            self._check_non_zero_input_channels(x)
            return self._fused_forward(x, residual)
        if residual is not None:  # the checks batch_norm_act makes on the fused path
            if not isinstance(residual, torch.Tensor):
                raise TypeError(
                    "tfuse.FusedSyncBatchNormAct: residual must be a torch.Tensor or None, "
                    f"got {type(residual).__name__}"
                )
            if residual.shape != x.shape:
                raise ValueError(
                    f"tfuse.FusedSyncBatchNormAct: residual must have x's shape {list(x.shape)}, "
                    f"got {list(residual.shape)}"
                )
        y = nn.SyncBatchNorm.forward(self, x)
        if residual is not None:
            y = y + residual
        return torch_activation(y, self.act, self.negative_slope)

    def _synchronises(self) -> bool:
        """Whether nn.SyncBatchNorm.forward would all-gather statistics for this call."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group or dist.group.WORLD) > 1

    @classmethod
    def from_batchnorm(
        cls,
        bn: nn.modules.batchnorm._BatchNorm,
        *,
        act: str | None = None,
        negative_slope: float | None = None,
        process_group: object | None = None,
    ) -> FusedSyncBatchNormAct:
        """A FusedSyncBatchNormAct sharing ``bn``'s parameters and running statistics (not copies).

        As for :meth:`FusedBatchNormAct2d.from_batchnorm`: without ``act``
        the result keeps what ``bn`` computed (identity for a torch
        BatchNorm, the activation of a tfuse fused layer).
        """
        return cls._converted(bn, act, negative_slope, process_group=process_group)


def convert_sync_batchnorm(module: nn.Module, process_group: object | None = None) -> nn.Module:
    """``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` that keeps tfuse's fused activations.

    Every tfuse fused batch-norm layer (:class:`FusedBatchNormAct2d`,
    :class:`FusedBatchNormAct1d`, :class:`FusedSyncBatchNormAct`) becomes a
    :class:`FusedSyncBatchNormAct` with the same activation, sharing its
    parameters and statistics; every other BatchNorm becomes an
    ``nn.SyncBatchNorm``, exactly as torch converts it. Returns the model (or
    the new layer when ``module`` is itself a BatchNorm), as torch does.

    Importing ``tfuse.nn`` makes ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
    do the same (tfuse layers only; torch's own layers are converted by
    torch's code unchanged), so training scripts that call it - torchvision's
    reference scripts do - keep the model's function instead of silently
    dropping the fused activation.

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedBatchNormAct2d, convert_sync_batchnorm
        >>> model = torch.nn.Sequential(FusedBatchNormAct2d(4, act="silu"), torch.nn.BatchNorm2d(4))
        >>> [type(m).__name__ for m in convert_sync_batchnorm(model)]
        ['FusedSyncBatchNormAct', 'SyncBatchNorm']
    """
    return _convert_sync_batchnorm(nn.SyncBatchNorm, module, process_group)


def _install_convert_sync_batchnorm() -> None:
    """Wraps ``nn.SyncBatchNorm.convert_sync_batchnorm`` so that it converts tfuse layers to FusedSyncBatchNormAct."""
    current = nn.SyncBatchNorm.__dict__["convert_sync_batchnorm"].__func__
    torch_convert = getattr(current, "_tfuse_wraps", current)  # once only, even if this module is reloaded

    @functools.wraps(torch_convert)
    def patched(cls, module, process_group=None):
        if isinstance(module, _FusedBatchNormActMixin):
            converted = FusedSyncBatchNormAct.from_batchnorm(module, process_group=process_group)
            for name, child in module.named_children():
                converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
            return converted
        return torch_convert(cls, module, process_group)  # recurses through cls.convert_sync_batchnorm: this

    patched._tfuse_wraps = torch_convert  # type: ignore[attr-defined]
    global _convert_sync_batchnorm
    _convert_sync_batchnorm = patched
    nn.SyncBatchNorm.convert_sync_batchnorm = classmethod(patched)  # type: ignore[method-assign, assignment]


_convert_sync_batchnorm = None  # set by _install_convert_sync_batchnorm
_install_convert_sync_batchnorm()
