"""N-ary elementwise add with broadcasting, in one pass.

``out = x0 + x1 + ... + x{N-1}``: every input is read once, the output is
written once, nothing is stored in between (the add3 fusion of the seeds,
generalised to N inputs and to broadcasting). Tiling and addressing are
described in tiles.py.
"""

import triton
import triton.language as tl

from .cast import _cast_to
from .tiles import _sum_tile_of_program


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
    acc, offsets, mask = _sum_tile_of_program(
        in_ptrs, in_strides, outer_sizes, n_rows, n_cols, N_INPUTS, MODES, OUTER_RANK, INDEX_64, ACC_FP64,
        ONE_ROW, BLOCK_ROWS, BLOCK_COLS,
    )
    tl.store(out_ptr + offsets, _cast_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
