"""Muon's elementwise phases over flat buffers: before and after the Newton-Schulz orthogonalisation.

A Muon step (``tfuse/optim/_muon_family.py``) is three phases:

1. ``_muon_momentum_kernel`` (one launch per flat buffer): the momentum
   ``B = lerp(B, g, 1 - momentum)`` and the matrix to orthogonalise,
   ``U = lerp(g, B, momentum)`` (Nesterov) or ``B``, written rounded to the
   workspace's dtype at the workspace offset of the parameter's matrix;
2. the orthogonalisation, batched matmuls per group of same-shaped matrices
   (torch ops, in the workspace);
3. ``_muon_apply_kernel`` (one launch per flat buffer): ``p = p * (1 - lr *
   weight_decay) - lr * ratio * O``, with ``ratio`` the parameter's learning-
   rate adjustment for its matrix shape.

Blocks never cross a parameter's end, so a block's workspace offset is its
parameter's plus its distance from the parameter's start (``block_dest``).
With FOUND_INF set every block is empty and nothing is written.
"""

import triton
import triton.language as tl

from .cast import _cast_to
from .kit import _acc_dtype
from .optim import _block, _load_grad, _load_param, _store_param

# Columns of a Muon coefficient row.
MUON_LR = tl.constexpr(0)
MUON_MOMENTUM = tl.constexpr(1)
MUON_ONE_MINUS_MOMENTUM = tl.constexpr(2)
MUON_NESTEROV = tl.constexpr(3)
MUON_DECAY = tl.constexpr(4)  # 1 - lr * weight_decay
MUON_ROW = tl.constexpr(5)


@triton.jit
def _lerp(start, end, weight):
    """torch.lerp's formula: from the nearer end (start for weight < 0.5), so lerp(a, b, 1) is b exactly."""
    return tl.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


@triton.jit
def _muon_momentum_kernel(
    grad_ptr, momentum_buffer_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, grad_scale_ptr, found_inf_ptr, workspace_ptr, block_dest_ptr,
    ACC_FP64: tl.constexpr, GRAD_SCALE: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """Phase 1 over one block: the momentum, and the matrix to orthogonalise written to the workspace."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, MUON_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    momentum = tl.load(row + MUON_MOMENTUM).to(ACC)
    one_minus_momentum = tl.load(row + MUON_ONE_MINUS_MOMENTUM).to(ACC)
    grad = _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC, GRAD_SCALE, EMULATE_BF16_RTNE)
    buffer = tl.load(momentum_buffer_ptr + offsets, mask=mask, other=0.0).to(ACC)
    buffer = _lerp(buffer, grad, one_minus_momentum)
    tl.store(momentum_buffer_ptr + offsets, _cast_to(buffer, momentum_buffer_ptr.dtype.element_ty, EMULATE_BF16_RTNE),
             mask=mask)
    if tl.load(row + MUON_NESTEROV) != 0:
        update = _lerp(grad, buffer, momentum)
    else:
        update = buffer
    # Workspace slots are multiples of END_ALIGN (runs rounded up into the padding) and blocks start BLOCK apart;
    # offsets are start + arange, so the lane's workspace element is the block's plus its lane.
    dest = tl.multiple_of(tl.load(block_dest_ptr + tl.program_id(0)), END_ALIGN) + tl.arange(0, BLOCK)
    tl.store(workspace_ptr + dest, _cast_to(update, workspace_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _muon_apply_kernel(
    param_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, workspace_ptr, block_dest_ptr, block_ratio_ptr,
    ACC_FP64: tl.constexpr, MASTER: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """Phase 3 over one block: decoupled weight decay, then the orthogonalised update at the adjusted lr."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, MUON_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    block = tl.program_id(0)
    # lr * ratio in float64, as torch computes the adjusted lr in Python, then rounded once.
    scaled_lr = (tl.load(row + MUON_LR) * tl.load(block_ratio_ptr + block)).to(ACC)
    decay = tl.load(row + MUON_DECAY).to(ACC)
    dest = tl.multiple_of(tl.load(block_dest_ptr + block), END_ALIGN) + tl.arange(0, BLOCK)
    ortho = tl.load(workspace_ptr + dest, mask=mask, other=0.0).to(ACC)
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    param = param * decay - ortho * scaled_lr
    _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER, EMULATE_BF16_RTNE)
