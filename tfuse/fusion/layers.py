"""Which layers fuse with a following activation, and what each becomes (shared by both rewrites)."""

from __future__ import annotations

from torch import nn

from tfuse.fusion.activations import ActivationCall, Unsupported
from tfuse.nn import FusedBatchNormAct1d, FusedBatchNormAct2d, FusedLinear

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
