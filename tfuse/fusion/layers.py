"""Which layers fuse with an adjacent activation, and what each becomes (shared by both rewrites).

Batch norms and nn.Linear take the activation that follows them; a depthwise
nn.Conv2d takes the activation that precedes it (``act_in``).
"""

from __future__ import annotations

from torch import nn

from tfuse.fusion.activations import ActivationCall, Unsupported
from tfuse.nn import FusedActDepthwiseConv2d, FusedBatchNormAct1d, FusedBatchNormAct2d, FusedLinear

#: Batch norm layers (exact types: a subclass may compute something else) -> their fused layer.
FUSED_BATCH_NORM: dict[type, type] = {nn.BatchNorm1d: FusedBatchNormAct1d, nn.BatchNorm2d: FusedBatchNormAct2d}


def is_batch_norm(module: nn.Module) -> bool:
    return type(module) in FUSED_BATCH_NORM


def is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def fused_layer(layer: nn.Module, found: ActivationCall) -> tuple[nn.Module, str]:
    """``layer`` (a batch norm or nn.Linear) fused with the activation ``found``, sharing its parameters and
    buffers; and the pattern's name for the report (``"BatchNorm2d+ReLU"``)."""
    if is_linear(layer):
        return FusedLinear.from_linear(layer, act=found.act, negative_slope=found.negative_slope), (
            f"Linear+{found.display}"
        )
    fused = FUSED_BATCH_NORM[type(layer)].from_batchnorm(layer, act=found.act, negative_slope=found.negative_slope)
    return fused, f"{type(layer).__name__}+{found.display}"


def unsupported_reason(found: Unsupported) -> str:
    """The report's reason for a layer followed by an activation without a fused kernel."""
    return f"is followed by {found.name}, which has no fused kernel in tfuse yet"


def is_grouped_conv(module: nn.Module) -> bool:
    """An nn.Conv2d with ``groups > 1`` (exact type): a candidate for taking the preceding activation. Dense
    convolutions are not candidates, and are not reported."""
    return type(module) is nn.Conv2d and module.groups > 1


def depthwise_mismatch(conv: nn.Conv2d, act: str) -> str | None:
    """Why the grouped ``conv``, after the activation ``act`` (its name in reports), cannot take it as its
    ``act_in``; None when it can (depthwise, depth multiplier 1, zero padding)."""
    channels = conv.in_channels
    if conv.groups != channels:
        return (
            f"follows {act} but is a grouped convolution (groups={conv.groups} for {channels} channels), "
            "not a depthwise one"
        )
    if conv.out_channels != channels:
        return (
            f"follows {act} but has depth multiplier {conv.out_channels // channels} (out_channels="
            f"{conv.out_channels}, in_channels={channels}); the fused kernel needs 1"
        )
    if conv.padding_mode != "zeros":
        return f"follows {act} but pads with padding_mode={conv.padding_mode!r}; the fused kernel pads with zeros"
    return None


def fused_depthwise(conv: nn.Conv2d, found: ActivationCall) -> tuple[nn.Module, str]:
    """The depthwise ``conv`` with the preceding activation ``found`` as its ``act_in``, sharing its parameters;
    and the pattern's name for the report (``"ReLU6+depthwise Conv2d"``)."""
    fused = FusedActDepthwiseConv2d.from_conv(conv, act_in=found.act, negative_slope=found.negative_slope)
    return fused, f"{found.display}+depthwise Conv2d"


def unsupported_before_reason(found: Unsupported) -> str:
    """The report's reason for a depthwise convolution after an activation without a fused kernel."""
    return f"follows {found.name}, which has no fused kernel in tfuse yet"


def in_place_reason(act: str) -> str:
    """The report's reason for a depthwise convolution after an in-place activation whose input may be read
    elsewhere (removing the activation would leave that tensor unchanged)."""
    return f"follows an in-place {act} on a tensor that may be read elsewhere (fusing would leave it unchanged)"


#: Layers whose output is a tensor of their own (never their input or a view of it).
_NEW_TENSOR_LAYERS = (
    nn.modules.conv._ConvNd,
    nn.Linear,
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
)


def makes_new_tensor(module: nn.Module) -> bool:
    """Whether ``module``'s output is a new tensor: an in-place activation on it changes nothing else."""
    return isinstance(module, _NEW_TENSOR_LAYERS)
