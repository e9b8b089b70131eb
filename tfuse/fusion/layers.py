"""Which layers fuse with an adjacent activation, and what each becomes (shared by both rewrites).

Batch norms, nn.GroupNorm, nn.LayerNorm and nn.Linear take the activation
that follows them; a depthwise nn.Conv2d takes the activation that precedes
it (``act_in``).
"""

from __future__ import annotations

from torch import nn

from tfuse.fusion import activations
from tfuse.fusion.activations import ActivationCall, Unsupported
from tfuse.fusion.tracing import HOOK_ATTRIBUTES
from tfuse.nn import (
    BatchNormBoundDepthwiseConv2d,
    FusedActDepthwiseConv2d,
    FusedBatchNormAct1d,
    FusedBatchNormAct2d,
    FusedGroupNormAct,
    FusedLayerNormAct,
    FusedLinear,
)

#: Batch norm layers (exact types: a subclass may compute something else) -> their fused layer.
FUSED_BATCH_NORM: dict[type, type] = {nn.BatchNorm1d: FusedBatchNormAct1d, nn.BatchNorm2d: FusedBatchNormAct2d}
#: Group and layer norms (exact types) -> their fused layer.
FUSED_NORM: dict[type, type] = {nn.GroupNorm: FusedGroupNormAct, nn.LayerNorm: FusedLayerNormAct}


def is_batch_norm(module: nn.Module) -> bool:
    return type(module) in FUSED_BATCH_NORM


def is_group_or_layer_norm(module: nn.Module) -> bool:
    return type(module) in FUSED_NORM


def is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def act_switch(module: nn.Module) -> str | None:
    """The FusionStrategy switch for ``module`` taking the activation that follows it; None: no such layer."""
    if is_batch_norm(module):
        return "fuse_bn_act"
    if is_group_or_layer_norm(module):
        return "fuse_norm_act"
    return "fuse_linear_act" if is_linear(module) else None


def fused_layer(layer: nn.Module, found: ActivationCall) -> tuple[nn.Module, str]:
    """``layer`` (a batch, group or layer norm, or nn.Linear) fused with the activation ``found``, sharing its
    parameters and buffers; and the pattern's name for the report (``"BatchNorm2d+ReLU"``)."""
    slope = found.negative_slope
    if is_linear(layer):
        return FusedLinear.from_linear(layer, act=found.act, negative_slope=slope), f"Linear+{found.display}"
    kind = f"{type(layer).__name__}+{found.display}"
    if isinstance(layer, nn.GroupNorm):  # exact, or a recognised norm-act (as below)
        return FusedGroupNormAct.from_groupnorm(layer, act=found.act, negative_slope=slope), kind
    if isinstance(layer, nn.LayerNorm):
        return FusedLayerNormAct.from_layernorm(layer, act=found.act, negative_slope=slope), kind
    base = next(norm for norm in FUSED_BATCH_NORM if isinstance(layer, norm))
    return FUSED_BATCH_NORM[base].from_batchnorm(layer, act=found.act, negative_slope=slope), kind


#: timm's norm + activation modules (timm.layers.norm_act) that fuse: F.batch_norm / F.group_norm /
#: F.layer_norm as their base computes it, then ``drop``, then ``act``; by class name -> that base.
_TIMM_NORM_ACT = {
    "BatchNormAct2d": nn.BatchNorm2d,
    "GroupNormAct": nn.GroupNorm,
    "GroupNorm1Act": nn.GroupNorm,
    "LayerNormAct": nn.LayerNorm,
}
#: timm's layer norm + activation modules that compute what no fused layer does: what each computes.
_TIMM_NOT_FUSED = {
    "LayerNormAct2d": "normalises the channels of an NCHW tensor (permuted to the last dimension and back)",
    "LayerNormAct2dFp32": "normalises the channels of an NCHW tensor (permuted) in float32, cast back to its dtype",
    "LayerNormActFp32": "normalises in float32, cast back to the input's dtype before the activation",
}


def norm_act_module(module: nn.Module) -> ActivationCall | Unsupported | str | None:
    """The activation of a norm module that applies its own (timm's ``BatchNormAct2d``, ``GroupNormAct``,
    ``GroupNorm1Act``, ``LayerNormAct``: the norm, its ``drop``, then its ``act``), when ``drop`` does
    nothing; None for any other module.

    Recognised by class and package (a class of the same name elsewhere may compute something else), and
    only when the activation is a plain module tfuse knows (else Unsupported, to be reported). A str is the
    report's reason for one that applies an activation but cannot be fused (timm's ``LayerNormAct2d``, or
    timm's "fast norm", which computes in 16 bits under autocast where the fused layer would not).
    """
    kind = type(module)
    if not kind.__module__.startswith("timm."):
        return None
    base = _TIMM_NORM_ACT.get(kind.__name__, nn.LayerNorm if kind.__name__ in _TIMM_NOT_FUSED else None)
    if base is None or not isinstance(module, base) or type(getattr(module, "drop", None)) is not nn.Identity:
        return None
    act = getattr(module, "act", None)
    if not isinstance(act, nn.Module) or type(act) is nn.Identity:
        return None
    if kind.__name__ in _TIMM_NOT_FUSED:
        return f"is timm's {kind.__name__}: it {_TIMM_NOT_FUSED[kind.__name__]}, which no fused layer computes"
    if getattr(module, "_fast_norm", False):
        return (
            f"is timm's {kind.__name__} with fast norm on (it normalises in 16 bits under autocast, the fused "
            "layer in float32)"
        )
    found = activations.of_module(act)
    if found is None:
        return Unsupported(type(act).__name__)
    return found


def hooks_reason(module: nn.Module) -> str | None:
    """The report's reason for leaving a module with hooks alone (a fused call would not run them)."""
    kinds = [
        name.strip("_").replace("_", " ").removesuffix("s") for name in HOOK_ATTRIBUTES if getattr(module, name, None)
    ]
    if not kinds:
        return None
    return f"has a {' and a '.join(kinds)} on {type(module).__name__} (a fused call would not run it)"


def subclass_reason(module: nn.Module) -> str | None:
    """The report's reason for a subclass of a fusable layer: it may compute something else, so it is not fused."""
    for base in (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm, nn.Linear):
        if isinstance(module, base) and type(module) is not base:
            return (
                f"is a {type(module).__name__}, a subclass of nn.{base.__name__}: only nn.{base.__name__} itself is "
                "fused (a subclass may compute something else)"
            )
    return None


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


def bound_depthwise(bn: nn.BatchNorm2d, conv: nn.Conv2d, found: ActivationCall) -> nn.Module:
    """The depthwise ``conv`` (parameters shared) normalising its input with ``bn`` and applying ``found``."""
    return BatchNormBoundDepthwiseConv2d.from_modules(bn, conv, act=found.act, negative_slope=found.negative_slope)


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
