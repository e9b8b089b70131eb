"""Fusion of neighbours in an ``nn.Sequential`` that untraced code calls whole (see :mod:`tfuse.fusion.partial`).

An ``nn.Sequential`` runs its children one after another, so a BatchNorm,
GroupNorm, LayerNorm or Linear child followed by an activation child computes
act(layer(x)) when the container is called whole. That pair becomes the fused
layer and an ``nn.Identity`` in the activation's slot, so indices and
state-dict keys stay.
Likewise an activation child followed by a depthwise nn.Conv2d child (not
taken by a norm or Linear before it) becomes an ``nn.Identity`` and a
``FusedActDepthwiseConv2d``; an in-place activation only when the child
before it is a layer with an output of its own (a convolution, Linear or
norm), since the container's input may be the caller's tensor. A child with
hooks is not fused (a fused call would not run them). Nothing else is touched.
"""

from __future__ import annotations

from torch import nn

from tfuse.fusion import activations
from tfuse.fusion.layers import (
    act_switch,
    depthwise_mismatch,
    fused_depthwise,
    fused_layer,
    hooks_reason,
    in_place_reason,
    is_grouped_conv,
    makes_new_tensor,
    unsupported_before_reason,
    unsupported_reason,
)
from tfuse.fusion.report import Fused, FusionReport, Skipped
from tfuse.fusion.strategy import FusionStrategy


def fuse_neighbours(seq: nn.Sequential, prefix: str, strategy: FusionStrategy, report: FusionReport) -> None:
    """Fuses the neighbouring children of ``seq`` (a container of tfuse's own, it is changed in place)."""
    names = list(seq._modules)
    index = 0
    while index + 1 < len(names):
        name, next_name = names[index], names[index + 1]
        layer, following = seq._modules[name], seq._modules[next_name]
        where = f"{prefix}.{name}" if prefix else name
        found = activations.of_module(following) if following is not None else None
        switch = act_switch(layer)
        fusable = switch is not None and getattr(strategy, switch)
        if found is None or not fusable:
            if strategy.fuse_relu_depthwise_conv and _fuse_depthwise(seq, prefix, index, report):
                index += 2
            else:
                index += 1
            continue
        if isinstance(found, activations.Unsupported):
            report.skipped.append(Skipped(where, unsupported_reason(found)))
            index += 1
            continue
        hooked = hooks_reason(layer) or hooks_reason(following)
        if hooked is not None:
            report.skipped.append(Skipped(where, hooked))
            index += 1
            continue
        fused, kind = fused_layer(layer, found)
        seq._modules[name] = fused
        seq._modules[next_name] = nn.Identity()
        act_where = f"{prefix}.{next_name}" if prefix else next_name
        report.fused.append(Fused(kind, (where, act_where), type(fused).__name__))
        index += 2


def _fuse_depthwise(seq: nn.Sequential, prefix: str, index: int, report: FusionReport) -> bool:
    """Children ``index`` and ``index + 1``, an activation and a depthwise convolution, fused (the activation
    as the convolution's ``act_in``); a grouped convolution after an activation that cannot take it is
    reported."""
    names = list(seq._modules)
    act, conv = seq._modules[names[index]], seq._modules[names[index + 1]]
    found = activations.of_module(act) if act is not None else None
    if found is None or conv is None or not is_grouped_conv(conv):
        return False
    act_where, where = (f"{prefix}.{name}" if prefix else name for name in names[index : index + 2])
    shown = found.name if isinstance(found, activations.Unsupported) else found.display
    reason = depthwise_mismatch(conv, shown)
    if reason is None and isinstance(found, activations.Unsupported):
        reason = unsupported_before_reason(found)
    before = seq._modules[names[index - 1]] if index > 0 else None
    if reason is None and getattr(act, "inplace", False) and (before is None or not makes_new_tensor(before)):
        reason = in_place_reason(shown)
    if reason is None:
        reason = hooks_reason(act) or hooks_reason(conv)
    if reason is not None:
        report.skipped.append(Skipped(where, reason))
        return False
    fused, kind = fused_depthwise(conv, found)
    seq._modules[names[index]] = nn.Identity()
    seq._modules[names[index + 1]] = fused
    report.fused.append(Fused(kind, (act_where, where), type(fused).__name__))
    return True
