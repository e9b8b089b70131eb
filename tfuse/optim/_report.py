"""What serves a fused optimizer's step, in words: ``describe()``, ``repr()`` and the first step's INFO log."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tfuse._backend import Backend, requested_backend, select_backend, triton_available
from tfuse.optim._update import upcasts

if TYPE_CHECKING:
    from tfuse.optim._flat_optimizer import FlatOptimizer
    from tfuse.optim.span import SpanStepper


def route(optimizer: FlatOptimizer, span: SpanStepper, backend: Backend) -> str:
    """How ``backend`` updates ``span`` each step, in words."""
    family = span.rule.family
    if backend is Backend.TRITON:
        count = family.launches_per_buffer
        if count == 1:
            return f"the Triton kernel {family.kernel_name} (one launch per flat buffer)"
        return f"the Triton kernels {family.kernel_name} ({count} launches per flat buffer)"
    groups = optimizer.param_groups
    rows = (span.rule.update_row(groups[i], 1, True) for i in sorted({m.group for m in span.members}))
    kernels = sorted({row.torch_kernel for row in rows})
    routes = []
    for kernel in kernels:
        words = family.torch_words(kernel)
        if span.master_weights:
            routes.append(f"{words} on the float32 master weights")
        elif upcasts(family, kernel, span.dtype, span.device, master=False):
            why = (
                "as the Triton kernel computes"
                if not family.native_low_precision
                else f"as torch's {dtype_name(span.dtype)} kernel on {span.device.type} failed tfuse's check"
            )
            routes.append(f"{words} on float32 copies rounded to {dtype_name(span.dtype)}, {why}")
        else:
            routes.append(words)
    return f"the PyTorch path ({', '.join(routes)}; no Triton kernel runs)"


def announce(optimizer: FlatOptimizer, span: SpanStepper, backend: Backend, logger: logging.Logger) -> None:
    """Logs once per optimizer, at INFO, which backend serves the updates of a flat buffer."""
    key = (span.device, span.dtype, backend)
    if key in optimizer._announced:
        return
    optimizer._announced.add(key)
    logger.info(
        "%s: the %s %s flat buffer (%d parameters) is updated by %s [%s]",
        type(optimizer).__name__,
        span.device,
        dtype_name(span.dtype),
        len(span.members),
        route(optimizer, span, backend),
        _why(backend, span.device),
    )


def service(optimizer: FlatOptimizer) -> str:
    """What serves a step now: Triton launches per step, and the route of each flat buffer."""
    routes: dict[str, list[SpanStepper]] = {}
    launches = 0
    for span in optimizer.spans:
        try:
            backend = select_backend(span.device, type(optimizer).__name__)
        except RuntimeError as error:  # the Triton backend forced where it cannot run: step() raises this
            routes.setdefault(f"no backend ({error})", []).append(span)
            continue
        launches += span.rule.family.launches_per_buffer if backend is Backend.TRITON else 0
        routes.setdefault(route(optimizer, span, backend), []).append(span)
    parts = [
        text if len(routes) == 1 else f"{', '.join(f'{s.device} {dtype_name(s.dtype)}' for s in spans)} by {text}"
        for text, spans in routes.items()
    ]
    return f"{launches} Triton launch{'es' if launches != 1 else ''} per step; served by {'; '.join(parts)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _why(backend: Backend, device: torch.device) -> str:
    """Why ``backend`` serves tensors of ``device`` (the rules of tfuse._backend)."""
    forced = requested_backend()
    if forced is not None:
        return f"forced: backend {forced.value!r} requested (tfuse.use_backend or TFUSE_BACKEND)"
    if backend is Backend.TRITON:
        return "CUDA tensors" if device.type == "cuda" else f"{device.type} tensors through Triton's interpreter"
    if not triton_available():
        return "Triton is not installed"
    if device.type == "cpu":
        return "CPU tensors without TRITON_INTERPRET=1"
    return f"no Triton kernels for device type {device.type}"
