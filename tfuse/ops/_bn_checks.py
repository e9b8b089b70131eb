"""The argument checks of ``batch_norm_act`` (tfuse/ops/batch_norm.py), and the calls that passed them.

:func:`_check_call` checks every argument as ``F.batch_norm`` does (in its
words where it has them); :func:`_call_key` is what those checks depend on,
so a layer calling with the same shapes, dtypes and flags step after step is
checked once (:data:`_checked_calls`).
"""

from __future__ import annotations

import functools
import numbers

import torch
import torch.nn.functional as F

from tfuse.ops._activations import Activation, check_activation
from tfuse.ops._checks import check_float_dtype

_PER_CHANNEL = ("running_mean", "running_var", "weight", "bias")

#: Calls whose arguments passed the checks, by :func:`_call_key` -> (activation, slope, channels).
_checked_calls: dict[tuple, tuple[Activation, float, int]] = {}


def _tensor_key(t) -> tuple | None:
    """What the checks read of a tensor argument: dtype, shape, device (None for None; a non-tensor raises)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError  # not cacheable: the checks run and say what is wrong
    return (t.dtype, t.shape, t.device)


def _call_key(x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope):
    """Everything the argument checks depend on, or None when an argument is not a tensor (checked every call).

    The lean path: a layer calls with the same shapes, dtypes and flags step
    after step, so the checks run once per such call and a repeat costs this key.
    """
    try:
        tensors = tuple(map(_tensor_key, (x, running_mean, running_var, weight, bias, residual)))
        return (*tensors, bool(training), type(momentum), type(eps), eps, act, negative_slope)
    except TypeError:  # a non-tensor argument, or an unhashable act/slope/eps: no caching
        return None


def _check_call(x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope):
    """All argument checks of :func:`batch_norm_act`; returns (activation, slope, channels)."""
    act, negative_slope = check_activation("batch_norm_act", act, negative_slope, strict=True)
    for name, value in (("momentum", momentum), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            hint = ""
            if name == "momentum" and value is None:
                hint = (
                    " (momentum=None, a cumulative moving average, is the modules' option: "
                    "they pass 1 / num_batches_tracked)"
                )
            raise TypeError(f"tfuse.batch_norm_act: {name} must be a number, got {type(value).__name__}{hint}")
    channels = _check_inputs(x, running_mean, running_var, weight, bias, residual, training, float(eps))
    return act, negative_slope, channels


def _check_inputs(x, running_mean, running_var, weight, bias, residual, training, eps: float) -> int:
    """Checks the tensors and eps as ``F.batch_norm`` does (in its words where it has them); returns C."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tfuse.batch_norm_act: x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("batch_norm_act", "x", x.dtype)
    if x.dim() < 2:
        raise ValueError(
            f"tfuse.batch_norm_act: x must have at least 2 dimensions [N, C, ...], got shape {list(x.shape)}"
        )
    channels = x.shape[1]
    given = []
    for name, tensor in zip(_PER_CHANNEL, (running_mean, running_var, weight, bias)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tfuse.batch_norm_act: {name} must be a torch.Tensor or None, got {type(tensor).__name__}")
        check_float_dtype("batch_norm_act", name, tensor.dtype)
        if tensor.device != x.device:
            raise RuntimeError(f"tfuse.batch_norm_act: {name} is on {tensor.device} but x is on {x.device}")
        given.append((name, tensor))
    if not training:
        for name, tensor in (("running_mean", running_mean), ("running_var", running_var)):
            if tensor is None:
                raise RuntimeError(
                    f"tfuse.batch_norm_act: {name} must be defined in evaluation mode (training=False "
                    "normalises with the running statistics; pass training=True to use the batch's)"
                )
    if (running_mean is None) != (running_var is None):
        raise ValueError(
            "tfuse.batch_norm_act: running_mean and running_var must either both be None or neither be None"
        )
    sizes = {tuple(t.shape) for _, t in given}
    if given and len(sizes) == 1 and len(next(iter(sizes))) == 1 and next(iter(sizes)) != (channels,):
        # The per-channel tensors agree with each other, not with x: a channel mismatch.
        size = next(iter(sizes))[0]
        names = ", ".join(name for name, _ in given)
        first = given[0][0]
        raise ValueError(
            f"tfuse.batch_norm_act: channel mismatch: x of shape {list(x.shape)} has {channels} channels "
            f"(dimension 1), but {names} have {size} elements, as for an input with {size} channels "
            f"({first} must have shape [{channels}], got [{size}])"
        )
    for name, tensor in given:
        if tensor.shape != (channels,):
            raise ValueError(
                f"tfuse.batch_norm_act: {name} must have shape [{channels}], got {list(tensor.shape)} "
                f"(x has {channels} channels; {name} should contain {channels} elements not {tensor.numel()})"
            )
    # torch's rule (one dtype, x's or float32 for a 16-bit x), plus float32 with a float64 x:
    # statistics are kept in float32 by default, and a float64 x is normalised in float64 either way.
    param_dtypes = {t.dtype for _, t in given}
    if len(param_dtypes) > 1 or not param_dtypes <= {x.dtype, torch.float32}:
        listed = ", ".join(f"{name} {t.dtype}" for name, t in given)
        raise RuntimeError(
            f"tfuse.batch_norm_act: mixed dtype: x is {x.dtype} and {listed}; weight, bias, running_mean and "
            f"running_var must share one dtype, x's or float32"
        )
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(
                f"tfuse.batch_norm_act: residual must be a torch.Tensor or None, got {type(residual).__name__}"
            )
        check_float_dtype("batch_norm_act", "residual", residual.dtype)
        if residual.shape != x.shape:
            raise ValueError(
                f"tfuse.batch_norm_act: residual must have x's shape {list(x.shape)}, got {list(residual.shape)}"
            )
        if residual.device != x.device:
            raise RuntimeError(f"tfuse.batch_norm_act: residual is on {residual.device} but x is on {x.device}")
    if training:
        values_per_channel = x.numel() // max(channels, 1)
        if values_per_channel == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
    if eps <= 0.0:
        refusal = _torch_refuses_eps(float(eps), bool(training))
        if refusal is not None:
            raise ValueError(refusal)
    return channels


@functools.lru_cache(maxsize=64)
def _torch_refuses_eps(eps: float, training: bool) -> str | None:
    """What the installed torch's ``F.batch_norm`` says of this ``eps`` (None: it accepts it).

    Its rule and words changed between releases (torch 2.11 refuses eps <= 0 in eval too, "must be positive";
    2.13 allows 0 in eval and says "during training"), so tfuse asks it, once per value, on a tiny CPU tensor.
    """
    try:
        F.batch_norm(torch.zeros(2, 1), torch.zeros(1), torch.ones(1), training=training, eps=eps)
    except ValueError as refusal:
        return str(refusal)
    return None
