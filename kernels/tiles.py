"""Jit helpers shared by the broadcast elementwise kernels (add, add + activation).

The launchers (tfuse/ops/_tiles.py) view the output as ``n_rows x n_cols`` in
memory order. The rows stand for merged outer dimensions of sizes
``outer_sizes``; the columns for COL_RANK merged inner dimensions (one, or
more when the innermost dimension alone is too short or misaligned for
128-bit accesses, e.g. the 7x7 = 49 pixels of a per-channel add). Each operand
is addressed in one of the modes below, chosen by the launcher and passed as
a compile-time constant.

Column coordinates with COL_RANK > 1 come from dividing the column index by
the sizes of the inner column dimensions. Those divisions use magic numbers
(``col_divs``: per divisor d, innermost first, ``(d, m, s)`` with
``floor(j / d) == umulhi(j, m) >> s`` for every 0 <= j < 2**31; see
``tfuse/ops/_tiles.py``), two instructions instead of a software division;
int64 indexing (INDEX_64) divides plainly.

Tiles entirely inside the output are processed without masks (MASKED=False),
so contiguous operands get 128-bit accesses whatever the sizes; only the
edge tiles are masked.
"""

import triton
import triton.language as tl

from . import codes
from .kit import _acc_dtype

# Addressing modes. (Kernels may read globals only if they are tl.constexpr;
# launchers use .value.)
LINEAR = tl.constexpr(codes.LINEAR)  # same strides as the output: operand offset == output offset
SCALAR = tl.constexpr(codes.SCALAR)  # a single element broadcast everywhere
ROW = tl.constexpr(codes.ROW)  # constant along a row (column strides 0): one load per row
COL = tl.constexpr(codes.COL)  # the same for every row (outer strides 0): one load per column
STRIDED = tl.constexpr(codes.STRIDED)  # anything else: row offset from the outer coordinates + column offset


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
def _div_magic(j, div, INDEX_64: tl.constexpr):
    """floor(j / d) for ``div = (d, m, s)`` and 0 <= j (< 2**31 unless INDEX_64)."""
    if INDEX_64:
        q = j // div[0]
    else:
        # tl.cast, not .to: Triton may pass a shift or multiplier of 1 as a Python int.
        q = (tl.umulhi(j.to(tl.uint32), tl.cast(div[1], tl.uint32)) >> tl.cast(div[2], tl.uint32)).to(tl.int32)
    return q


@triton.jit
def _col_offsets(cols, col_divs, strides, OUTER_RANK: tl.constexpr, COL_RANK: tl.constexpr, INDEX_64: tl.constexpr):
    """Offset of each column (index ``cols``) for an operand whose column strides
    are ``strides[OUTER_RANK:]`` (outermost first)."""
    if COL_RANK == 1:
        offsets = cols * strides[OUTER_RANK]
    else:
        offsets = tl.zeros_like(cols)
        remaining = cols
        for i in tl.static_range(COL_RANK - 1):  # innermost dimension first
            quotient = _div_magic(remaining, col_divs[i], INDEX_64)
            offsets += (remaining - quotient * col_divs[i][0]) * strides[OUTER_RANK + COL_RANK - 1 - i]
            remaining = quotient
        offsets += remaining * strides[OUTER_RANK]
    return offsets


@triton.jit
def _tile(row_start, cols, n_rows, n_cols, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows, output offsets and masks of the tile at ``row_start`` x ``cols``.

    With ONE_ROW (n_rows == 1, BLOCK_ROWS == 1) the offsets are ``cols``
    itself, known at compile time to be contiguous and aligned.
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
def _tile_start(pid, n_cols, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """First row and first column of the tile of program ``pid`` (1-D grid of BLOCK_ROWS x BLOCK_COLS tiles)."""
    if ONE_ROW:
        row_start = tl.zeros_like(pid)
        col_start = pid * BLOCK_COLS
    else:
        col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
        row_start = (pid // col_tiles) * BLOCK_ROWS
        col_start = (pid % col_tiles) * BLOCK_COLS
    return row_start, col_start


@triton.jit
def _tile_is_full(pid, n_rows, n_cols, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Whether the tile of program ``pid`` lies entirely inside the output (then it needs no masks)."""
    row_start, col_start = _tile_start(pid, n_cols, ONE_ROW, BLOCK_ROWS, BLOCK_COLS)
    return (row_start + BLOCK_ROWS <= n_rows) & (col_start + BLOCK_COLS <= n_cols)


@triton.jit
def _tile_of_program(pid, n_rows, n_cols, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """The tile of program ``pid`` in a 1-D grid of BLOCK_ROWS x BLOCK_COLS tiles."""
    row_start, col_start = _tile_start(pid, n_cols, ONE_ROW, BLOCK_ROWS, BLOCK_COLS)
    cols = col_start + tl.arange(0, BLOCK_COLS)
    rows, offsets, row_mask, col_mask, mask = _tile(row_start, cols, n_rows, n_cols, ONE_ROW, BLOCK_ROWS)
    return rows, cols, offsets, row_mask, col_mask, mask


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """tl.load, masked (0 outside) only when MASKED."""
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store(ptrs, values, mask, MASKED: tl.constexpr):
    """tl.store, masked only when MASKED."""
    if MASKED:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.store(ptrs, values)


@triton.jit
def _load_operand(
    ptr, strides, MODE: tl.constexpr, rows, cols, offsets, row_mask, col_mask, mask,
    outer_sizes, OUTER_RANK: tl.constexpr, dtype: tl.constexpr,
    col_divs, COL_RANK: tl.constexpr, INDEX_64: tl.constexpr, MASKED: tl.constexpr,
):
    """The operand's values over the tile, as ``dtype``, broadcast to the tile's shape."""
    # (Broadcasts by tl.broadcast_to, not by adding zeros: 0.0 + x is an
    # instruction per element, which the compiler may not drop because of -0.0.)
    if MODE == LINEAR:
        x = _load(ptr + offsets, mask, MASKED).to(dtype)
    elif MODE == SCALAR:
        x = tl.full(offsets.shape, tl.load(ptr).to(dtype), dtype)
    elif MODE == COL:
        x = _load(ptr + _col_offsets(cols, col_divs, strides, OUTER_RANK, COL_RANK, INDEX_64), col_mask, MASKED)
        x = tl.broadcast_to(x.to(dtype)[None, :], offsets.shape)
    else:
        row_offsets = _row_offsets(rows, outer_sizes, strides, OUTER_RANK)
        if MODE == ROW:
            x = _load(ptr + row_offsets, row_mask, MASKED).to(dtype)
            x = tl.broadcast_to(x[:, None], offsets.shape)
        else:
            col_offsets = _col_offsets(cols, col_divs, strides, OUTER_RANK, COL_RANK, INDEX_64)
            x = _load(ptr + row_offsets[:, None] + col_offsets[None, :], mask, MASKED).to(dtype)
    return x


@triton.jit
def _sum_operands(
    ptrs, strides, MODES: tl.constexpr, N: tl.constexpr, rows, cols, offsets, row_mask, col_mask, mask,
    outer_sizes, OUTER_RANK: tl.constexpr, dtype: tl.constexpr,
    col_divs, COL_RANK: tl.constexpr, INDEX_64: tl.constexpr, MASKED: tl.constexpr, SKIP_COL: tl.constexpr = False,
):
    """``sum(operands)`` over the tile, accumulated in ``dtype`` left to right
    (without the COL operands if SKIP_COL: see _sum_col_operands)."""
    acc = tl.zeros(offsets.shape, dtype)
    for i in tl.static_range(N):
        if not (SKIP_COL and MODES[i] == COL):
            x = _load_operand(
                ptrs[i], strides[i], MODES[i], rows, cols, offsets, row_mask, col_mask, mask, outer_sizes,
                OUTER_RANK, dtype, col_divs, COL_RANK, INDEX_64, MASKED,
            )
            if i == 0:
                acc = x  # not 0.0 + x: one add per element fewer (and -0.0 stays -0.0, as in torch)
            else:
                acc += x
    return acc


@triton.jit
def _sum_col_operands(
    ptrs, strides, MODES: tl.constexpr, N: tl.constexpr, cols, col_mask, col_divs, OUTER_RANK: tl.constexpr,
    COL_RANK: tl.constexpr, INDEX_64: tl.constexpr, dtype: tl.constexpr,
):
    """The sum of the COL operands over the columns ``cols`` (a vector): what
    they add to every row, loaded once by a program that walks many rows."""
    acc = tl.zeros(cols.shape, dtype)
    for i in tl.static_range(N):
        if MODES[i] == COL:
            offsets = _col_offsets(cols, col_divs, strides[i], OUTER_RANK, COL_RANK, INDEX_64)
            acc += tl.load(ptrs[i] + offsets, mask=col_mask, other=0.0).to(dtype)
    return acc


@triton.jit
def _sum_tile_of_program(
    pid, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, N_INPUTS: tl.constexpr, MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr, COL_RANK: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
    ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, MASKED: tl.constexpr,
):
    """The sum of the inputs over the tile of program ``pid`` (float32, or
    float64 with ACC_FP64), with the tile's output offsets and mask: the
    common body of the one-pass elementwise kernels."""
    rows, cols, offsets, row_mask, col_mask, mask = _tile_of_program(
        pid, n_rows, n_cols, ONE_ROW, BLOCK_ROWS, BLOCK_COLS
    )
    acc_dtype: tl.constexpr = _acc_dtype(ACC_FP64)
    acc = _sum_operands(
        in_ptrs, in_strides, MODES, N_INPUTS, rows, cols, offsets, row_mask, col_mask, mask,
        outer_sizes, OUTER_RANK, acc_dtype, col_divs, COL_RANK, INDEX_64, MASKED,
    )
    return acc, offsets, mask


@triton.jit
def _program_id(INDEX_64: tl.constexpr):
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    return pid
