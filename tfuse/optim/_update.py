"""The update maths of the fused optimizers, over element ranges of flat buffers.

One function per optimizer family runs one update step: :func:`adam_update`
(Adam and AdamW) and :func:`sgd_update` (SGD with momentum, dampening,
Nesterov). Each works on flat buffers that pair element by element
(:class:`FlatBuffers`: parameters, gradients, named state buffers, optional
float32 masters) over the element ranges of a :class:`RunTable`, each range
with its own row of hyperparameters (:class:`AdamStep`, :class:`SGDStep`).
Nothing here knows about ``torch.optim.Optimizer``: the fused optimizers, a
shard owner updating its shard ``[start, end)`` of the buffers, and an outer
optimizer stepping whole snapshot buffers all call the same functions.

Two paths, as everywhere in tfuse:

* Triton: one launch of the family's kernel (``kernels/optim.py``) over the
  whole table, whatever the number of ranges and rows.
* PyTorch: torch's fused kernels (``torch._fused_adam_`` and friends) over
  the ranges, cut into pieces of TORCH_PIECE elements. torch's fused CPU
  kernels are not trusted blindly for float16/bfloat16: torch 2.13's
  ``_fused_sgd_`` leaves low-precision parameters unchanged (its vectorized
  loop never stores them). The first low-precision update of a kind runs a
  small probe of torch's kernel against the same kernel on float32 copies
  (:func:`native_low_precision_ok`); a kernel that disagrees is routed around
  by computing in float32 and rounding (the Triton kernel's maths).

Inside: ``_update_buffers`` (:class:`FlatBuffers`, :class:`RunTable`),
``_update_rows`` (:class:`AdamStep`, :class:`SGDStep`), ``_update_families``
(:class:`UpdateFamily`, :data:`ADAM`, :data:`SGD`), ``_torch_path`` (the
PyTorch path) and ``_torch_probe`` (the check of torch's kernels). This
module runs one step on either path; the rest of tfuse.optim imports the
names above from here (the ``name as name`` imports re-export them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tfuse._backend import Backend, select_backend
from tfuse._kit import acc_fp64, emulate_bf16_rtne
from tfuse.optim._torch_path import LOW_PRECISION as LOW_PRECISION
from tfuse.optim._torch_path import UPCAST_BATCH as UPCAST_BATCH
from tfuse.optim._torch_path import _torch_update
from tfuse.optim._torch_path import upcasts as upcasts
from tfuse.optim._torch_probe import native_low_precision_ok as native_low_precision_ok
from tfuse.optim._update_buffers import BLOCK, NUM_WARPS, FlatBuffers, RunTable
from tfuse.optim._update_buffers import MAX_ALIGN as MAX_ALIGN
from tfuse.optim._update_buffers import TORCH_PIECE as TORCH_PIECE
from tfuse.optim._update_families import ADAM, SGD, UpdateFamily
from tfuse.optim._update_rows import _ADAM_BC2_SQRT as _ADAM_BC2_SQRT
from tfuse.optim._update_rows import _ADAM_BETA1 as _ADAM_BETA1
from tfuse.optim._update_rows import _ADAM_BETA2 as _ADAM_BETA2
from tfuse.optim._update_rows import _ADAM_DECAY as _ADAM_DECAY
from tfuse.optim._update_rows import _ADAM_DECOUPLED_WD as _ADAM_DECOUPLED_WD
from tfuse.optim._update_rows import _ADAM_STEP_SIZE as _ADAM_STEP_SIZE
from tfuse.optim._update_rows import _SGD_LR as _SGD_LR
from tfuse.optim._update_rows import AdamStep, SGDStep

# ---------------------------------------------------------------------------- the update functions


def adam_update(
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[AdamStep],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    coefficients: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """One Adam/AdamW step over the ranges of ``table``: ``torch.optim.Adam``'s maths, in place.

    Args:
        buffers: parameters, gradients, ``exp_avg``/``exp_avg_sq`` (and
            ``max_exp_avg_sq`` for amsgrad rows) state buffers, optional masters.
        table: the element ranges to update and the row of each.
        rows: the hyperparameters of each row (``step`` is the step being taken).
        grad_scale: a GradScaler's scale (a 1-element float tensor on the
            buffers' device): gradients are divided by it, and left unscaled.
        found_inf: a GradScaler's flag (1-element, on the device): when
            non-zero nothing is updated. Read on the device, never by the host.
        coefficients: the Triton kernel's coefficient table, already on the
            device (capturable steps: see ``UpdateFamily.device_coefficients``);
            None builds it from ``rows`` on the host. The PyTorch path reads ``rows``.
        backend: the path to take; None picks it by tfuse's rules for the device.

    Example:
        >>> import torch
        >>> from tfuse.optim._update import AdamStep, FlatBuffers, RunTable, adam_update
        >>> param, grad = torch.zeros(8), torch.ones(8)
        >>> state = {"exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8)}
        >>> adam_update(FlatBuffers(param, grad, state), RunTable([(2, 6, 0)]), [AdamStep(lr=0.1)])
        >>> param  # the first Adam step moves each updated element by lr
        tensor([ 0.0000,  0.0000, -0.1000, -0.1000, -0.1000, -0.1000,  0.0000,  0.0000])
    """
    update(
        ADAM,
        buffers,
        table,
        rows,
        grad_scale=grad_scale,
        found_inf=found_inf,
        coefficients=coefficients,
        backend=backend,
    )


def sgd_update(
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[SGDStep],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    coefficients: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """One SGD step over the ranges of ``table``: ``torch.optim.SGD``'s maths, in place.

    Arguments as for :func:`adam_update`; ``buffers.state`` holds
    ``momentum_buffer`` when a row has a momentum.

    Example (Nesterov momentum over a pseudo-gradient, as an outer optimizer does):
        >>> import torch
        >>> from tfuse.optim._update import FlatBuffers, RunTable, SGDStep, sgd_update
        >>> weights, delta = torch.ones(4), torch.full((4,), 0.5)
        >>> buffers = FlatBuffers(weights, delta, {"momentum_buffer": torch.zeros(4)})
        >>> sgd_update(buffers, RunTable([(0, 4, 0)]), [SGDStep(lr=1.0, momentum=0.9, nesterov=True, first_step=True)])
        >>> weights  # 1 - (0.5 + 0.9 * 0.5)
        tensor([0.0500, 0.0500, 0.0500, 0.0500])
    """
    update(
        SGD,
        buffers,
        table,
        rows,
        grad_scale=grad_scale,
        found_inf=found_inf,
        coefficients=coefficients,
        backend=backend,
    )


def update(
    family: UpdateFamily,
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[Any],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    coefficients: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """One step of ``family``'s update (see :func:`adam_update`): the Triton kernel or the PyTorch path."""
    device = buffers.param.device
    if backend is None:
        backend = select_backend(device, f"{family.name}_update")
    if backend is Backend.TRITON:
        if coefficients is None:
            coefficients = _host_table(rows, device)
        meta = dict(
            ACC_FP64=acc_fp64(buffers.param.dtype),
            MASTER=buffers.master is not None,
            GRAD_SCALE=grad_scale is not None,
            FOUND_INF=found_inf is not None,
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            BLOCK=BLOCK,
            START_ALIGN=table.start_align,
            END_ALIGN=table.end_align,
            num_warps=NUM_WARPS,
        )
        if family.needs_host_rows:  # (Muon: its iteration counts and matrix shapes are the host's)
            family.launch_rows(buffers, table, coefficients, rows, grad_scale, found_inf, meta)
        else:
            family.launch(buffers, table, coefficients, grad_scale, found_inf, meta)
    else:
        _torch_update(family, buffers, table, rows, grad_scale, found_inf)


def _host_table(rows: Sequence[Any], device: torch.device) -> torch.Tensor:
    """The coefficient table built on the host and sent to ``device`` without a host sync.

    A copy from pageable memory makes CUDA wait for the stream first (a host
    sync per step); from pinned memory it is queued like a kernel.
    """
    table = torch.tensor([hyper.coefficients() for hyper in rows], dtype=torch.float64)
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)
