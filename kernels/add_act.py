"""Fused add + activation: forward, backward, and the final partial-sum reduction.

Forward: ``y = act(x + others...)`` in one pass (inputs read once, y written once).

Backward, in at most two launches:

1. ``_add_act_bwd_kernel`` computes ``dz = dy * act'(.)`` once per element, from
   the saved output (activations whose derivative follows from it) or from the
   saved inputs (z recomputed: nothing extra was stored in forward). It writes
   dz straight into the gradients of full-size inputs, and reduces dz in
   float32 (float64 for float64) into partial sums for broadcast inputs (a bias), each partial in a
   slot of its own, so the result is deterministic.
2. ``_sum_partials_kernel`` adds the partials of every broadcast input up
   (one launch for all of them) and writes each gradient in its dtype.

Grid of the backward kernel: (column blocks, row groups); each program walks
its group of rows in BLOCK_ROWS steps. Gradient slots (at most 4: x and three
others), by mode:

* LINEAR  - the gradient has the output's layout: dz is stored in it.
* COL     - reduced over rows: partial[group, element], accumulated over the
            program's rows in registers.
* SCALAR  - reduced over everything: partial[group * column_blocks + block].
* ROW     - reduced over columns: partial[block * n_bcast + r_bcast, element]
            per row, where r_bcast indexes the broadcast outer coordinates.
* STRIDED - partial[r_bcast, element] = dz (no reduction in the tile).

``element`` is the gradient's own memory offset (the launcher lays broadcast
gradients out densely in the output's dimension order), so the second stage
is a plain column sum of a [n_partials, numel] array.
"""

import triton
import triton.language as tl

from .activations import _act, _act_grad, _act_grad_from_output
from .cast import _cast_to
from .tiles import COL, LINEAR, ROW, SCALAR, _load_operand, _row_offsets, _sum_operands, _sum_tile_of_program, _tile


@triton.jit
def _add_act_fwd_kernel(
    out_ptr,
    in_ptrs,
    in_strides,
    outer_sizes,
    n_rows,
    n_cols,
    negative_slope,
    N_INPUTS: tl.constexpr,
    MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr,
    ACT: tl.constexpr,
    INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """One tile of ``out = act(sum(inputs))``; arguments as in add._add_fwd_kernel, plus ACT."""
    z, offsets, mask = _sum_tile_of_program(
        in_ptrs, in_strides, outer_sizes, n_rows, n_cols, N_INPUTS, MODES, OUTER_RANK, INDEX_64, ACC_FP64,
        ONE_ROW, BLOCK_ROWS, BLOCK_COLS,
    )
    y = _act(z, ACT, negative_slope)
    tl.store(out_ptr + offsets, _cast_to(y, out_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _grad_step(
    acc, dz, ptr, strides, red_strides, numel, n_bcast, MODE: tl.constexpr, rows, cols, col_block,
    offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
):
    """Contributes one tile of ``dz`` to a gradient slot; returns its running row sum."""
    if MODE == LINEAR:
        tl.store(ptr + offsets, _cast_to(dz, ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    elif MODE == COL or MODE == SCALAR:
        acc += tl.sum(tl.where(mask, dz, 0.0), axis=0)
    else:
        elements = _row_offsets(rows, outer_sizes, strides, OUTER_RANK)
        bcast = _row_offsets(rows, outer_sizes, red_strides, OUTER_RANK)
        if MODE == ROW:
            partial_rows = col_block * n_bcast + bcast
            row_sums = tl.sum(tl.where(mask, dz, 0.0), axis=1)
            tl.store(ptr + partial_rows * numel + elements, row_sums.to(ptr.dtype.element_ty), mask=row_mask)
        else:
            targets = (bcast * numel + elements)[:, None] + cols[None, :] * strides[OUTER_RANK]
            tl.store(ptr + targets, dz.to(ptr.dtype.element_ty), mask=mask)
    return acc


@triton.jit
def _grad_finish(
    acc, ptr, strides, numel, MODE: tl.constexpr, group, col_block, n_col_blocks, cols, col_mask,
    OUTER_RANK: tl.constexpr,
):
    """Stores the row sums of a COL or SCALAR slot as this program's partial."""
    if MODE == COL:
        tl.store(ptr + group * numel + cols * strides[OUTER_RANK], acc.to(ptr.dtype.element_ty), mask=col_mask)
    elif MODE == SCALAR:
        tl.store(ptr + group * n_col_blocks + col_block, tl.sum(acc, axis=0).to(ptr.dtype.element_ty))


@triton.jit
def _add_act_bwd_kernel(
    dy_ptr,
    dy_strides,
    src_ptrs,
    src_strides,
    grad_ptrs,
    grad_strides,
    red_strides,
    numels,
    n_bcasts,
    outer_sizes,
    n_rows,
    n_cols,
    rows_per_group,
    negative_slope,
    DY_MODE: tl.constexpr,
    N_SRC: tl.constexpr,
    SRC_MODES: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    N_GRADS: tl.constexpr,
    GRAD_MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr,
    ACT: tl.constexpr,
    INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """dz = dy * act'(.) for one column block and one group of rows.

    src_ptrs:  the saved output (FROM_OUTPUT, N_SRC == 1), or the inputs whose
               sum is z (recomputed), or nothing (identity, N_SRC == 0).
    grad_ptrs: per slot, the gradient (LINEAR) or its float32 partials.
    red_strides, numels, n_bcasts: per slot, see the module docstring.
    """
    col_block = tl.program_id(0)
    group = tl.program_id(1)
    if INDEX_64:
        col_block = col_block.to(tl.int64)
        group = group.to(tl.int64)
    n_col_blocks = tl.num_programs(0)
    if ACC_FP64:
        acc_dtype: tl.constexpr = tl.float64
    else:
        acc_dtype: tl.constexpr = tl.float32
    cols = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    acc0 = tl.zeros([BLOCK_COLS], acc_dtype)
    acc1 = tl.zeros([BLOCK_COLS], acc_dtype)
    acc2 = tl.zeros([BLOCK_COLS], acc_dtype)
    acc3 = tl.zeros([BLOCK_COLS], acc_dtype)

    row_begin = group * rows_per_group
    row_end = tl.minimum(row_begin + rows_per_group, n_rows)
    for row_start in range(row_begin, row_end, BLOCK_ROWS):
        rows, offsets, row_mask, col_mask, mask = _tile(row_start, cols, n_rows, n_cols, ONE_ROW, BLOCK_ROWS)
        dy = _load_operand(
            dy_ptr, dy_strides, DY_MODE, rows, cols, offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK, acc_dtype
        )
        if N_SRC == 0:
            dz = dy
        elif FROM_OUTPUT:
            y = _load_operand(
                src_ptrs[0], src_strides[0], SRC_MODES[0], rows, cols, offsets, row_mask, col_mask, mask,
                outer_sizes, OUTER_RANK, acc_dtype,
            )
            dz = dy * _act_grad_from_output(y, ACT, negative_slope)
        else:
            z = _sum_operands(
                src_ptrs, src_strides, SRC_MODES, N_SRC, rows, cols, offsets, row_mask, col_mask, mask,
                outer_sizes, OUTER_RANK, acc_dtype,
            )
            dz = dy * _act_grad(z, ACT, negative_slope)

        # One block per slot, unrolled: a Triton loop cannot carry a list of
        # accumulators, and four named ones cover x plus three others.
        if N_GRADS > 0:
            acc0 = _grad_step(
                acc0, dz, grad_ptrs[0], grad_strides[0], red_strides[0], numels[0], n_bcasts[0], GRAD_MODES[0],
                rows, cols, col_block, offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK, EMULATE_BF16_RTNE,
            )
        if N_GRADS > 1:
            acc1 = _grad_step(
                acc1, dz, grad_ptrs[1], grad_strides[1], red_strides[1], numels[1], n_bcasts[1], GRAD_MODES[1],
                rows, cols, col_block, offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK, EMULATE_BF16_RTNE,
            )
        if N_GRADS > 2:
            acc2 = _grad_step(
                acc2, dz, grad_ptrs[2], grad_strides[2], red_strides[2], numels[2], n_bcasts[2], GRAD_MODES[2],
                rows, cols, col_block, offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK, EMULATE_BF16_RTNE,
            )
        if N_GRADS > 3:
            acc3 = _grad_step(
                acc3, dz, grad_ptrs[3], grad_strides[3], red_strides[3], numels[3], n_bcasts[3], GRAD_MODES[3],
                rows, cols, col_block, offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK, EMULATE_BF16_RTNE,
            )

    col_mask = cols < n_cols
    if N_GRADS > 0:
        _grad_finish(acc0, grad_ptrs[0], grad_strides[0], numels[0], GRAD_MODES[0], group, col_block, n_col_blocks, cols, col_mask, OUTER_RANK)
    if N_GRADS > 1:
        _grad_finish(acc1, grad_ptrs[1], grad_strides[1], numels[1], GRAD_MODES[1], group, col_block, n_col_blocks, cols, col_mask, OUTER_RANK)
    if N_GRADS > 2:
        _grad_finish(acc2, grad_ptrs[2], grad_strides[2], numels[2], GRAD_MODES[2], group, col_block, n_col_blocks, cols, col_mask, OUTER_RANK)
    if N_GRADS > 3:
        _grad_finish(acc3, grad_ptrs[3], grad_strides[3], numels[3], GRAD_MODES[3], group, col_block, n_col_blocks, cols, col_mask, OUTER_RANK)


@triton.jit
def _sum_partials_kernel(
    partial_ptrs,
    grad_ptrs,
    n_partials,
    numels,
    N: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    BLOCK_PARTIALS: tl.constexpr,
    BLOCK_ELEMENTS: tl.constexpr,
):
    """grad[e] = sum_i partial[i, e] for each of the N broadcast inputs (in the partials' dtype)."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    elements = pid * BLOCK_ELEMENTS + tl.arange(0, BLOCK_ELEMENTS)
    for k in tl.static_range(N):
        numel = numels[k]
        element_mask = elements < numel
        acc = tl.zeros([BLOCK_PARTIALS, BLOCK_ELEMENTS], partial_ptrs[k].dtype.element_ty)
        for start in range(0, n_partials[k], BLOCK_PARTIALS):
            parts = start + tl.arange(0, BLOCK_PARTIALS)
            mask = (parts < n_partials[k])[:, None] & element_mask[None, :]
            acc += tl.load(partial_ptrs[k] + parts[:, None] * numel + elements[None, :], mask=mask, other=0.0)
        total = tl.sum(acc, axis=0)
        tl.store(grad_ptrs[k] + elements, _cast_to(total, grad_ptrs[k].dtype.element_ty, EMULATE_BF16_RTNE), mask=element_mask)
