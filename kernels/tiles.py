"""Jit helpers shared by the broadcast elementwise kernels (add, add + activation).

The launchers (tfuse/ops/_tiles.py) view the output as ``n_rows x n_cols`` in
memory order, the rows standing for merged outer dimensions of sizes
``outer_sizes``. Each operand is addressed in one of the modes below, chosen
by the launcher and passed as a compile-time constant.
"""

import triton
import triton.language as tl

# Addressing modes. (Kernels may read globals only if they are tl.constexpr;
# launchers use .value.)
LINEAR = tl.constexpr(0)  # same strides as the output: operand offset == output offset
SCALAR = tl.constexpr(1)  # a single element broadcast everywhere
ROW = tl.constexpr(2)  # constant along a row (inner stride 0): one load per row
COL = tl.constexpr(3)  # the same for every row (outer strides 0): one load per column
STRIDED = tl.constexpr(4)  # anything else: row offset from the outer coordinates + col * stride


@triton.jit
def _row_offsets(rows, outer_sizes, strides, OUTER_RANK: tl.constexpr):
    """Offset of the first element of each row for an operand with ``strides``.

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
def _tile(row_start, cols, n_rows, n_cols, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows, output offsets and masks of the tile at ``row_start`` x ``cols``.

    With ONE_ROW (n_rows == 1, BLOCK_ROWS == 1) the offsets are ``cols``
    itself, known at compile time to be contiguous and aligned: 128-bit
    vector accesses whatever n_cols is.
    """
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    if ONE_ROW:
        offsets = cols[None, :] + tl.zeros_like(rows)[:, None]
    else:
        offsets = rows[:, None] * n_cols + cols[None, :]
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    return rows, offsets, row_mask, col_mask, mask


@triton.jit
def _tile_of_program(pid, n_rows, n_cols, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """The tile of program ``pid`` in a 1-D grid of BLOCK_ROWS x BLOCK_COLS tiles."""
    if ONE_ROW:
        row_start = tl.zeros_like(pid)
        cols = pid * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    else:
        col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
        row_start = (pid // col_tiles) * BLOCK_ROWS
        cols = (pid % col_tiles) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    rows, offsets, row_mask, col_mask, mask = _tile(row_start, cols, n_rows, n_cols, ONE_ROW, BLOCK_ROWS)
    return rows, cols, offsets, row_mask, col_mask, mask


@triton.jit
def _load_operand(
    ptr, strides, MODE: tl.constexpr, rows, cols, offsets, row_mask, col_mask, mask,
    outer_sizes, OUTER_RANK: tl.constexpr, dtype: tl.constexpr,
):
    """The operand's values over the tile, as ``dtype``, broadcast to the tile's shape."""
    if MODE == LINEAR:
        x = tl.load(ptr + offsets, mask=mask, other=0.0).to(dtype)
    elif MODE == SCALAR:
        x = tl.zeros(offsets.shape, dtype) + tl.load(ptr).to(dtype)
    elif MODE == COL:
        x = tl.load(ptr + cols * strides[OUTER_RANK], mask=col_mask, other=0.0).to(dtype)
        x = tl.zeros(offsets.shape, dtype) + x[None, :]
    else:
        row_offsets = _row_offsets(rows, outer_sizes, strides, OUTER_RANK)
        if MODE == ROW:
            x = tl.load(ptr + row_offsets, mask=row_mask, other=0.0).to(dtype)
            x = tl.zeros(offsets.shape, dtype) + x[:, None]
        else:
            x = tl.load(ptr + row_offsets[:, None] + cols[None, :] * strides[OUTER_RANK], mask=mask, other=0.0)
            x = x.to(dtype)
    return x


@triton.jit
def _sum_operands(
    ptrs, strides, MODES: tl.constexpr, N: tl.constexpr, rows, cols, offsets, row_mask, col_mask, mask,
    outer_sizes, OUTER_RANK: tl.constexpr, dtype: tl.constexpr,
):
    """``sum(operands)`` over the tile, accumulated in ``dtype`` left to right."""
    acc = tl.zeros(offsets.shape, dtype)
    for i in tl.static_range(N):
        acc += _load_operand(
            ptrs[i], strides[i], MODES[i], rows, cols, offsets, row_mask, col_mask, mask, outer_sizes, OUTER_RANK, dtype
        )
    return acc


@triton.jit
def _sum_tile_of_program(
    in_ptrs, in_strides, outer_sizes, n_rows, n_cols, N_INPUTS: tl.constexpr, MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr, ONE_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """The sum of the inputs over this program's tile (float32, or float64 with
    ACC_FP64), with the tile's output offsets and mask: the common body of the
    one-pass elementwise kernels."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    rows, cols, offsets, row_mask, col_mask, mask = _tile_of_program(
        pid, n_rows, n_cols, ONE_ROW, BLOCK_ROWS, BLOCK_COLS
    )
    if ACC_FP64:
        acc_dtype: tl.constexpr = tl.float64
    else:
        acc_dtype: tl.constexpr = tl.float32
    acc = _sum_operands(
        in_ptrs, in_strides, MODES, N_INPUTS, rows, cols, offsets, row_mask, col_mask, mask,
        outer_sizes, OUTER_RANK, acc_dtype,
    )
    return acc, offsets, mask
