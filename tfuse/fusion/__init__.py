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
    BatchNorm -> residual add -> activation; GroupNorm or LayerNorm (->
    residual add) -> activation; Linear -> activation; add -> activation;
    activation -> depthwise Conv2d (``FusedActDepthwiseConv2d``, for an
    activation that no norm or Linear before it has taken).
    Activations: relu, leaky_relu, gelu (both forms), silu, sigmoid, tanh,
    relu6 (and Hardtanh(0, 6)), hardtanh (-1 to 1), hardswish, hardsigmoid,
    mish, elu (alpha 1), as modules, functions or tensor methods.

    The forward is traced with ``torch.fx`` on a shadow copy (the original's
    attributes and buffers are never written), in train mode and in eval
    mode, and the traced computation rewritten: a ``torch.fx.GraphModule``
    (:class:`~tfuse.fusion.model.FusedGraphModule`) over new module objects
    that share the original's parameters and buffers, with the original's
    module names, ``state_dict`` keys and parameter order (checkpoints and
    optimizer state dicts load both ways). A forward that branches on
    ``self.training`` gives two graphs, and the fused model runs the one of its
    mode. Left as they are, and reported: a module called at several places, a
    layer whose output feeds a branch, a layer or activation with hooks (a
    fused call would skip them; hooks on the model itself move to the fused
    model), an in-place add into a tensor something else reads, subclasses of
    the norms and of Linear (timm's ``BatchNormAct2d``, ``GroupNormAct`` and
    ``LayerNormAct`` are recognised and fused).
    Where the forward does not trace, fusion happens inside the parts that the
    forward calls whole (its source says so): ``nn.Sequential`` neighbours,
    and blocks whose own forward traces. Where nothing fuses, ``model`` itself
    is returned.

    The fused model computes what the original computes, within
    floating-point rounding, in train and eval mode; training one trains the
    other (shared parameters and buffers, until one is moved with ``.to()``).
    A GraphModule keeps the original's submodules and forward, not its other
    methods and attributes.

    Args:
        model: the model to fuse.
        strategy: which patterns to fuse (default: all).
        example_inputs: a tensor or tuple of the forward's positional inputs:
            with them, shapes decide the residual and add patterns (a shadow
            copy runs once in eval mode without gradients; nothing of the
            model changes).

    Raises:
        TypeError: ``model`` is not a module or ``strategy`` not a FusionStrategy.
        ValueError: the forward fails on ``example_inputs`` (their shapes are named).

    Example:
        >>> import torch, tfuse
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> fused, report = tfuse.fuse_model(model)
        >>> print(report)
        fused 1 BatchNorm2d+ReLU (torch.fx)
        >>> type(fused.get_submodule("1")).__name__  # a GraphModule, with the original's module names
        'FusedBatchNormAct2d'
    """
    from tfuse.fusion.build import fuse_traced
    from tfuse.fusion.partial import fuse_untraced
    from tfuse.fusion.tracing import trace_modes

    if not isinstance(model, nn.Module):
        raise TypeError(f"tfuse.fuse_model: model must be a torch.nn.Module, got {type(model).__name__}")
    strategy = FusionStrategy() if strategy is None else strategy
    if not isinstance(strategy, FusionStrategy):
        raise TypeError(f"tfuse.fuse_model: strategy must be a tfuse.FusionStrategy, got {type(strategy).__name__}")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        traced = trace_modes(model)
    except Exception as error:  # the forward does not trace (data-dependent control flow, ...)
        note = f"torch.fx could not trace the forward: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        fused, report = fuse_untraced(model, strategy, example_inputs, note)
    else:
        fused, report = fuse_traced(model, traced, strategy, example_inputs)
    if fused is model:
        report.note = (report.note + "; " if report.note else "") + "nothing fused: the model is returned as it is"
    logger.info("tfuse.fuse_model: %s", report)
    if report.note:
        logger.info("tfuse.fuse_model: %s", report.note)
    return fused, report


from tfuse.fusion.setup_training import Setup, setup  # noqa: E402  (setup uses fuse_model)
from tfuse.fusion.tune import BucketTuning, tune_buckets  # noqa: E402
