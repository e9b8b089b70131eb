"""The PyTorch path of an update: torch's fused kernels over the runs, through float32 where they need it.

torch's fused kernels (``torch._fused_adam_`` and friends) run over the
ranges of a :class:`~tfuse.optim._update_buffers.RunTable`, cut into pieces
of TORCH_PIECE elements. With master weights, or for a low-precision dtype
whose torch kernel failed the probe (:func:`~tfuse.optim._torch_probe.native_low_precision_ok`),
the update is computed on float32 copies and rounded back (the Triton
kernel's maths).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tfuse.optim._torch_probe import native_low_precision_ok
from tfuse.optim._update_buffers import TORCH_PIECE, FlatBuffers, RunTable
from tfuse.optim._update_families import UpdateFamily

UPCAST_BATCH = 8 * TORCH_PIECE  # most elements upcast to float32 at once on the PyTorch path (bounds the copies)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def upcasts(family: UpdateFamily, kernel: str, dtype: torch.dtype, device: torch.device, master: bool) -> bool:
    """Whether the PyTorch path computes an update on float32 copies.

    With master weights it always does (on the masters). Low-precision
    parameters without masters go through float32 only when torch's fused
    kernel for their dtype failed the probe (torch 2.13's ``_fused_sgd_`` does).
    """
    if master:
        return True
    if dtype in LOW_PRECISION and not family.native_low_precision:
        return True
    return dtype in LOW_PRECISION and not native_low_precision_ok(family, kernel, dtype, device)


def _torch_update(
    family: UpdateFamily,
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[Any],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """torch's fused kernels over the runs (one call per row).

    Runs are cut into pieces of TORCH_PIECE elements: torch's fused CPU kernels
    parallelize over a list of tensors better than inside one huge tensor
    (measured: ResNet-50's 25.6M elements in one tensor 14.5 ms, in 1M pieces
    10.7 ms, 2 cores). When the update goes through float32 (master weights, or
    a low-precision dtype torch's kernel gets wrong), at most UPCAST_BATCH elements
    are upcast at a time; the parameters, the low-precision state and, under AMP,
    the unscaled gradients are written back rounded to nearest even.
    """
    if family.per_parameter:
        family.torch_update(buffers, table, rows, grad_scale, found_inf)
        return
    param, grad, state, master = buffers.param, buffers.grad, buffers.state, buffers.master
    scale = None if grad_scale is None else grad_scale.to(torch.float32)
    skip = None if found_inf is None else found_inf.to(torch.float32)
    for row, spans in table.spans_by_row().items():
        hyper = rows[row]
        names = hyper.state_names
        if not upcasts(family, hyper.torch_kernel, param.dtype, param.device, master is not None):
            family.torch_call(
                hyper,
                [param[s:e] for s, e in spans],
                [grad[s:e] for s, e in spans],
                {name: [state[name][s:e] for s, e in spans] for name in names},
                scale,
                skip,
            )
            continue
        for batch in _batches(spans, UPCAST_BATCH):
            if master is not None:
                params = [master[s:e] for s, e in batch]
            else:
                params = [param[s:e].float() for s, e in batch]
            grads = [grad[s:e].float() for s, e in batch]
            states = {name: [state[name][s:e].float() for s, e in batch] for name in names}
            family.torch_call(hyper, params, grads, states, scale, skip)
            for index, (s, e) in enumerate(batch):
                param[s:e].copy_(params[index])
                if grad_scale is not None:
                    grad[s:e].copy_(grads[index])
                for name in names:
                    buffer = state[name]
                    if buffer.dtype != torch.float32:  # float32 state (masters): updated in place already
                        buffer[s:e].copy_(states[name][index])


def _batches(spans: list[tuple[int, int]], limit: int) -> Iterable[list[tuple[int, int]]]:
    """Consecutive spans in lists of at most ``limit`` elements (at least one span each)."""
    batch: list[tuple[int, int]] = []
    size = 0
    for span in spans:
        length = span[1] - span[0]
        if batch and size + length > limit:
            yield batch
            batch, size = [], 0
        batch.append(span)
        size += length
    if batch:
        yield batch
