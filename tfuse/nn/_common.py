"""What every tfuse module shares: activation arguments, reprs, and torch.fx tracing as a leaf."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from tfuse.ops import DEFAULT_NEGATIVE_SLOPE, Activation, check_activation

# Modules keep ``act`` as the public string (it is in their repr and users read
# and compare it); the helpers below resolve it to its table entry, a dict lookup.


def resolve_activation(owner: str, act: object, negative_slope: object) -> tuple[str, float | None]:
    """Checks a module's ``act`` / ``negative_slope`` pair; returns ``(act, slope)``.

    ``negative_slope`` only means something for leaky_relu: there it defaults
    to 0.01 (as ``nn.LeakyReLU``), and giving it with any other activation is
    an error rather than a silently ignored argument. The slope returned is
    None for every activation but leaky_relu.

    Raises:
        TypeError: a non-string ``act`` or a non-number ``negative_slope``.
        ValueError: an unknown activation, a non-finite slope, or a slope given
            with an activation other than leaky_relu.
    """
    slope = DEFAULT_NEGATIVE_SLOPE if negative_slope is None else negative_slope
    activation, slope = check_activation(owner, act, slope)
    if not activation.takes_slope:
        if negative_slope is not None:
            raise ValueError(
                f"tfuse.{owner}: negative_slope={negative_slope!r} has no effect with act={activation.label!r}; "
                f"it is the slope of act='leaky_relu' only"
            )
        return activation.label, None
    return activation.label, slope


def act_kwargs(act: str, negative_slope: float | None) -> dict[str, Any]:
    """Keyword arguments of a tfuse functional call for this activation (the slope only for leaky_relu)."""
    if Activation.from_name(act).takes_slope:
        return {"act": act, "negative_slope": negative_slope}
    return {"act": act}


def slope_value(negative_slope: float | None) -> float:
    """The slope as the kernels take it: a float whatever the activation (ignored unless leaky_relu)."""
    return DEFAULT_NEGATIVE_SLOPE if negative_slope is None else negative_slope


def act_repr(act: str, negative_slope: float | None) -> str:
    """``act='relu'``, or ``act='leaky_relu', negative_slope=0.2``: the activation part of a module's repr."""
    if Activation.from_name(act).takes_slope:
        return f"act={act!r}, negative_slope={negative_slope}"
    return f"act={act!r}"


def torch_activation(y: torch.Tensor, act: str, negative_slope: float | None) -> torch.Tensor:
    """``act(y)`` with torch's own (out-of-place) functions."""
    return Activation.from_name(act).forward(y, slope_value(negative_slope))


def fx_leaf_call(module: torch.nn.Module, *args: Any) -> fx.Proxy | None:
    """Under ``torch.fx`` symbolic tracing, records ``module(*args)`` as one ``call_module`` node.

    torch.fx traces through a module's forward unless the module is a leaf,
    and its default tracer takes only torch's own layers as leaves. A tfuse
    forward checks its inputs and picks a kernel, which symbolic values
    cannot do, so each tfuse module calls this first: while tracing it makes
    the module a leaf itself (the graph calls the module, as it calls an
    ``nn.BatchNorm2d``, so train/eval switches and state stay live), and
    outside tracing it returns None and the forward goes on.

    Tracing a tfuse module alone (as the root) is an error, as it is for
    ``nn.BatchNorm2d``: trace a model that contains it.
    """
    proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
    if proxy is None:
        return None
    tracer = proxy.tracer
    path = tracer.path_of_module(module)
    if not path:
        raise TypeError(
            f"torch.fx: {type(module).__name__} is traced as a leaf module (a call_module node), so it cannot be "
            f"the root of a trace; trace a model that contains it, e.g. torch.nn.Sequential(module)"
        )
    return tracer.create_proxy("call_module", path, args, {})


def batch_norm_call(bn: torch.nn.Module) -> dict[str, Any]:
    """The statistics arguments of one call of a batch norm module, chosen exactly as torch's
    ``_BatchNorm.forward`` chooses them (``num_batches_tracked`` counted; ``momentum=None`` is the cumulative
    average ``1 / num_batches_tracked``): running statistics (None where batch statistics are used without
    tracking), ``training`` (batch statistics or not) and ``momentum``, as keyword arguments of tfuse's ops."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # cumulative moving average
            factor = 1.0 / float(bn.num_batches_tracked)
    use_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    tracked = not bn.training or bn.track_running_stats
    return {
        "running_mean": bn.running_mean if tracked else None,
        "running_var": bn.running_var if tracked else None,
        "training": use_batch_stats,
        "momentum": factor,
    }
