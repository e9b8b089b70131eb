"""N-ary elementwise add with broadcasting, in one pass.

``out = x0 + x1 + ... + x{N-1}``: every input is read once, the output is
written once, nothing is stored in between (the add3 fusion of the seeds,
generalised to N inputs and to broadcasting).

The launcher collapses the iteration space into a 2-D view of the output in
memory order: ``n_rows`` rows of ``n_cols`` contiguous elements, where the
rows stand for the collapsed outer dimensions (sizes ``outer_sizes``). Each
program handles a ``BLOCK_ROWS x BLOCK_COLS`` tile. Each input is addressed
in one of the modes below, chosen by the launcher and baked in as a
compile-time constant, so the common cases cost no index arithmetic per
element.
"""

import triton
import triton.language as tl

from .cast import _cast_to

# How an input is addressed; one value per input in the MODES constexpr tuple.
# (Kernels may read globals only if they are tl.constexpr; launchers use .value.)
LINEAR = tl.constexpr(0)  # same strides as the output: input offset == output offset
SCALAR = tl.constexpr(1)  # a single element broadcast everywhere
ROW = tl.constexpr(2)  # constant along a row (inner stride 0): one load per row
COL = tl.constexpr(3)  # the same for every row (outer strides 0): one load per column
STRIDED = tl.constexpr(4)  # anything else: row offset from the outer coordinates + col * stride


@triton.jit
def _row_offsets(rows, outer_sizes, strides, OUTER_RANK: tl.constexpr):
    """Offset of the first element of each row for an input with ``strides``.

    ``rows`` are linear indices over the outer dimensions (outermost first in
    ``outer_sizes``); they are decomposed innermost first. The divisions act
    on a vector of BLOCK_ROWS row indices, not on every element.
    """
    offsets = tl.zeros_like(rows)
    remaining = rows
    for dim in tl.static_range(OUTER_RANK - 1, -1, -1):
        if dim > 0:
            coord = remaining % outer_sizes[dim]
            remaining = remaining // outer_sizes[dim]
        else:
            coord = remaining
        offsets += coord * strides[dim]
    return offsets


@triton.jit
def _add_fwd_kernel(
    out_ptr,
    in_ptrs,
    in_strides,
    outer_sizes,
    n_rows,
    n_cols,
    N_INPUTS: tl.constexpr,
    MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr,
    INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """One tile of ``out = sum(inputs)``.

    in_ptrs:     tuple of N_INPUTS pointers.
    in_strides:  tuple of N_INPUTS tuples; for ROW/COL/STRIDED inputs the
                 OUTER_RANK outer strides followed by the inner (column) stride,
                 for LINEAR/SCALAR inputs an unused placeholder.
    outer_sizes: sizes of the collapsed outer dimensions (product n_rows).
    INDEX_64:    compute offsets in int64 (needed past 2**31 elements).
    ACC_FP64:    accumulate in float64 (float64 outputs) instead of float32.
    EMULATE_BF16_RTNE: round bfloat16 output on the bits (interpreter only, see cast.py).
    ONE_ROW:     n_rows == 1 (then BLOCK_ROWS == 1).
    """
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    if ONE_ROW:
        # A fully merged op (e.g. same-shape contiguous inputs). Said at compile
        # time so the offsets are provably pid * BLOCK_COLS + i: aligned, and
        # loaded with 128-bit vectors whatever n_cols is.
        rows = tl.zeros([BLOCK_ROWS], dtype=pid.dtype)
        cols = pid * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        out_offsets = cols[None, :] + rows[:, None]
    else:
        col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
        row_tile = pid // col_tiles
        col_tile = pid % col_tiles
        rows = row_tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = col_tile * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        out_offsets = rows[:, None] * n_cols + cols[None, :]
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    if ACC_FP64:
        acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)

    for i in tl.static_range(N_INPUTS):
        ptr = in_ptrs[i]
        if MODES[i] == LINEAR:
            x = tl.load(ptr + out_offsets, mask=mask, other=0.0)
            acc += x.to(acc.dtype)
        elif MODES[i] == SCALAR:
            x = tl.load(ptr)
            acc += x.to(acc.dtype)
        elif MODES[i] == COL:
            strides = in_strides[i]
            x = tl.load(ptr + cols * strides[OUTER_RANK], mask=col_mask, other=0.0)
            acc += x.to(acc.dtype)[None, :]
        else:
            strides = in_strides[i]
            row_offsets = _row_offsets(rows, outer_sizes, strides, OUTER_RANK)
            if MODES[i] == ROW:
                x = tl.load(ptr + row_offsets, mask=row_mask, other=0.0)
                acc += x.to(acc.dtype)[:, None]
            else:
                offsets = row_offsets[:, None] + cols[None, :] * strides[OUTER_RANK]
                x = tl.load(ptr + offsets, mask=mask, other=0.0)
                acc += x.to(acc.dtype)

    out = _cast_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16_RTNE)
    tl.store(out_ptr + out_offsets, out, mask=mask)
