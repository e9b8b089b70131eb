"""Plans the 2-D tiling of a broadcast elementwise op (see kernels/add.py).

The output's dimensions are put in memory order, size-1 dimensions dropped
and neighbours merged wherever every operand allows, so that a
contiguous same-shape op becomes a single row and a bias over channels
becomes (rows, channels). The last merged dimension is the tile's column
dimension, the others are the rows.

Wide columns: when the last merged dimension is not a multiple of 16
elements (7x7 or 14x14 pixels per channel, a hidden size of 1000), rows of
the output start at addresses Triton cannot prove 16-byte aligned, and every
access would be scalar. The launchers then ask for more column dimensions
(``max_col_rank``): the columns become the last COL_RANK merged dimensions,
as many as it takes for their product to be a multiple of 16 (all of them,
a single row, if none is). Contiguous operands are then addressed by the
column index itself and get 128-bit accesses; broadcast operands find their
offset from the column's coordinates, one multiply-high per inner dimension
(``magic_divisor``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

# INT32_LIMIT is read from this module at each plan (and is part of the plan
# cache's key), so a test can lower it here to take the int64 path on small data.
from tfuse._kit import INT32_LIMIT, NUM_WARPS, acc_fp64, emulate_bf16_rtne, needs_int64, next_power_of_2
from tfuse.kernels import codes

# Addressing modes of kernels/tiles.py as plain ints.
LINEAR, SCALAR, ROW, COL, STRIDED = codes.LINEAR, codes.SCALAR, codes.ROW, codes.COL, codes.STRIDED

#: Elements per program. 2048 elements at NUM_WARPS (4) warps keeps 16 elements
#: per thread in flight per input (four 128-bit loads in float32).
TILE_ELEMENTS = 2048
#: Elements per thread of a full tile (16); wider tiles get more warps, not more per thread.
ELEMENTS_PER_THREAD = TILE_ELEMENTS // (32 * NUM_WARPS)
#: Column counts that are a multiple of this (in elements) keep every row 16-byte
#: aligned for any dtype, as Triton sees it (it specialises integer arguments
#: divisible by 16).
COL_ALIGN = 16
#: Placeholder for ``col_divs`` of a plan with one column dimension.
NO_COL_DIVS = ((1, 0, 0),)


def magic_divisor(d: int) -> tuple[int, int, int]:
    """``(d, m, s)`` with ``j // d == umulhi(j, m) >> s`` for every 0 <= j < 2**31 (d >= 2).

    Granlund and Montgomery (1994), theorem 4.2 with N = 31 bits: with
    l = ceil(log2 d) and m = ceil(2**(31 + l) / d), m * d exceeds 2**(31 + l)
    by less than d <= 2**l, so floor(j * m / 2**(31 + l)) == floor(j / d) for
    j < 2**31; m < 2**32 because d > 2**(l - 1), so the product's high 32 bits
    (umulhi) shifted right by l - 1 give the quotient. ``m`` is returned as
    the int32 with the same bits (kernels reinterpret it as uint32).
    """
    if d < 2:
        raise ValueError(f"internal error: magic divisor for {d}")
    shift = (d - 1).bit_length()
    m = -(-(1 << (31 + shift)) // d)
    assert m < 2**32
    return d, m - 2**32 if m >= 2**31 else m, shift - 1


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How a kernel walks the output and addresses each input.

    Attributes:
        n_rows, n_cols: the output as a 2-D array in memory order.
        outer_sizes: sizes of the merged outer dimensions (their product is n_rows).
        col_sizes: sizes of the merged column dimensions, outermost first
            (their product is n_cols; one dimension unless widened).
        col_divs: ``magic_divisor`` of each column dimension but the
            outermost, innermost first (NO_COL_DIVS with one dimension).
        modes: addressing mode of each input (LINEAR ... STRIDED, see kernels/tiles.py).
        in_strides: per input, its merged strides (outer ones, then the column
            ones) for ROW/COL/STRIDED modes; a placeholder otherwise.
        merged_strides: per input, its merged strides whatever its mode.
        index_64: offsets need int64.
        block_rows, block_cols: tile shape (powers of two).
    """

    n_rows: int
    n_cols: int
    outer_sizes: tuple[int, ...]
    col_sizes: tuple[int, ...]
    col_divs: tuple[tuple[int, int, int], ...]
    modes: tuple[int, ...]
    in_strides: tuple[tuple[int, ...], ...]
    merged_strides: tuple[tuple[int, ...], ...]
    index_64: bool
    block_rows: int
    block_cols: int

    @property
    def col_rank(self) -> int:
        """Number of merged dimensions that make the columns."""
        return len(self.col_sizes)

    @property
    def grid(self) -> tuple[int]:
        """One program per tile."""
        row_tiles = -(-self.n_rows // self.block_rows)
        col_tiles = -(-self.n_cols // self.block_cols)
        return (row_tiles * col_tiles,)


def tile_meta(plan: TilePlan, out: torch.Tensor) -> dict[str, object]:
    """Meta-parameters every one-pass tiled kernel takes (kernels/tiles.py)."""
    return dict(
        MODES=plan.modes,
        OUTER_RANK=len(plan.outer_sizes),
        COL_RANK=plan.col_rank,
        INDEX_64=plan.index_64,
        ACC_FP64=acc_fp64(out.dtype),
        EMULATE_BF16_RTNE=emulate_bf16_rtne(),
        ONE_ROW=plan.n_rows == 1,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        num_warps=NUM_WARPS,
    )


def expanded_strides(sizes: Sequence[int], strides: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a tensor of ``sizes``/``strides`` expanded to ``shape`` (0 on broadcast dims)."""
    offset = len(shape) - len(sizes)
    expanded = [0] * len(shape)
    for dim, (size, stride) in enumerate(zip(sizes, strides)):
        if size != 1:
            expanded[offset + dim] = stride
    return tuple(expanded)


def plan_tiles(out: torch.Tensor, inputs: Sequence[torch.Tensor], max_col_rank: int | None = 1) -> TilePlan:
    """Plans the tiling for writing ``out`` (dense, allocated by the launcher) from ``inputs``.

    ``inputs`` must broadcast to ``out.shape`` (checked by the caller). With
    ``max_col_rank`` above 1 (None: no limit) the columns may span several
    merged dimensions (see the module docstring); the launchers ask for that,
    the default is the plain one-dimension plan. Plans depend only on shapes
    and strides, and training repeats the same ones every step, so they are
    cached (a plan costs about 15 us of Python).
    """
    layouts = tuple((tuple(t.shape), t.stride()) for t in inputs)
    return _plan(tuple(out.shape), out.stride(), layouts, INT32_LIMIT, max_col_rank)


def plan_layouts(
    shape: Sequence[int],
    out_strides: Sequence[int],
    layouts: Sequence[tuple[Sequence[int], Sequence[int]]],
    max_col_rank: int | None = 1,
) -> TilePlan:
    """:func:`plan_tiles` from (sizes, strides) pairs, for operands that are not tensors yet."""
    key = tuple((tuple(sizes), tuple(strides)) for sizes, strides in layouts)
    return _plan(tuple(shape), tuple(out_strides), key, INT32_LIMIT, max_col_rank)


def _col_rank(sizes: Sequence[int], max_col_rank: int | None) -> int:
    """How many trailing merged dimensions make the columns (see the module docstring)."""
    limit = len(sizes) if max_col_rank is None else min(max_col_rank, len(sizes))
    n_cols = 1
    for rank in range(1, limit + 1):
        n_cols *= sizes[-rank]
        if n_cols % COL_ALIGN == 0:
            return rank
    return limit if limit == len(sizes) else 1


@functools.lru_cache(maxsize=4096)
def _plan(
    shape: tuple[int, ...],
    out_strides: tuple[int, ...],
    layouts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
    int32_limit: int,
    max_col_rank: int | None = 1,
) -> TilePlan:
    operands = [out_strides] + [expanded_strides(sizes, strides, shape) for sizes, strides in layouts]
    # Memory order of the output, outermost first; size-1 dimensions carry nothing.
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -out_strides[d])

    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in operands]
    for dim in dims:
        size = shape[dim]
        if sizes and all(m[-1] == s[dim] * size for m, s in zip(merged, operands)):
            sizes[-1] *= size
            for m, s in zip(merged, operands):
                m[-1] = s[dim]
        else:
            sizes.append(size)
            for m, s in zip(merged, operands):
                m.append(s[dim])
    if not sizes:  # a single element
        sizes = [1]
        merged = [[0] for _ in operands]

    out_strides = merged[0]
    contiguous = 1
    for size, stride in zip(reversed(sizes), reversed(out_strides)):
        if size != 1 and stride != contiguous:
            raise RuntimeError(f"internal error: output strides {out_strides} are not dense")
        contiguous *= size

    col_rank = _col_rank(sizes, max_col_rank)
    outer_rank = len(sizes) - col_rank
    modes = []
    in_strides = []
    for strides in merged[1:]:
        if strides == out_strides or (len(sizes) == 1 and sizes[0] == 1):
            modes.append(LINEAR)
        elif all(s == 0 for s in strides):
            modes.append(SCALAR)
        elif all(s == 0 for s in strides[outer_rank:]):
            modes.append(ROW)
        elif all(s == 0 for s in strides[:outer_rank]):
            modes.append(COL)
        else:
            modes.append(STRIDED)
        in_strides.append(tuple(strides) if modes[-1] not in (LINEAR, SCALAR) else (0,))

    outer_sizes = tuple(sizes[:outer_rank])
    col_sizes = tuple(sizes[outer_rank:])
    col_divs = tuple(magic_divisor(d) for d in reversed(col_sizes[1:])) or NO_COL_DIVS
    n_cols = 1
    for size in col_sizes:
        n_cols *= size
    n_rows = 1
    for size in outer_sizes:
        n_rows *= size
    block_cols = min(next_power_of_2(n_cols), TILE_ELEMENTS)
    block_rows = min(TILE_ELEMENTS // block_cols, next_power_of_2(n_rows))

    # Largest offset any lane computes, masked lanes of the last tile included.
    padded_out = (n_rows + block_rows) * n_cols + block_cols
    # Padded rows and columns only ever step further along the largest stride.
    largest_input = max(
        (
            sum((size - 1) * s for size, s in zip(sizes, strides)) + (block_rows + block_cols) * max(strides)
            for strides in merged[1:]
        ),
        default=0,
    )
    index_64 = needs_int64(max(padded_out, largest_input), int32_limit)

    return TilePlan(
        n_rows=n_rows,
        n_cols=n_cols,
        outer_sizes=outer_sizes,
        col_sizes=col_sizes,
        col_divs=col_divs,
        modes=tuple(modes),
        in_strides=tuple(in_strides),
        merged_strides=tuple(tuple(m) for m in merged[1:]),
        index_64=index_64,
        block_rows=block_rows,
        block_cols=block_cols,
    )


def empty_broadcast_output(inputs: Sequence[torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Allocates the output of a broadcast elementwise op, in the inputs' layout.

    Like torch, the output follows the memory layout of the first input that
    has the full output shape (so channels_last in gives channels_last out);
    with none, it is contiguous.
    """
    for tensor in inputs:
        if tensor.shape == shape:
            return torch.empty_like(tensor, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device=inputs[0].device)


def reduced_grad_strides(
    input_shape: Sequence[int], out_shape: Sequence[int], out_strides: Sequence[int]
) -> tuple[int, ...]:
    """Dense strides for the gradient of an input broadcast to ``out_shape``.

    The gradient's dimensions are laid out in the output's memory order, so
    the merged dimensions of the gradient match those of the output and its
    memory offsets are what the backward kernel's reduction indexes.
    """
    offset = len(out_shape) - len(input_shape)
    order = sorted(range(len(input_shape)), key=lambda d: -out_strides[offset + d])
    strides = [0] * len(input_shape)
    running = 1
    for dim in reversed(order):
        strides[dim] = running
        running *= max(input_shape[dim], 1)
    return tuple(strides)
