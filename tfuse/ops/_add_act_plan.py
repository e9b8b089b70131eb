"""The launch plan of ``tfuse.add_act``'s Triton backward, worked out once per layout.

:func:`grad_slots` says which inputs share a gradient buffer;
:func:`_backward_plan` (cached) turns the layouts of the output, the
incoming gradient, the saved tensors and the gradients into the backward
kernel's modes, blocks, grid and arguments, and the second-stage reduction's
(:class:`_BackwardPlan`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

from tfuse._kit import (
    NUM_WARPS,
    acc_dtype,
    acc_fp64,
    emulate_bf16_rtne,
    needs_int64,
    next_power_of_2,
    num_warps,
)
from tfuse.kernels import codes
from tfuse.ops._activations import math_mode
from tfuse.ops._tiles import (
    COL,
    COL_ALIGN,
    ELEMENTS_PER_THREAD,
    LINEAR,
    ROW,
    SCALAR,
    STRIDED,
    TILE_ELEMENTS,
    TilePlan,
    plan_layouts,
    reduced_grad_strides,
)

#: Stage-2 reduction tile: partial rows x gradient elements per step (elements
#: shrink to _SUM_MIN_ELEMENTS when that gives the launch more programs).
_SUM_BLOCK_PARTIALS = 16
_SUM_BLOCK_ELEMENTS = 128
_SUM_MIN_ELEMENTS = 32
#: Gradient mode of kernels/add_act.py for a per-channel bias (see its docstring).
CHAN = codes.CHAN
#: Backward programs per SM on a GPU, by num_warps. Each program loops over its
#: rows with one tile of loads in flight: 4 programs of 4 warps per SM (the
#: reduction target of tfuse._launch) measured 76-84% of copy bandwidth on an
#: H100 (gelu, silu bf16 16384^2), 8 per SM 86-95%. 7 is what a 4-warp program
#: of up to 73 registers (the kernel takes 45-72) keeps resident on every SM,
#: so all of them run in one wave, without a tail; the 8-warp per-channel
#: kernel (about 75 registers) keeps 3.
_GPU_BWD_PROGRAMS_PER_SM = {4: 7, 8: 3}
#: Widest column block of the backward (lanes); 8 warps above TILE_ELEMENTS.
_MAX_BWD_BLOCK_COLS = 2 * TILE_ELEMENTS


def grad_slots(
    out_shape: Sequence[int], input_meta: Sequence[tuple[Sequence[int], torch.dtype]], needed: Sequence[bool]
) -> list[list[int]]:
    """The inputs each gradient buffer of the backward serves: full-size inputs of one dtype share one
    buffer (their gradients are equal), every broadcast input gets its own."""
    slots: list[list[int]] = []
    full_size: dict[torch.dtype, int] = {}
    for index, ((shape, dtype), need) in enumerate(zip(input_meta, needed)):
        if not need:
            continue
        if tuple(shape) == tuple(out_shape):
            if dtype not in full_size:
                full_size[dtype] = len(slots)
                slots.append([])
            slots[full_size[dtype]].append(index)
        else:
            slots.append([index])
    return slots


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    """Everything the backward launches need that depends on layouts only (cached per layout).

    slots: per gradient buffer (shape, strides, dtype, input indices it serves).
    n_partials: per slot, the partial rows of its float32 reduction (None for LINEAR).
    reduced: indices of the slots that need the second stage.
    static_args: the backward kernel's arguments after grad_ptrs, up to negative_slope.
    """

    slots: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, tuple[int, ...]], ...]
    n_partials: tuple[int | None, ...]
    reduced: tuple[int, ...]
    acc_dtype: torch.dtype
    dy_strides: tuple[int, ...]
    src_strides: tuple[tuple[int, ...], ...]
    static_args: tuple
    grid: tuple[int, int]
    meta: dict
    sum_grid: tuple[int]
    sum_meta: dict


@functools.lru_cache(maxsize=1024)
def _backward_plan(
    out_shape: tuple[int, ...],
    out_strides: tuple[int, ...],
    input_meta: tuple[tuple[torch.Size, torch.dtype], ...],
    needed: tuple[bool, ...],
    dy_layout: tuple[tuple[int, ...], tuple[int, ...], torch.dtype],
    src_layouts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
    act_code: int,
    from_output: bool,
    sms: int | None,
    programs: int,
    interpreted: bool,
) -> _BackwardPlan:
    # One gradient buffer per slot (grad_slots: full-size inputs of one dtype share one).
    slots = []
    for indices in grad_slots(out_shape, input_meta, needed):
        shape, dtype = input_meta[indices[0]]
        if tuple(shape) == out_shape:
            slots.append((out_shape, out_strides, dtype, indices))
        else:
            slots.append((tuple(shape), reduced_grad_strides(shape, out_shape, out_strides), dtype, indices))

    n_src = len(src_layouts)
    layouts = [dy_layout[:2], *src_layouts, *((shape, strides) for shape, strides, _, _ in slots)]
    plan = plan_layouts(out_shape, out_strides, layouts, max_col_rank=None)
    grad_modes = _grad_modes(plan, n_src)
    if grad_modes is None:  # a reduction the wide columns cannot serve: one column dimension
        plan = plan_layouts(out_shape, out_strides, layouts, max_col_rank=1)
        grad_modes = plan.modes[1 + n_src :]
    grad_strides = plan.merged_strides[1 + n_src :]
    block_rows, block_cols, block_width = _backward_blocks(plan, CHAN in grad_modes)

    n_col_blocks = -(-plan.n_cols // block_width)
    row_chunks = -(-plan.n_rows // block_rows)
    warps = num_warps(block_rows * block_cols, ELEMENTS_PER_THREAD)
    if sms is not None:
        # All programs resident at once (one wave, no tail): see _GPU_BWD_PROGRAMS_PER_SM.
        programs = sms * _GPU_BWD_PROGRAMS_PER_SM[warps]
    groups = min(row_chunks, max(1, programs // n_col_blocks))
    rows_per_group = -(-row_chunks // groups) * block_rows
    groups = -(-plan.n_rows // rows_per_group)

    acc = acc_dtype(dy_layout[2], *(dtype for _, _, dtype, _ in slots))
    n_partials, red_strides, numels, n_bcasts = [], [], [], []
    largest_partial = 0
    for (shape, _, _, _), mode, strides in zip(slots, grad_modes, grad_strides):
        red, n_bcast = _broadcast_row_strides(plan, strides)
        numel = math.prod(shape)
        if mode == LINEAR:
            count = None
        elif mode in (COL, CHAN):
            count = groups
        elif mode == SCALAR:
            count = groups * n_col_blocks
        elif mode == ROW:
            count = n_col_blocks * n_bcast
        else:  # STRIDED: dz itself, per broadcast coordinate
            count = n_bcast
        if count is not None:
            largest_partial = max(largest_partial, count * numel)
        n_partials.append(count)
        red_strides.append(red)
        numels.append(numel)
        n_bcasts.append(n_bcast)

    meta = dict(
        DY_MODE=plan.modes[0],
        N_SRC=n_src,
        SRC_MODES=plan.modes[1 : 1 + n_src],
        FROM_OUTPUT=from_output,
        N_GRADS=len(slots),
        GRAD_MODES=grad_modes,
        OUTER_RANK=len(plan.outer_sizes),
        COL_RANK=plan.col_rank,
        ACT=act_code,
        MATH=math_mode(acc, interpreted),
        INDEX_64=plan.index_64 or needs_int64(largest_partial),
        ACC_FP64=acc_fp64(acc),
        EMULATE_BF16_RTNE=emulate_bf16_rtne(),
        ONE_ROW=plan.n_rows == 1,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        PIXELS_POW2=next_power_of_2(plan.col_sizes[-1]) if CHAN in grad_modes else 1,
        num_warps=warps,
    )
    reduced = tuple(i for i, count in enumerate(n_partials) if count is not None)
    largest = max((numels[i] for i in reduced), default=1)
    sum_elements = _SUM_BLOCK_ELEMENTS
    while sum_elements > _SUM_MIN_ELEMENTS and -(-largest // sum_elements) < programs:
        sum_elements //= 2
    return _BackwardPlan(
        slots=tuple((shape, strides, dtype, tuple(indices)) for shape, strides, dtype, indices in slots),
        n_partials=tuple(n_partials),
        reduced=reduced,
        acc_dtype=acc,
        dy_strides=plan.in_strides[0],
        src_strides=plan.in_strides[1 : 1 + n_src],
        static_args=(
            grad_strides,
            tuple(red_strides),
            tuple(numels),
            tuple(n_bcasts),
            plan.outer_sizes,
            plan.col_divs,
            plan.n_rows,
            plan.n_cols,
            rows_per_group,
            block_width,
        ),
        grid=(n_col_blocks, groups),
        meta=meta,
        sum_grid=(-(-largest // sum_elements),),
        sum_meta=dict(
            N=len(reduced),
            INDEX_64=needs_int64(largest_partial),
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            BLOCK_PARTIALS=_SUM_BLOCK_PARTIALS,
            BLOCK_ELEMENTS=sum_elements,
            num_warps=NUM_WARPS,
        ),
    )


def _grad_modes(plan: TilePlan, n_src: int) -> tuple[int, ...] | None:
    """The gradient slots' modes for the backward kernel, or None if a reduction does not fit ``plan``.

    With one column dimension every mode works. With wide columns a reduced
    gradient must not fold distinct columns onto one element, except a
    per-channel gradient of two column dimensions (channel, pixel) whose
    pixel stride is 0 (mode CHAN: whole channels per column block).
    """
    modes = plan.modes[1 + n_src :]
    if plan.col_rank == 1:
        return modes
    outer_rank = len(plan.outer_sizes)
    result = []
    for mode, strides in zip(modes, plan.merged_strides[1 + n_src :]):
        col_strides = strides[outer_rank:]
        if mode in (COL, STRIDED) and 0 in col_strides:
            if mode == COL and plan.col_rank == 2 and col_strides[0] != 0 and plan.col_sizes[1] <= _MAX_BWD_BLOCK_COLS:
                mode = CHAN
            else:
                return None
        result.append(mode)
    return tuple(result)


def _backward_blocks(plan: TilePlan, per_channel: bool) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, block_width) of the backward.

    A per-channel (CHAN) gradient needs column blocks of whole channels: the
    most channels whose pixels fit BLOCK_COLS lanes and keep block starts
    16-element aligned, on 2048 or 4096 lanes, whichever wastes fewer.
    """
    if not per_channel or plan.n_cols <= plan.block_cols:
        return plan.block_rows, plan.block_cols, plan.block_cols
    pixels = plan.col_sizes[1]
    step = COL_ALIGN // math.gcd(pixels, COL_ALIGN)  # channels per aligned block start
    best = None
    for lanes in (TILE_ELEMENTS, _MAX_BWD_BLOCK_COLS):
        channels = (lanes // pixels) // step * step or lanes // pixels
        if channels and (best is None or channels * pixels / lanes > best[1] * 1.1):
            best = (lanes, channels * pixels / lanes, channels * pixels)
    assert best is not None
    return 1, best[0], best[2]


def _broadcast_row_strides(plan: TilePlan, strides: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Strides over the merged outer dims that index the broadcast coordinates of an operand.

    Outer dims where the operand's stride is 0 get contiguous strides (innermost
    first); the others 0. Returns those strides (plus a trailing 0 for the
    column dim) and the number of broadcast coordinates.
    """
    red = [0] * (len(plan.outer_sizes) + 1)
    running = 1
    for dim in range(len(plan.outer_sizes) - 1, -1, -1):
        if strides[dim] == 0:
            red[dim] = running
            running *= plan.outer_sizes[dim]
    return tuple(red), running
