"""One call fuses a whole model: :func:`fuse_model`, steered by a :class:`FusionStrategy`, reported in a
:class:`FusionReport`."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from tfuse.fusion.report import Fused, FusionReport, Skipped
from tfuse.fusion.strategy import FusionStrategy

logger = logging.getLogger(__name__)

__all__ = [
    "BucketTuning",
    "Fused",
    "FusionReport",
    "FusionStrategy",
    "Setup",
    "Skipped",
    "fuse_model",
    "setup",
    "tune_buckets",
]


def fuse_model(
    model: nn.Module, strategy: FusionStrategy | None = None, example_inputs: Any = None
) -> tuple[nn.Module, FusionReport]:
    """Replaces the fusable patterns of ``model`` with tfuse layers; returns the fused model and a report.

    Patterns (each switch of ``strategy``): BatchNorm1d/2d -> activation;
    BatchNorm -> residual add -> activation; Linear -> activation; add ->
    activation; activation -> depthwise Conv2d (``FusedActDepthwiseConv2d``,
    for an activation that no batch norm or Linear before it has taken).
    Activations: relu, leaky_relu, gelu (both forms), silu, sigmoid, tanh,
    relu6 (and Hardtanh(0, 6)), hardtanh (-1 to 1), hardswish, hardsigmoid,
    mish, elu (alpha 1), as modules, functions or tensor methods.

    Where the forward traces with ``torch.fx``, the traced computation is
    rewritten (a ``torch.fx.GraphModule`` with the original's module names):
    patterns are found in what the forward computes, whatever the order the
    modules were registered in; a module called at several places, or a
    layer whose output feeds a branch, is left as it is and reported. Where
    it does not trace, only neighbours inside ``nn.Sequential`` containers
    are fused (a conservative fallback), and the report says why.

    Either way the original model is not changed: the fused model shares its
    parameters and buffers (training one trains the other), holds the same
    state-dict keys (checkpoints load both ways), and computes the same
    outputs and gradients within floating-point rounding, in train and eval
    mode. A GraphModule keeps the original's submodules and forward, not its
    other methods and attributes.

    Args:
        model: the model to fuse.
        strategy: which patterns to fuse (default: all).
        example_inputs: a tensor or tuple of the forward's positional inputs:
            with them, shapes decide the residual and add patterns (the model
            runs once in eval mode without gradients; nothing in it changes).

    Example:
        >>> import torch, tfuse
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> fused, report = tfuse.fuse_model(model)
        >>> print(report)
        fused 1 BatchNorm2d+ReLU (torch.fx)
        >>> type(fused.get_submodule("1")).__name__  # a GraphModule, with the original's module names
        'FusedBatchNormAct2d'
    """
    from tfuse.fusion.graph import fuse_graph
    from tfuse.fusion.structural import fuse_sequentials

    if not isinstance(model, nn.Module):
        raise TypeError(f"tfuse.fuse_model: model must be a torch.nn.Module, got {type(model).__name__}")
    strategy = FusionStrategy() if strategy is None else strategy
    if not isinstance(strategy, FusionStrategy):
        raise TypeError(f"tfuse.fuse_model: strategy must be a tfuse.FusionStrategy, got {type(strategy).__name__}")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        fused, report = fuse_graph(model, strategy, example_inputs)
    except Exception as error:  # the forward does not trace (data-dependent control flow, ...)
        note = f"torch.fx could not trace the forward: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        fused, report = fuse_sequentials(model, strategy, note)
    logger.info("tfuse.fuse_model: %s", report)
    if report.note:
        logger.info("tfuse.fuse_model: %s", report.note)
    return fused, report


from tfuse.fusion.setup_training import Setup, setup  # noqa: E402  (setup uses fuse_model)
from tfuse.fusion.tune import BucketTuning, tune_buckets  # noqa: E402
