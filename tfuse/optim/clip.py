"""``clip_grad_norm_`` over flat gradient buffers: one two-stage reduction, one scaling pass."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from tfuse import kernels
from tfuse._backend import Backend, select_backend
from tfuse._launch import launch
from tfuse.flat import FlatParams, owner_of

_BLOCK = 4096
_NORM_KINDS = {2.0: kernels.norm.NORM_2.value, 1.0: kernels.norm.NORM_1.value, math.inf: kernels.norm.NORM_INF.value}


def clip_grad_norm_(
    parameters: torch.optim.Optimizer | FlatParams | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clips gradients by their total norm, like ``torch.nn.utils.clip_grad_norm_``.

    Same arguments, semantics and return value as torch's: the norm of all
    gradients that are not None taken together, each gradient multiplied in
    place by ``min(max_norm / (norm + 1e-6), 1)`` (on the device, no sync),
    the total norm returned in the gradients' (promoted) dtype.
    Gradients that live in a :class:`~tfuse.flat.FlatParams` buffer are
    reduced by one kernel per buffer plus one final kernel, reading only the
    slots that hold gradients (never padding or stale slots of parameters
    whose grad is None); any other gradient is handled with torch ops.

    Args:
        parameters: an optimizer (its parameters), a FlatParams, a tensor,
            or an iterable of tensors.
        max_norm: the largest total norm allowed.
        norm_type: p > 0 of the p-norm, or ``inf`` / ``"inf"``.
        error_if_nonfinite: raise if the total norm is NaN or infinite.

    Example:
        >>> import torch
        >>> from tfuse.flat import FlatParams
        >>> from tfuse.optim import clip_grad_norm_
        >>> model = torch.nn.Linear(4, 3)
        >>> flat = FlatParams(model.parameters())
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> norm = clip_grad_norm_(flat, max_norm=1.0)
        >>> bool(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in flat])) <= 1.0 + 1e-5)
        True
    """
    if isinstance(parameters, torch.optim.Optimizer):
        params = [param for group in parameters.param_groups for param in group["params"]]
    elif isinstance(parameters, FlatParams):
        params = parameters.params
    else:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    p = _check_norm_type(norm_type)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"clip_grad_norm_: max_norm must be a number, got {type(max_norm).__name__}")
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    devices = {g.device for g in grads}
    if len(devices) > 1:
        raise RuntimeError(f"clip_grad_norm_: gradients on several devices ({sorted(map(str, devices))}) are not supported")
    device = grads[0].device
    acc_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32

    segments, loose = _split_by_buffer(params)
    use_kernels = bool(segments) and select_backend(device, "clip_grad_norm_") is Backend.TRITON
    if not use_kernels:
        loose = grads
        segments = {}
    parts: list[torch.Tensor] = []
    if segments:
        parts.append(_flat_norm(segments, p, acc_dtype, device))
    if loose:
        parts.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.to(acc_dtype), p) for g in loose]), p))
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), p)

    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    for buffer, (starts, ends) in segments.items():
        launch(kernels._clip_segments_kernel, (starts.numel(),), (buffer, starts, ends, total, float(max_norm)), dict(BLOCK=_BLOCK), device)
    if loose:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in loose:
            g.mul_(coef.to(g.dtype))
    # torch returns the norm in the gradients' dtype, promoted across dtypes.
    result_dtype = functools.reduce(torch.promote_types, {g.dtype for g in grads})
    return total.to(result_dtype)


def _check_norm_type(norm_type: float | str) -> float:
    if isinstance(norm_type, str):
        if norm_type.lower() != "inf":
            raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or 'inf', got {norm_type!r}")
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or 'inf', got {norm_type!r}")
    return float(norm_type)


def _split_by_buffer(params: list[torch.Tensor]) -> tuple[dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Block tables (starts, ends) per flat gradient buffer, and the gradients that are not in one."""
    ranges: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
    loose = []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        owner = owner_of(param)
        buffer = _containing_buffer(owner, grad) if owner is not None else None
        if buffer is None:
            loose.append(grad)
            continue
        start = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        ranges.setdefault(id(buffer), (buffer, []))[1].append((start, start + grad.numel()))
    tables = {}
    for buffer, spans in ranges.values():
        starts, ends = [], []
        for start, end in sorted(spans):
            for block_start in range(start, end, _BLOCK):
                starts.append(block_start)
                ends.append(min(block_start + _BLOCK, end))
        table = torch.tensor([starts, ends], dtype=torch.int64).to(buffer.device)
        tables[buffer] = (table[0], table[1])
    return tables, loose


def _containing_buffer(owner: FlatParams, grad: torch.Tensor) -> torch.Tensor | None:
    for buffer in owner.grad_buffers:
        start = buffer.data_ptr()
        if start <= grad.data_ptr() < start + buffer.numel() * buffer.element_size() and grad.is_contiguous():
            return buffer
    return None


def _flat_norm(segments, p: float, acc_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    kind = _NORM_KINDS.get(p, kernels.norm.NORM_P.value)
    n_partials = sum(starts.numel() for starts, _ in segments.values())
    partials = torch.empty(n_partials, dtype=acc_dtype, device=device)
    offset = 0
    for buffer, (starts, ends) in segments.items():
        launch(
            kernels._norm_partial_kernel, (starts.numel(),), (buffer, starts, ends, partials, offset, p if math.isfinite(p) else 1.0),
            dict(NORM=kind, BLOCK=_BLOCK), device,
        )
        offset += starts.numel()
    total = torch.empty((), dtype=acc_dtype, device=device)
    launch(kernels._norm_final_kernel, (1,), (partials, n_partials, total, p if math.isfinite(p) else 1.0), dict(NORM=kind, BLOCK=1024), device)
    return total
