"""N-ary elementwise add with broadcasting, in one pass.

``out = x0 + x1 + ... + x{N-1}``: every input is read once, the output is
written once, nothing is stored in between (PaddlePaddle's add3 fusion,
generalised to N inputs and to broadcasting). Tiling and addressing are
described in tiles.py.
"""

import triton
import triton.language as tl

from .cast import _cast_to
from .tiles import _program_id, _store, _sum_tile_of_program, _tile_is_full


@triton.jit
def _add_tile(
    pid, out_ptr, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, N_INPUTS: tl.constexpr,
    MODES: tl.constexpr, OUTER_RANK: tl.constexpr, COL_RANK: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr, MASKED: tl.constexpr,
):
    acc, offsets, mask = _sum_tile_of_program(
        pid, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, N_INPUTS, MODES, OUTER_RANK, COL_RANK,
        INDEX_64, ACC_FP64, ONE_ROW, BLOCK_ROWS, BLOCK_COLS, MASKED,
    )
    _store(out_ptr + offsets, _cast_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask, MASKED)


@triton.jit
def _add_fwd_kernel(
    out_ptr,
    in_ptrs,
    in_strides,
    outer_sizes,
    col_divs,
    n_rows,
    n_cols,
    N_INPUTS: tl.constexpr,
    MODES: tl.constexpr,
    OUTER_RANK: tl.constexpr,
    COL_RANK: tl.constexpr,
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
                 OUTER_RANK outer strides followed by the COL_RANK column
                 strides, for LINEAR/SCALAR inputs an unused placeholder.
    outer_sizes: sizes of the collapsed outer dimensions (product n_rows).
    col_divs:    magic divisors of the inner column dimensions (tiles.py).
    INDEX_64:    compute offsets in int64 (needed past 2**31 elements).
    ACC_FP64:    accumulate in float64 (float64 outputs) instead of float32.
    EMULATE_BF16_RTNE: round bfloat16 output on the bits (interpreter only, see cast.py).
    ONE_ROW:     n_rows == 1 (then BLOCK_ROWS == 1).
    """
    pid = _program_id(INDEX_64)
    if _tile_is_full(pid, n_rows, n_cols, ONE_ROW, BLOCK_ROWS, BLOCK_COLS):
        _add_tile(
            pid, out_ptr, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, N_INPUTS, MODES, OUTER_RANK,
            COL_RANK, INDEX_64, ACC_FP64, EMULATE_BF16_RTNE, ONE_ROW, BLOCK_ROWS, BLOCK_COLS, False,
        )
    else:
        _add_tile(
            pid, out_ptr, in_ptrs, in_strides, outer_sizes, col_divs, n_rows, n_cols, N_INPUTS, MODES, OUTER_RANK,
            COL_RANK, INDEX_64, ACC_FP64, EMULATE_BF16_RTNE, ONE_ROW, BLOCK_ROWS, BLOCK_COLS, True,
        )
