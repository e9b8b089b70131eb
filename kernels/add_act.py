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
its group of rows in BLOCK_ROWS steps over a block of ``block_width`` columns
(BLOCK_COLS lanes, of which the first ``block_width`` are used). Gradient
slots (at most 4: x and three others), by mode:

* LINEAR  - the gradient has the output's layout: dz is stored in it.
* COL     - reduced over rows: partial[group, element], accumulated over the
            program's rows in registers.
* CHAN    - reduced over rows and over the innermost of two column
            dimensions (a per-channel bias of an NCHW tensor whose columns
            are channels x pixels): accumulated over rows like COL, then
            summed over each channel's pixels at the end of the program
            (a gather through shared memory): partial[group, channel].
            Column blocks hold whole channels (block_width is a multiple of
            the pixel count).
* SCALAR  - reduced over everything: partial[group * column_blocks + block].
* ROW     - reduced over columns: partial[block * n_bcast + r_bcast, element]
            per row, where r_bcast indexes the broadcast outer coordinates.
* STRIDED - partial[r_bcast, element] = dz (no reduction in the tile).

``element`` is the gradient's own memory offset (the launcher lays broadcast
gradients out densely in the output's dimension order), so the second stage
is a plain column sum of a [n_partials, numel] array.

Tiles inside the output run unmasked (see tiles.py); MATH selects the
activation formulas (activations.py).
"""

import triton
import triton.language as tl

from . import codes
from .activations import _act_backward_from_output, _activation, _activation_backward
from .cast import _cast_to
from .kit import _acc_dtype, _float_arg
from .tiles import (
    COL,
    LINEAR,
    ROW,
    SCALAR,
    _col_offsets,
    _load_operand,
    _program_id,
    _row_offsets,
    _store,
    _sum_col_operands,
    _sum_operands,
    _sum_tile_of_program,
    _tile_is_full,
)

CHAN = tl.constexpr(codes.CHAN)  # gradient mode only: see the module docstring


@triton.jit
def _add_act_tile(
    pid, out_ptr, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, negative_slope,
    N_INPUTS: tl.constexpr, MODES: tl.constexpr, OUTER_RANK: tl.constexpr, COL_RANK: tl.constexpr,
    ACT: tl.constexpr, MATH: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    MASKED: tl.constexpr,
):
    z, offsets, mask = _sum_tile_of_program(
        pid, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, N_INPUTS, MODES, OUTER_RANK, COL_RANK,
        INDEX_64, ACC_FP64, ONE_ROW, BLOCK_ROWS, BLOCK_COLS, MASKED,
    )
    y = _activation(z, ACT, negative_slope, MATH)
    _store(out_ptr + offsets, _cast_to(y, out_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask, MASKED)


@triton.jit
def _add_act_fwd_kernel(
    out_ptr,
    in_ptrs,
    in_strides,
    outer_sizes,
    col_divs,
    n_rows,
    n_cols,
    negative_slope,
    negative_slope_lo,
    N_INPUTS: tl.constexpr,
    MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr,
    COL_RANK: tl.constexpr,
    ACT: tl.constexpr,
    MATH: tl.constexpr,
    INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """One tile of ``out = act(sum(inputs))``; arguments as in add._add_fwd_kernel, plus ACT and MATH.

    negative_slope, negative_slope_lo: leaky_relu's slope, split by the launcher (kit._float_arg).
    """
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    pid = _program_id(INDEX_64)
    if _tile_is_full(pid, n_rows, n_cols, ONE_ROW, BLOCK_ROWS, BLOCK_COLS):
        _add_act_tile(
            pid, out_ptr, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, negative_slope, N_INPUTS,
            MODES, OUTER_RANK, COL_RANK, ACT, MATH, INDEX_64, ACC_FP64, EMULATE_BF16_RTNE, ONE_ROW, BLOCK_ROWS,
            BLOCK_COLS, False,
        )
    else:
        _add_act_tile(
            pid, out_ptr, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, negative_slope, N_INPUTS,
            MODES, OUTER_RANK, COL_RANK, ACT, MATH, INDEX_64, ACC_FP64, EMULATE_BF16_RTNE, ONE_ROW, BLOCK_ROWS,
            BLOCK_COLS, True,
        )


@triton.jit
def _grad_step(
    acc, dz, ptr, strides, red_strides, numel, n_bcast, MODE: tl.constexpr, rows, cols, col_block,
    offsets, row_mask, mask, outer_sizes, col_divs, OUTER_RANK: tl.constexpr, COL_RANK: tl.constexpr,
    INDEX_64: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, MASKED: tl.constexpr,
):
    """Contributes one tile of ``dz`` to a gradient slot; returns its running row sum."""
    if MODE == LINEAR:
        _store(ptr + offsets, _cast_to(dz, ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask, MASKED)
    elif MODE == COL or MODE == SCALAR or MODE == CHAN:  # noqa: SIM109 (a tuple of constexprs does not compile)
        if MASKED:
            acc += tl.sum(tl.where(mask, dz, 0.0), axis=0)
        else:
            acc += tl.sum(dz, axis=0)
    else:
        elements = _row_offsets(rows, outer_sizes, strides, OUTER_RANK)
        bcast = _row_offsets(rows, outer_sizes, red_strides, OUTER_RANK)
        if MODE == ROW:
            partial_rows = col_block * n_bcast + bcast
            if MASKED:
                row_sums = tl.sum(tl.where(mask, dz, 0.0), axis=1)
            else:
                row_sums = tl.sum(dz, axis=1)
            tl.store(ptr + partial_rows * numel + elements, row_sums.to(ptr.dtype.element_ty), mask=row_mask)
        else:
            col_offsets = _col_offsets(cols, col_divs, strides, OUTER_RANK, COL_RANK, INDEX_64)
            targets = (bcast * numel + elements)[:, None] + col_offsets[None, :]
            _store(ptr + targets, dz.to(ptr.dtype.element_ty), mask, MASKED)
    return acc


@triton.jit
def _grad_finish(
    acc, ptr, strides, numel, MODE: tl.constexpr, group, col_block, n_col_blocks, cols, col_mask, col_divs,
    col_start, block_width, n_cols, OUTER_RANK: tl.constexpr, COL_RANK: tl.constexpr, INDEX_64: tl.constexpr,
    PIXELS_POW2: tl.constexpr,
):
    """Stores the row sums of a COL, CHAN or SCALAR slot as this program's partial."""
    if MODE == COL:
        col_offsets = _col_offsets(cols, col_divs, strides, OUTER_RANK, COL_RANK, INDEX_64)
        tl.store(ptr + group * numel + col_offsets, acc.to(ptr.dtype.element_ty), mask=col_mask)
    elif MODE == CHAN:
        # Columns are (channel, pixel), pixel innermost, and the block holds whole
        # channels: gather each channel's pixels into a row of a [channels, PIXELS_POW2]
        # tile (through shared memory) and sum the rows, CHUNK channels at a time.
        CHUNK: tl.constexpr = max(1, 1024 // PIXELS_POW2)
        pixels = col_divs[0][0]
        first_channel = col_start // pixels
        n_channels = tl.minimum(block_width, n_cols - col_start) // pixels
        pixel = tl.arange(0, PIXELS_POW2)
        for start in range(0, n_channels, CHUNK):
            channel = start + tl.arange(0, CHUNK)
            valid = (channel[:, None] < n_channels) & (pixel[None, :] < pixels)
            lane = tl.where(valid, channel[:, None] * pixels + pixel[None, :], 0)
            values = tl.gather(acc, tl.reshape(lane, [CHUNK * PIXELS_POW2]), 0)
            sums = tl.sum(tl.where(valid, tl.reshape(values, [CHUNK, PIXELS_POW2]), 0.0), axis=1)
            target = ptr + group * numel + (first_channel + channel) * strides[OUTER_RANK]
            tl.store(target, sums.to(ptr.dtype.element_ty), mask=channel < n_channels)
    elif MODE == SCALAR:
        tl.store(ptr + group * n_col_blocks + col_block, tl.sum(acc, axis=0).to(ptr.dtype.element_ty))


@triton.jit
def _bwd_step(
    acc0, acc1, acc2, acc3, z_col, row_start, cols, col_mask, col_block, dy_ptr, dy_strides, src_ptrs, src_strides,
    grad_ptrs, grad_strides, red_strides, numels, n_bcasts, outer_sizes, col_divs, n_rows, n_cols, negative_slope,
    DY_MODE: tl.constexpr, N_SRC: tl.constexpr, SRC_MODES: tl.constexpr, FROM_OUTPUT: tl.constexpr,
    N_GRADS: tl.constexpr, GRAD_MODES: tl.constexpr, OUTER_RANK: tl.constexpr, COL_RANK: tl.constexpr,
    ACT: tl.constexpr, MATH: tl.constexpr, INDEX_64: tl.constexpr, acc_dtype: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, MASKED: tl.constexpr,
):
    """dz over one BLOCK_ROWS x BLOCK_COLS tile, stored or added into every gradient slot."""
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    if ONE_ROW:
        offsets = cols[None, :] + tl.zeros_like(rows)[:, None]
    else:
        offsets = rows[:, None] * n_cols + cols[None, :]
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    dy = _load_operand(
        dy_ptr, dy_strides, DY_MODE, rows, cols, offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK,
        acc_dtype, col_divs, COL_RANK, INDEX_64, MASKED,
    )
    if N_SRC == 0:
        dz = dy
    elif FROM_OUTPUT:
        y = _load_operand(
            src_ptrs[0], src_strides[0], SRC_MODES[0], rows, cols, offsets, row_mask, col_mask, mask,
            outer_sizes, OUTER_RANK, acc_dtype, col_divs, COL_RANK, INDEX_64, MASKED,
        )
        dz = _act_backward_from_output(dy, y, ACT, negative_slope)
    else:
        z = z_col + _sum_operands(
            src_ptrs, src_strides, SRC_MODES, N_SRC, rows, cols, offsets, row_mask, col_mask, mask,
            outer_sizes, OUTER_RANK, acc_dtype, col_divs, COL_RANK, INDEX_64, MASKED, COL_RANK > 1,
        )
        dz = _activation_backward(dy, z, ACT, negative_slope, MATH)

    # One block per slot, unrolled: a Triton loop cannot carry a list of
    # accumulators, and four named ones cover x plus three others.
    if N_GRADS > 0:
        acc0 = _grad_step(
            acc0, dz, grad_ptrs[0], grad_strides[0], red_strides[0], numels[0], n_bcasts[0], GRAD_MODES[0],
            rows, cols, col_block, offsets, row_mask, mask, outer_sizes, col_divs, OUTER_RANK, COL_RANK, INDEX_64,
            EMULATE_BF16_RTNE, MASKED,
        )
    if N_GRADS > 1:
        acc1 = _grad_step(
            acc1, dz, grad_ptrs[1], grad_strides[1], red_strides[1], numels[1], n_bcasts[1], GRAD_MODES[1],
            rows, cols, col_block, offsets, row_mask, mask, outer_sizes, col_divs, OUTER_RANK, COL_RANK, INDEX_64,
            EMULATE_BF16_RTNE, MASKED,
        )
    if N_GRADS > 2:
        acc2 = _grad_step(
            acc2, dz, grad_ptrs[2], grad_strides[2], red_strides[2], numels[2], n_bcasts[2], GRAD_MODES[2],
            rows, cols, col_block, offsets, row_mask, mask, outer_sizes, col_divs, OUTER_RANK, COL_RANK, INDEX_64,
            EMULATE_BF16_RTNE, MASKED,
        )
    if N_GRADS > 3:
        acc3 = _grad_step(
            acc3, dz, grad_ptrs[3], grad_strides[3], red_strides[3], numels[3], n_bcasts[3], GRAD_MODES[3],
            rows, cols, col_block, offsets, row_mask, mask, outer_sizes, col_divs, OUTER_RANK, COL_RANK, INDEX_64,
            EMULATE_BF16_RTNE, MASKED,
        )
    return acc0, acc1, acc2, acc3


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
    col_divs,
    n_rows,
    n_cols,
    rows_per_group,
    block_width,
    negative_slope,
    negative_slope_lo,
    DY_MODE: tl.constexpr,
    N_SRC: tl.constexpr,
    SRC_MODES: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    N_GRADS: tl.constexpr,
    GRAD_MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr,
    COL_RANK: tl.constexpr,
    ACT: tl.constexpr,
    MATH: tl.constexpr,
    INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    PIXELS_POW2: tl.constexpr,
):
    """dz = dy * act'(.) for one column block and one group of rows.

    src_ptrs:  the saved output (FROM_OUTPUT, N_SRC == 1), or the inputs whose
               sum is z (recomputed), or nothing (identity, N_SRC == 0).
    grad_ptrs: per slot, the gradient (LINEAR) or its float32 partials.
    red_strides, numels, n_bcasts: per slot, see the module docstring.
    block_width: columns per block (BLOCK_COLS, or whole channels for CHAN).
    PIXELS_POW2: for CHAN, the pixel count rounded up to a power of two.
    negative_slope, negative_slope_lo: leaky_relu's slope, split by the launcher (kit._float_arg).
    """
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    col_block = tl.program_id(0)
    group = tl.program_id(1)
    if INDEX_64:
        col_block = col_block.to(tl.int64)
        group = group.to(tl.int64)
    n_col_blocks = tl.num_programs(0)
    acc_dtype: tl.constexpr = _acc_dtype(ACC_FP64)
    lanes = tl.arange(0, BLOCK_COLS)
    col_start = col_block * block_width
    cols = col_start + lanes
    col_mask = (lanes < block_width) & (cols < n_cols)
    cols_full = (block_width == BLOCK_COLS) & (col_start + BLOCK_COLS <= n_cols)
    acc0 = tl.zeros([BLOCK_COLS], acc_dtype)
    acc1 = tl.zeros([BLOCK_COLS], acc_dtype)
    acc2 = tl.zeros([BLOCK_COLS], acc_dtype)
    acc3 = tl.zeros([BLOCK_COLS], acc_dtype)

    # Gathered sources constant over rows (a per-channel bias) are loaded once, not once per row.
    if N_SRC > 0 and not FROM_OUTPUT and COL_RANK > 1:
        z_col = _sum_col_operands(
            src_ptrs, src_strides, SRC_MODES, N_SRC, cols, col_mask, col_divs, OUTER_RANK, COL_RANK, INDEX_64, acc_dtype
        )
    else:
        z_col = tl.zeros([BLOCK_COLS], acc_dtype)
    # Broadcast over the tile's rows here, once: in the loop, the gathered values'
    # layout would be converted to the tile's (through shared memory) every step.
    z_col = tl.zeros([BLOCK_ROWS, BLOCK_COLS], acc_dtype) + z_col[None, :]

    row_begin = group * rows_per_group
    row_end = tl.minimum(row_begin + rows_per_group, n_rows)
    for row_start in range(row_begin, row_end, BLOCK_ROWS):
        if cols_full & (row_start + BLOCK_ROWS <= n_rows):
            acc0, acc1, acc2, acc3 = _bwd_step(
                acc0, acc1, acc2, acc3, z_col, row_start, cols, col_mask, col_block, dy_ptr, dy_strides, src_ptrs,
                src_strides, grad_ptrs, grad_strides, red_strides, numels, n_bcasts, outer_sizes, col_divs, n_rows,
                n_cols, negative_slope, DY_MODE, N_SRC, SRC_MODES, FROM_OUTPUT, N_GRADS, GRAD_MODES, OUTER_RANK,
                COL_RANK, ACT, MATH, INDEX_64, acc_dtype, EMULATE_BF16_RTNE, ONE_ROW, BLOCK_ROWS, False,
            )
        else:
            acc0, acc1, acc2, acc3 = _bwd_step(
                acc0, acc1, acc2, acc3, z_col, row_start, cols, col_mask, col_block, dy_ptr, dy_strides, src_ptrs,
                src_strides, grad_ptrs, grad_strides, red_strides, numels, n_bcasts, outer_sizes, col_divs, n_rows,
                n_cols, negative_slope, DY_MODE, N_SRC, SRC_MODES, FROM_OUTPUT, N_GRADS, GRAD_MODES, OUTER_RANK,
                COL_RANK, ACT, MATH, INDEX_64, acc_dtype, EMULATE_BF16_RTNE, ONE_ROW, BLOCK_ROWS, True,
            )

    if N_GRADS > 0:
        _grad_finish(acc0, grad_ptrs[0], grad_strides[0], numels[0], GRAD_MODES[0], group, col_block, n_col_blocks,
                     cols, col_mask, col_divs, col_start, block_width, n_cols, OUTER_RANK, COL_RANK, INDEX_64,
                     PIXELS_POW2)
    if N_GRADS > 1:
        _grad_finish(acc1, grad_ptrs[1], grad_strides[1], numels[1], GRAD_MODES[1], group, col_block, n_col_blocks,
                     cols, col_mask, col_divs, col_start, block_width, n_cols, OUTER_RANK, COL_RANK, INDEX_64,
                     PIXELS_POW2)
    if N_GRADS > 2:
        _grad_finish(acc2, grad_ptrs[2], grad_strides[2], numels[2], GRAD_MODES[2], group, col_block, n_col_blocks,
                     cols, col_mask, col_divs, col_start, block_width, n_cols, OUTER_RANK, COL_RANK, INDEX_64,
                     PIXELS_POW2)
    if N_GRADS > 3:
        _grad_finish(acc3, grad_ptrs[3], grad_strides[3], numels[3], GRAD_MODES[3], group, col_block, n_col_blocks,
                     cols, col_mask, col_divs, col_start, block_width, n_cols, OUTER_RANK, COL_RANK, INDEX_64,
                     PIXELS_POW2)


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
        rounded = _cast_to(total, grad_ptrs[k].dtype.element_ty, EMULATE_BF16_RTNE)
        tl.store(grad_ptrs[k] + elements, rounded, mask=element_mask)
