"""How the batch norm kernels see x: its layout, and the tilings and grids of their passes.

The kernels (kernels/batch_norm.py) read x as a matrix: rows of C * S values
(NCHW-contiguous, :data:`_NCS`) or of C values (channels innermost,
:data:`_NSC`). :func:`_geometry_of` tiles that matrix for the reducing passes
(column groups, tiles, the per-channel merge) and for the normalise and dx
passes (tiles, grid), cached per shape, layout, element size and device;
:func:`_merge_layout` says how a reduction's last programs merge its chunks.
The constants below are read here: patch them here (tfuse/ops/batch_norm.py
re-exports them for reading only).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from tfuse._kit import needs_int64, next_power_of_2, num_warps
from tfuse._launch import target_programs
from tfuse.kernels import codes

#: Tile elements per thread the big passes aim for: the warps of a program are its tile over this.
ELEMENTS_PER_THREAD = 8
#: Elements per step (one [BN, BL] tile) of a program of the reducing passes.
TILE_REDUCE = 1024
#: Elements per step of a program of the normalise and dx passes.
TILE_ELEMENTWISE = 2048
#: Widest column block of a channels_last reduction (channels per program).
MAX_CHANNEL_BLOCK = 64
#: Steps (tiles) one program of the normalise and dx passes walks down its rows, at most.
MAX_STEPS = 8
#: Programs per SM the normalise and dx passes aim for (several waves of resident programs).
ELEMENTWISE_PROGRAMS_PER_SM = 32
#: Elements of the [chunks, channels] tile the merging programs of a reduction merge partials with (a step).
MERGE_TILE = 512
#: Merge steps up to which a reduction merges its chunks in one level (one block); more take two.
ONE_LEVEL_STEPS = 4


# Layouts the kernels read in place (see kernels/batch_norm.py).
_NCS = 0  # [N, C, S] contiguous: a row is one sample of C * S values
_NSC = 1  # channels innermost (channels_last, [N, C]): a row is one position of C values
_SEG_LANE, _SEG_ONE, _SEG_PACKED = (codes.SEG_LANE, codes.SEG_ONE, codes.SEG_PACKED)


def _layout(t: torch.Tensor) -> int | None:
    """_NCS, _NSC, or None when ``t``'s layout is neither (sizes of 1 never matter)."""
    return _layout_of(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=1024)
def _layout_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    channels, spatial = shape[1], math.prod(shape[2:])

    def dense(order: list[int]) -> bool:  # the dimensions in ``order``, innermost last, fill memory exactly
        expected = 1
        for dim in reversed(order):
            if shape[dim] != 1 and strides[dim] != expected:
                return False
            expected *= shape[dim]
        return True

    ncs = dense(list(range(len(shape))))
    nsc = dense([0, *range(2, len(shape)), 1])
    if ncs and nsc:  # S == 1 or C == 1: either reads the same memory; channels along columns when S == 1
        return _NSC if spatial == 1 and channels > 1 else _NCS
    return _NCS if ncs else _NSC if nsc else None


def _in_layout_of(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` (of x's shape) if it is laid out as x, else a copy in x's layout (x is dense)."""
    if t.stride() == x.stride() or _layout(t) == _layout(x):
        return t
    return torch.empty_like(x, dtype=t.dtype).copy_(t)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """x as a matrix of ``n_rows`` x ``n_cols`` (channel of a column: col // ss) and the tilings of its passes.

    Reductions: column groups of ``group_width`` columns (``groups`` of them),
    tiles [red_bn, red_bl], alignment ``red_vec``, per-channel merge ``seg``
    (``cb_pad``: channels per program, padded, when packed). Normalise and dx
    passes: tiles [ew_bn, ew_bl], alignment ``ew_vec``, grid ``ew_grid``, each
    program walking ``ew_rows_per_chunk`` rows.
    """

    channels: int
    n_rows: int
    n_cols: int
    ss: int
    group_width: int
    groups: int
    red_bn: int
    red_bl: int
    red_vec: int
    seg: int
    cb_pad: int
    ew_bn: int
    ew_bl: int
    ew_vec: int
    ew_grid: tuple[int, int]
    ew_rows_per_chunk: int
    index_64: bool

    def reduce_meta(self) -> dict:
        s_pad = next_power_of_2(self.ss) if self.seg == _SEG_PACKED else 1
        parts = max(1, 2 * self.cb_pad * s_pad // self.red_bl)  # gathered tiles of at most BL / 2 elements
        return dict(
            SEG=self.seg,
            BN=self.red_bn,
            BL=self.red_bl,
            VEC=self.red_vec,
            PARTS=parts,
            CB_PART=max(1, self.cb_pad // parts),
            S_PAD=s_pad,
            INDEX_64=self.index_64,
            num_warps=num_warps(self.red_bn * self.red_bl, ELEMENTS_PER_THREAD),
        )

    def merge_meta(self) -> dict:
        """The merge tile of a reduction's last programs: MC channels (a column group's) x MK chunks."""
        channels = self.red_bl if self.seg == _SEG_LANE else self.cb_pad if self.seg == _SEG_PACKED else 1
        row_steps = -(-self.n_rows // self.red_bn)  # chunks, at most
        return dict(MC=channels, MK=max(1, min(next_power_of_2(row_steps), MERGE_TILE // channels)))

    def elementwise_meta(self) -> dict:
        return dict(
            BN=self.ew_bn,
            BL=self.ew_bl,
            VEC=self.ew_vec,
            INDEX_64=self.index_64,
            num_warps=num_warps(self.ew_bn * self.ew_bl, ELEMENTS_PER_THREAD),
        )

    def chunks(self, resident: int) -> tuple[int, int]:
        """(chunks, rows per chunk) of a reduction with ``resident`` programs on the device at once."""
        row_steps = -(-self.n_rows // self.red_bn)
        chunks = min(row_steps, max(1, resident // self.groups))
        rows_per_chunk = -(-row_steps // chunks) * self.red_bn
        return -(-self.n_rows // rows_per_chunk), rows_per_chunk


def _power_of_2_factor(n: int, cap: int) -> int:
    """The largest power of two dividing ``n``, at most ``cap``."""
    return cap if n == 0 else min(n & -n, cap)


def _block(n: int, cap: int) -> int:
    """A power-of-two block for ``n`` columns: the widest (up to ``cap``) wasting at most 1/8 in padding,
    else the one (of at least 16) wasting least."""
    best, best_waste = 1, 1.0
    block = min(cap, next_power_of_2(n))
    smallest = min(block, 16)  # narrower blocks cost more in per-program work than padding does
    while block >= smallest:
        padded = -(-n // block) * block
        waste = (padded - n) / padded
        if waste <= 0.125:
            return block
        if waste < best_waste:
            best, best_waste = block, waste
        block //= 2
    return best


def _ncs_reduction(
    channels: int, spatial: int, n_cols: int, vec_cap: int, itemsize: int
) -> tuple[int, int, int, int, int]:
    """(group width, block, alignment, seg, cb_pad) of an NCHW reduction.

    Either ``cb`` whole channels per program, their cb * S values contiguous
    in a row and read as one window of BL lanes (S <= BL), or one channel per
    program read in pieces of BL. Candidates are ranked by the vector width
    they allow, then by the share of lanes doing work, then by width.
    """
    best = None
    block = 16
    while block <= TILE_REDUCE:
        options = []
        if spatial <= block:
            step = vec_cap // math.gcd(spatial, vec_cap)  # cb * S must stay a multiple of the alignment
            cb = min(channels, block // spatial // step * step) or min(channels, block // spatial)
            width = cb * spatial
            options.append((width, width / block))
        elif block * itemsize >= 128:  # a piece of a row is at least a cache line
            pieces = -(-spatial // block)
            options.append((spatial, spatial / (pieces * block)))
        for width, used in options:
            vec = _power_of_2_factor(math.gcd(n_cols, width), vec_cap)
            key = (vec, round(used * 32), block)
            if best is None or key > best[0]:
                best = (key, width, block, vec)
        block *= 2
    _, width, block, vec = best
    cb = width // spatial
    if width == spatial:
        return width, block, vec, _SEG_ONE, 1
    return width, block, vec, _SEG_PACKED, next_power_of_2(cb)


def _elementwise_target(device: torch.device) -> int:
    """Programs the normalise and dx passes aim for (``target_programs`` is 4 per SM on a GPU)."""
    return ELEMENTWISE_PROGRAMS_PER_SM * target_programs(device) // 4


def _geometry_of(x: torch.Tensor) -> _Geometry:
    return _geometry(tuple(x.shape), _layout(x), x.element_size(), _elementwise_target(x.device))


@functools.lru_cache(maxsize=512)
def _geometry(shape: tuple[int, ...], layout: int, itemsize: int, elementwise_target: int) -> _Geometry:
    channels, spatial = shape[1], math.prod(shape[2:])
    if layout == _NSC:
        n_rows, n_cols, ss = shape[0] * spatial, channels, 1
    else:
        n_rows, n_cols, ss = shape[0], channels * spatial, spatial
    vec_cap = max(1, 16 // itemsize)
    row_vec = _power_of_2_factor(n_cols, vec_cap)  # what every row start allows
    if layout == _NSC:
        red_bl = _block(channels, MAX_CHANNEL_BLOCK)
        group_width, red_vec, seg, cb_pad = red_bl, min(row_vec, red_bl), _SEG_LANE, 1
    else:
        group_width, red_bl, red_vec, seg, cb_pad = _ncs_reduction(channels, spatial, n_cols, row_vec, itemsize)
    red_bn = max(1, TILE_REDUCE // red_bl)
    ew_bl = _block(n_cols, TILE_ELEMENTWISE)
    ew_bn = max(1, TILE_ELEMENTWISE // ew_bl)
    col_tiles = -(-n_cols // ew_bl)
    row_steps = -(-n_rows // ew_bn)
    steps = max(1, min(MAX_STEPS, col_tiles * row_steps // elementwise_target))
    ew_rows_per_chunk = steps * ew_bn
    padded_rows = n_rows + max(red_bn, ew_rows_per_chunk)
    largest = padded_rows * n_cols + max(red_bl, ew_bl)
    return _Geometry(
        channels=channels,
        n_rows=n_rows,
        n_cols=n_cols,
        ss=ss,
        group_width=group_width,
        groups=-(-n_cols // group_width),
        red_bn=red_bn,
        red_bl=red_bl,
        red_vec=red_vec,
        seg=seg,
        cb_pad=cb_pad,
        ew_bn=ew_bn,
        ew_bl=ew_bl,
        ew_vec=min(row_vec, ew_bl),
        ew_grid=(col_tiles, -(-n_rows // ew_rows_per_chunk)),
        ew_rows_per_chunk=ew_rows_per_chunk,
        index_64=needs_int64(largest),
    )


def _chunks_per_block(chunks: int, per_step: int) -> int:
    """Chunks per block of a reduction's two-level merge (kernels/batch_norm.py): the fewest merge steps of
    ``per_step`` items, over the block merge and the merge of the blocks. One block (the chunks merged in one
    level, as a separate merge kernel did) up to :data:`ONE_LEVEL_STEPS` steps."""
    if chunks <= ONE_LEVEL_STEPS * per_step:
        return chunks
    best = None
    for block in range(per_step, chunks + per_step, per_step):
        block = min(block, chunks)
        blocks = -(-chunks // block)
        steps = -(-block // per_step) + -(-blocks // per_step)
        if best is None or steps < best[0]:
            best = (steps, block)
    return best[1]


def _merge_layout(geometry, chunks: int) -> tuple[int, int, int]:
    """(chunks per block, blocks, counters) of a merging reduction of ``chunks`` chunks per column group."""
    per_block = _chunks_per_block(chunks, geometry.merge_meta()["MK"])
    blocks = -(-chunks // per_block)
    return per_block, blocks, geometry.groups * (1 + blocks)
