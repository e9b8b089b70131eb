"""Fused batch norm (+ residual) + activation: statistics, normalise, backward.

Every full-size operand (x, residual, y, dy, dx, d(residual)) shares one dense
layout, so the input is a matrix of ``n_rows`` rows of ``n_cols`` contiguous
elements, and the channel of column ``col`` is ``col // SS``:

- NCHW (contiguous): a row is one sample, ``n_cols = C * S``, ``SS = S``;
- channels_last (and ``[N, C]``): a row is one pixel, ``n_cols = C``, ``SS = 1``
  (Triton turns the division by a 1 into nothing).

Columns are walked in the memory order and indexed 1-D, so loads and stores
stay 128-bit wide whatever S is (49, 196, ...) as long as the data allows it:
the constexpr ``VEC`` is the alignment, in elements, that the launcher proved
for row starts, column windows and their ends, handed to the compiler with
``tl.multiple_of``.

Reductions (statistics, backward sums) split the columns into groups of ``GW``
columns (whole channels: ``CB`` channels of S columns each for NCHW, or one
channel in pieces of BL when S is long; BL channels for channels_last) and the
rows into chunks; one program per (group, chunk), as many programs as fit on
the device at once. Each lane keeps its own running sums in registers over the
whole chunk (a lane always sees the same channel) and the program reduces them
once at the end, per channel: ``SEG`` says how (LANE: a column is a channel;
ONE: the window is one channel; PACKED: CB channels of S lanes each, gathered
into [channels, S_PAD] tiles through shared memory). No barrier runs inside
the loops.

Merging the chunk partials takes no launch of its own: the last programs to
finish merge them ("last program merges", the semaphore of split-K matmuls),
in two levels. Each program stores its partials, then adds 1 to its chunk
block's arrival counter (an int32; an atomic with acq_rel semantics at GPU
scope, after a CTA barrier so that every thread's stores precede the
release). The program that reads back ``arrivals - 1`` has seen every other
program of its block arrive, so their partials are visible to it (it reads
them after the acquire, at L2); it merges the block's chunks into the
block's partial, then arrives the same way at its column group's counter,
where the last block merger merges the blocks and writes the group's
channels of the table (and running statistics, or the gradients and dx
coefficients). Each level merges in a fixed order (chunk by chunk, block by
block, whatever order the programs finished in), so results are
deterministic; a group's blocks are ``chunks_per_block`` chunks, which the
launcher picks so that both levels take few steps (a channels_last group
can have a thousand chunks, too many for one program to merge quickly;
small grids have one block, and merging one block is exact). The last
arrival puts each counter back to 0, so the counters need no clearing
between launches (nor between CUDA graph replays). The merges are
predicated, not branched around, and read nothing in the programs that are
not last. The grid stays one wave with no redundant work: the merges read
each chunk partial once, as a separate merge kernel did, and the block
partials once more. The launcher keeps the counters
(``tfuse/ops/batch_norm.py``).

Numerics: statistics are shifted sums (each channel's values minus its first
value in the chunk, or the mean of its first row piece when one channel fills
the program, so a channel with mean 1000 and std 1 sums numbers of size 1),
merged across chunks (and blocks of chunks) with Chan's formula around the
first one's mean.

Training forward (2 launches): statistics (partials, merged by each group's
last program into the per-channel table [mean, 1/std, scale = weight/std,
bias] + the running statistics update) -> normalise + residual + activation.
Eval forward: the last pass alone, reading the running statistics. Backward
(training, 2 launches with dx): sums of dy' = dy * act'(.) and dy' * x_hat
(writing d(residual) = dy' on the way), merged by each group's last program
into d(weight), d(bias) and the dx coefficients [mean, scale, bias, scale *
mean(dy'), scale / std * mean(dy' x_hat)] -> dx (from dy' read back when
d(residual) was written). Without dx the first pass is the whole backward;
in eval it writes dx and d(residual) itself.
"""

import triton
import triton.language as tl

from . import codes
from .activations import _act, _act_backward, _act_backward_from_output
from .bn_merge import (
    _bn_arrive,
    _bn_bwd_finish,
    _bn_chan_merge,
    _bn_group_channels,
    _bn_merge_block,
    _bn_only_if,
    _bn_stats_finish,
    _bn_sum_merge,
    _finite_or_zero,
)
from .cast import _cast_to
from .kit import _acc_dtype, _float_arg

# How a reduction program turns its per-lane sums into per-channel sums.
SEG_LANE = tl.constexpr(codes.SEG_LANE)  # column == channel (channels_last)
SEG_ONE = tl.constexpr(codes.SEG_ONE)  # the program's columns are all one channel (NCHW, long rows)
SEG_PACKED = tl.constexpr(codes.SEG_PACKED)  # CB whole channels of SS columns each (NCHW, short rows)


@triton.jit
def _bn_group_window(g, n_cols, GW, VEC: tl.constexpr):
    """First and past-the-end column of column group ``g`` (both multiples of VEC)."""
    start = tl.multiple_of(g * GW, VEC)
    end = tl.multiple_of(tl.minimum(start + GW, n_cols), VEC)
    return start, end


@triton.jit
def _bn_columns(n_cols, BL: tl.constexpr, VEC: tl.constexpr):
    """Columns of this program's block (program axis 0) and their mask.

    The bound is computed (min of the block's end and n_cols), not n_cols
    itself: a hint on a kernel argument would not reach the compiler.
    """
    start = tl.program_id(0) * BL
    end = tl.multiple_of(tl.minimum(start + BL, n_cols), VEC)
    cols = start + tl.arange(0, BL)
    return cols, cols < end


@triton.jit
def _bn_rows(row, n_cols, BN: tl.constexpr, VEC: tl.constexpr, INDEX_64: tl.constexpr):
    """Rows ``row .. row + BN`` and their offsets (multiples of VEC)."""
    rows = row + tl.arange(0, BN)
    if INDEX_64:
        rows = rows.to(tl.int64)
    return rows, tl.multiple_of(rows * n_cols, VEC)


@triton.jit
def _bn_chunk(n_rows, rows_per_chunk, INDEX_64: tl.constexpr):
    """Row range of this program's chunk (program axis 1)."""
    chunk = tl.program_id(1)
    if INDEX_64:
        chunk = chunk.to(tl.int64)
    row_begin = chunk * rows_per_chunk
    return row_begin, tl.minimum(row_begin + rows_per_chunk, n_rows)


@triton.jit
def _bn_lane_params(
    p_ptr, var_ptr, weight_ptr, bias_ptr, channels, mask, C, eps,
    FROM_RUNNING: tl.constexpr, AFFINE: tl.constexpr, acc: tl.constexpr,
):
    """Per-lane mean, 1/std, scale (= weight/std) and bias, in ``acc``.

    Batch statistics: p_ptr is the [4, C] table the statistics kernel wrote.
    FROM_RUNNING: p_ptr/var_ptr are the running mean and variance, with
    weight and bias (1 and 0 without AFFINE).
    """
    if FROM_RUNNING:
        mean = tl.load(p_ptr + channels, mask=mask, other=0.0).to(acc)
        var = tl.load(var_ptr + channels, mask=mask, other=1.0).to(acc)
        invstd = 1.0 / tl.sqrt(var + eps)
        if AFFINE:
            weight = tl.load(weight_ptr + channels, mask=mask, other=0.0).to(acc)
            bias = tl.load(bias_ptr + channels, mask=mask, other=0.0).to(acc)
            scale = invstd * weight
        else:
            scale = invstd
            bias = tl.zeros_like(mean)
    else:
        mean = tl.load(p_ptr + channels, mask=mask, other=0.0).to(acc)
        invstd = tl.load(p_ptr + C + channels, mask=mask, other=0.0).to(acc)
        scale = tl.load(p_ptr + 2 * C + channels, mask=mask, other=0.0).to(acc)
        bias = tl.load(p_ptr + 3 * C + channels, mask=mask, other=0.0).to(acc)
    return mean, invstd, scale, bias


@triton.jit
def _bn_segment_sums(
    a, b, start, end, SS, part: tl.constexpr, SEG: tl.constexpr, BL: tl.constexpr,
    CB_PART: tl.constexpr, S_PAD: tl.constexpr,
):
    """Per-channel sums of the per-lane sums ``a`` and ``b`` ([BL]) of one column window.

    Returns (channels, channel mask, sums of a, sums of b), vectors for LANE
    and PACKED, scalars for ONE. PACKED: channel k owns lanes k * SS ..
    k * SS + SS - 1; channels ``part * CB_PART ..`` of the window are gathered
    into a [CB_PART, S_PAD] tile (one round trip through shared memory) and
    summed along the rows. Parts keep the gathered tile at most BL elements.
    """
    if SEG == SEG_LANE:
        channels = start + tl.arange(0, BL)
        return channels, channels < end, a, b
    elif SEG == SEG_ONE:
        return start // SS, start < end, tl.sum(a, axis=0), tl.sum(b, axis=0)
    else:
        n_channels = (end - start) // SS
        index = tl.arange(0, CB_PART * S_PAD)
        k = part * CB_PART + index // S_PAD
        s = index % S_PAD
        valid = (s < SS) & (k < n_channels)
        source = tl.where(valid, k * SS + s, 0)
        a_sums = tl.sum(tl.reshape(tl.where(valid, tl.gather(a, source, 0), 0.0), [CB_PART, S_PAD]), axis=1)
        b_sums = tl.sum(tl.reshape(tl.where(valid, tl.gather(b, source, 0), 0.0), [CB_PART, S_PAD]), axis=1)
        local = part * CB_PART + tl.arange(0, CB_PART)
        return start // SS + local, local < n_channels, a_sums, b_sums


@triton.jit(do_not_specialize=["n_rows", "n_cols", "GW", "rows_per_chunk", "chunks_per_block"])
def _bn_stats_partial_kernel(
    x_ptr, buf_ptr, running_mean_ptr, running_var_ptr, weight_ptr, bias_ptr, counter_ptr,
    n_rows, n_cols, SS, GW, rows_per_chunk, chunks_per_block, eps, eps_lo, momentum, momentum_lo,
    UPDATE_RUNNING: tl.constexpr, AFFINE: tl.constexpr,
    SEG: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr, VEC: tl.constexpr,
    PARTS: tl.constexpr, CB_PART: tl.constexpr, S_PAD: tl.constexpr, MK: tl.constexpr, MC: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
):
    """Mean and M2 (sum of squared deviations) per channel of one (column group, row chunk), merged in
    two levels by the last programs to arrive: of each block of ``chunks_per_block`` chunks, then of the group.

    buf: [the table [4, C] | chunk means [n_chunks, C] | chunk M2 [n_chunks, C] | block means [n_blocks, C]
    | block M2 [n_blocks, C]]. The group's last program writes the table and the running statistics
    (:func:`_bn_stats_finish`). counter_ptr: int32 [groups + groups * n_blocks] (a group's counter, then
    each group's block counters), 0 at launch, left 0.
    """
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    C = n_cols // SS
    start, end = _bn_group_window(tl.program_id(0), n_cols, GW, VEC)
    row_begin, row_end = _bn_chunk(n_rows, rows_per_chunk, INDEX_64)
    lanes = tl.arange(0, BL)
    # Shift: values of each channel near its mean, subtracted before summing,
    # read from the chunk's first row with the same 128-bit loads as the loop.
    cols = start + lanes
    first_offset = tl.multiple_of(row_begin * n_cols, VEC)
    if SEG == SEG_PACKED:  # each channel's first value, spread over its lanes
        first_row = _finite_or_zero(tl.load(x_ptr + first_offset + cols, mask=cols < end, other=0.0).to(acc))
        shift = tl.gather(first_row, (lanes // SS) * SS, 0)[None, :]
    else:  # the row broadcast over the tile's BN rows (its own layout, no shuffle; the repeats hit in cache)
        same_row = tl.zeros([BN], tl.int32)[:, None]
        first = tl.load(x_ptr + first_offset + same_row + cols[None, :],
                        mask=(same_row == 0) & (cols < end)[None, :], other=0.0).to(acc)
        first = _finite_or_zero(first)
        if SEG == SEG_LANE:  # each column a channel: its first value
            shift = first
        else:  # one channel: the mean of its first row's first piece
            shift = tl.sum(tl.sum(first, axis=1), axis=0) / (BN * tl.minimum(end - start, BL)).to(acc)
    sum1 = tl.zeros([BN, BL], acc)
    sum2 = tl.zeros([BN, BL], acc)
    # Two row blocks per step: twice the bytes in flight for the same accumulators.
    for row in range(row_begin, row_end, 2 * BN):
        rows_a, offsets_a = _bn_rows(row, n_cols, BN, VEC, INDEX_64)
        rows_b, offsets_b = _bn_rows(row + BN, n_cols, BN, VEC, INDEX_64)
        for piece in range(start, end, BL):
            cols = tl.multiple_of(piece, VEC) + lanes
            col_mask = (cols < end)[None, :]
            mask_a = (rows_a < row_end)[:, None] & col_mask
            mask_b = (rows_b < row_end)[:, None] & col_mask
            x_a = tl.load(x_ptr + offsets_a[:, None] + cols[None, :], mask=mask_a, other=0.0).to(acc)
            x_b = tl.load(x_ptr + offsets_b[:, None] + cols[None, :], mask=mask_b, other=0.0).to(acc)
            d_a = tl.where(mask_a, x_a - shift, 0.0)
            d_b = tl.where(mask_b, x_b - shift, 0.0)
            sum1 += d_a + d_b
            sum2 += d_a * d_a + d_b * d_b
    s1_lanes = tl.sum(sum1, axis=0)
    s2_lanes = tl.sum(sum2, axis=0)
    count = (row_end - row_begin).to(acc) * SS
    out = buf_ptr + 4 * C + tl.program_id(1) * C
    for part in tl.static_range(PARTS):
        channels, channel_mask, s1, s2 = _bn_segment_sums(
            s1_lanes, s2_lanes, start, end, SS, part, SEG, BL, CB_PART, S_PAD
        )
        if SEG == SEG_LANE:
            channel_shift = tl.max(shift, axis=0)  # every row holds the same
        elif SEG == SEG_ONE:
            channel_shift = shift
        else:
            channel_shift = tl.gather(first_row, tl.minimum((channels - start // SS) * SS, BL - 1), 0)
        mean = channel_shift + s1 / count
        # The clamp keeps a NaN (a NaN input makes the variance NaN, as torch's); maximum alone would drop it.
        m2 = tl.maximum(s2 - s1 * (s1 / count), 0.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out + channels, mean, mask=channel_mask)
        tl.store(out + tl.num_programs(1) * C + channels, m2, mask=channel_mask)
    # The merges, predicated rather than branched on (a branch around them cost spills in some kernels).
    n_chunks = tl.num_programs(1)
    block, block_first, block_chunks, n_blocks = _bn_merge_block(n_chunks, chunks_per_block)
    group, group_mask = _bn_group_channels(start, end, SS, MC)
    g = tl.program_id(0)
    chunk_means = buf_ptr + 4 * C
    block_means = chunk_means + 2 * n_chunks * C
    # Level 1: the block's last program merges its chunks into the block's mean and M2.
    last = _bn_arrive(counter_ptr + tl.num_programs(0) + g * n_blocks + block, block_chunks, block >= 0)
    mean, m2, _ = _bn_chan_merge(
        chunk_means, chunk_means + n_chunks * C, block_first, block_chunks, rows_per_chunk, n_rows, SS,
        group, group_mask, C, last, MK, MC, acc,
    )
    tl.store(block_means + block * C + group, mean, mask=_bn_only_if(group_mask, last))
    tl.store(block_means + (n_blocks + block) * C + group, m2, mask=_bn_only_if(group_mask, last))
    # Level 2: the group's last block merger merges the blocks: the table and the running statistics.
    last = _bn_arrive(counter_ptr + g, n_blocks, last)
    mean, m2, total = _bn_chan_merge(
        block_means, block_means + n_blocks * C, 0, n_blocks, rows_per_chunk * chunks_per_block, n_rows, SS,
        group, group_mask, C, last, MK, MC, acc,
    )
    _bn_stats_finish(
        buf_ptr, running_mean_ptr, running_var_ptr, weight_ptr, bias_ptr, group, _bn_only_if(group_mask, last), C,
        mean, m2, total, _float_arg(eps, eps_lo, ACC_FP64), _float_arg(momentum, momentum_lo, ACC_FP64),
        UPDATE_RUNNING, AFFINE, acc,
    )


@triton.jit(do_not_specialize=["n_rows", "n_cols", "rows_per_chunk"])
def _bn_act_fwd_kernel(
    x_ptr, res_ptr, y_ptr, p_ptr, var_ptr, weight_ptr, bias_ptr,
    n_rows, n_cols, SS, rows_per_chunk, eps, eps_lo, negative_slope, negative_slope_lo,
    HAS_RESIDUAL: tl.constexpr, FROM_RUNNING: tl.constexpr, AFFINE: tl.constexpr, ACT: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, INDEX_64: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr,
    VEC: tl.constexpr, ACC_FP64: tl.constexpr,
):
    """y = act((x - mean) * scale + bias + residual) over BL columns x one row chunk.

    The per-channel values are gathered once per lane, then reused down the rows.
    """
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    eps = _float_arg(eps, eps_lo, ACC_FP64)
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    cols, col_mask = _bn_columns(n_cols, BL, VEC)
    mean, _invstd, scale, bias = _bn_lane_params(
        p_ptr, var_ptr, weight_ptr, bias_ptr, cols // SS, col_mask, n_cols // SS, eps, FROM_RUNNING, AFFINE, acc
    )
    row_begin, row_end = _bn_chunk(n_rows, rows_per_chunk, INDEX_64)
    for row in range(row_begin, row_end, BN):
        rows, row_offsets = _bn_rows(row, n_cols, BN, VEC, INDEX_64)
        offsets = row_offsets[:, None] + cols[None, :]
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        # (x - mean) first: exact for x near the mean, where x * scale - mean * scale would cancel.
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc)
        z = (x - mean[None, :]) * scale[None, :] + bias[None, :]
        if HAS_RESIDUAL:
            z += tl.load(res_ptr + offsets, mask=mask, other=0.0).to(acc)
        y = _act(z, ACT, negative_slope)
        tl.store(y_ptr + offsets, _cast_to(y, y_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _bn_act_grad_out(
    dy_ptr, src_ptr, x_ptr, offsets, mask, mean, scale, bias, negative_slope,
    HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr, ACT: tl.constexpr, acc: tl.constexpr,
):
    """dz = dy * act'(.) over a tile (0 off the mask), and x - mean.

    src is the saved output y (FROM_OUTPUT: act' follows from it), else the
    residual (with HAS_RESIDUAL) to recompute the pre-activation.
    """
    xc = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc) - mean[None, :]
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(acc)
    if FROM_OUTPUT:
        y = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(acc)
        dz = _act_backward_from_output(dy, y, ACT, negative_slope)
    else:
        z = xc * scale[None, :] + bias[None, :]
        if HAS_RESIDUAL:
            z += tl.load(src_ptr + offsets, mask=mask, other=0.0).to(acc)
        dz = _act_backward(dy, z, ACT, negative_slope)
    return tl.where(mask, dz, 0.0), xc


@triton.jit(do_not_specialize=["n_rows", "n_cols", "GW", "rows_per_chunk", "chunks_per_block"])
def _bn_act_bwd_reduce_kernel(
    dy_ptr, src_ptr, x_ptr, p_ptr, var_ptr, weight_ptr, bias_ptr, buf_ptr, dx_ptr, dres_ptr,
    dweight_ptr, dbias_ptr, counter_ptr,
    n_rows, n_cols, SS, GW, rows_per_chunk, chunks_per_block, eps, eps_lo, negative_slope, negative_slope_lo,
    HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr, FROM_RUNNING: tl.constexpr, AFFINE: tl.constexpr,
    ACT: tl.constexpr, WRITE_DX: tl.constexpr, WRITE_DRES: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
    MERGE: tl.constexpr, WRITE_DWEIGHT: tl.constexpr, WRITE_DBIAS: tl.constexpr, WRITE_COEF: tl.constexpr,
    SEG: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr, VEC: tl.constexpr,
    PARTS: tl.constexpr, CB_PART: tl.constexpr, S_PAD: tl.constexpr, MK: tl.constexpr, MC: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
):
    """Backward pass 1: per (column group, row chunk) sums of dy' and dy' * x_hat per channel; with MERGE,
    merged in two levels as the statistics are (:func:`_bn_stats_partial_kernel`), the group's last program
    writing d(weight), d(bias) and the dx coefficients (:func:`_bn_bwd_finish`).

    buf: [the dx table [5, C] | chunk sums of dy' [n_chunks, C] | of dy' x_hat [n_chunks, C] | block sums
    [n_blocks, C] each]. With running statistics (eval) dx = dy' * scale needs no sums, so
    WRITE_DX writes dx here and no second pass runs. WRITE_DRES writes
    d(residual) = dy' here in either mode (the dx pass then reads dy' back
    instead of dy and the saved tensor). counter_ptr (MERGE): as the statistics kernel's.
    """
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    eps = _float_arg(eps, eps_lo, ACC_FP64)
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    C = n_cols // SS
    start, end = _bn_group_window(tl.program_id(0), n_cols, GW, VEC)
    row_begin, row_end = _bn_chunk(n_rows, rows_per_chunk, INDEX_64)
    lanes = tl.arange(0, BL)
    cols = start + lanes
    mean, invstd, scale, bias = _bn_lane_params(
        p_ptr, var_ptr, weight_ptr, bias_ptr, cols // SS, cols < end, C, eps, FROM_RUNNING, AFFINE, acc
    )
    sum_dz = tl.zeros([BN, BL], acc)
    sum_dz_xc = tl.zeros([BN, BL], acc)
    for row in range(row_begin, row_end, BN):
        rows, row_offsets = _bn_rows(row, n_cols, BN, VEC, INDEX_64)
        row_mask = rows < row_end
        for piece in range(start, end, BL):
            cols = tl.multiple_of(piece, VEC) + lanes
            offsets = row_offsets[:, None] + cols[None, :]
            mask = row_mask[:, None] & (cols < end)[None, :]
            dz, xc = _bn_act_grad_out(
                dy_ptr, src_ptr, x_ptr, offsets, mask, mean, scale, bias, negative_slope,
                HAS_RESIDUAL, FROM_OUTPUT, ACT, acc,
            )
            sum_dz += dz
            sum_dz_xc += dz * xc
            if WRITE_DX:
                tl.store(dx_ptr + offsets, _cast_to(dz * scale[None, :], dx_ptr.dtype.element_ty, EMULATE_BF16_RTNE),
                         mask=mask)
            if WRITE_DRES:
                tl.store(dres_ptr + offsets, _cast_to(dz, dres_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    # sum dy' * x_hat = 1/std * sum dy' * (x - mean): 1/std is per lane, so it goes in once here
    # (read again rather than kept in registers through the loop).
    cols = start + lanes
    _, invstd, _, _ = _bn_lane_params(
        p_ptr, var_ptr, weight_ptr, bias_ptr, cols // SS, cols < end, C, eps, FROM_RUNNING, AFFINE, acc
    )
    dz_lanes = tl.sum(sum_dz, axis=0)
    dz_xhat_lanes = tl.sum(sum_dz_xc, axis=0) * invstd
    out = buf_ptr + 5 * C + tl.program_id(1) * C
    for part in tl.static_range(PARTS):
        channels, channel_mask, s_dz, s_dz_xhat = _bn_segment_sums(
            dz_lanes, dz_xhat_lanes, start, end, SS, part, SEG, BL, CB_PART, S_PAD
        )
        tl.store(out + channels, s_dz, mask=channel_mask)
        tl.store(out + tl.num_programs(1) * C + channels, s_dz_xhat, mask=channel_mask)
    if MERGE:  # predicated, as the statistics kernel's merges
        n_chunks = tl.num_programs(1)
        block, block_first, block_chunks, n_blocks = _bn_merge_block(n_chunks, chunks_per_block)
        group, group_mask = _bn_group_channels(start, end, SS, MC)
        g = tl.program_id(0)
        chunk_sums = buf_ptr + 5 * C
        block_sums = chunk_sums + 2 * n_chunks * C
        last = _bn_arrive(counter_ptr + tl.num_programs(0) + g * n_blocks + block, block_chunks, block >= 0)
        s_dz, s_dz_xhat = _bn_sum_merge(
            chunk_sums, chunk_sums + n_chunks * C, block_first, block_chunks, group, group_mask, C, last, MK, MC, acc
        )
        tl.store(block_sums + block * C + group, s_dz, mask=_bn_only_if(group_mask, last))
        tl.store(block_sums + (n_blocks + block) * C + group, s_dz_xhat, mask=_bn_only_if(group_mask, last))
        last = _bn_arrive(counter_ptr + g, n_blocks, last)
        s_dz, s_dz_xhat = _bn_sum_merge(
            block_sums, block_sums + n_blocks * C, 0, n_blocks, group, group_mask, C, last, MK, MC, acc
        )
        _bn_bwd_finish(
            buf_ptr, p_ptr, dweight_ptr, dbias_ptr, group, _bn_only_if(group_mask, last), C, s_dz, s_dz_xhat,
            n_rows.to(acc) * SS, WRITE_DWEIGHT, WRITE_DBIAS, WRITE_COEF,
        )


@triton.jit(do_not_specialize=["n_rows", "n_cols", "rows_per_chunk"])
def _bn_act_bwd_dx_kernel(
    dy_ptr, src_ptr, x_ptr, q_ptr, dx_ptr, dres_ptr,
    n_rows, n_cols, SS, rows_per_chunk, negative_slope, negative_slope_lo,
    HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr, FROM_DZ: tl.constexpr, ACT: tl.constexpr,
    WRITE_DX: tl.constexpr, WRITE_DRES: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
    INDEX_64: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr, VEC: tl.constexpr, ACC_FP64: tl.constexpr,
):
    """Backward pass 2 (batch statistics): dx = scale * (dy' - mean(dy') - x_hat * mean(dy' x_hat)).

    That is scale * dy' - a - (x - mean) * b with the per-channel a, b of the
    table q_ptr [mean, scale, bias, a, b] (written by the first pass's merge, _bn_bwd_finish).
    FROM_DZ: dy' is read from src_ptr, the d(residual) the first pass wrote
    (it is dy'), instead of being recomputed from dy and the saved tensor.
    """
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    cols, col_mask = _bn_columns(n_cols, BL, VEC)
    C = n_cols // SS
    channels = cols // SS
    mean = tl.load(q_ptr + channels, mask=col_mask, other=0.0).to(acc)
    scale = tl.load(q_ptr + C + channels, mask=col_mask, other=0.0).to(acc)
    if FROM_OUTPUT or FROM_DZ:
        bias = mean  # unused
    else:
        bias = tl.load(q_ptr + 2 * C + channels, mask=col_mask, other=0.0).to(acc)
    if WRITE_DX:
        a = tl.load(q_ptr + 3 * C + channels, mask=col_mask, other=0.0).to(acc)
        b = tl.load(q_ptr + 4 * C + channels, mask=col_mask, other=0.0).to(acc)
    row_begin, row_end = _bn_chunk(n_rows, rows_per_chunk, INDEX_64)
    for row in range(row_begin, row_end, BN):
        rows, row_offsets = _bn_rows(row, n_cols, BN, VEC, INDEX_64)
        offsets = row_offsets[:, None] + cols[None, :]
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        if FROM_DZ:
            dz = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(acc)
            xc = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc) - mean[None, :]
        else:
            dz, xc = _bn_act_grad_out(
                dy_ptr, src_ptr, x_ptr, offsets, mask, mean, scale, bias, negative_slope,
                HAS_RESIDUAL, FROM_OUTPUT, ACT, acc,
            )
        if WRITE_DX:
            dx = scale[None, :] * dz - a[None, :] - xc * b[None, :]
            tl.store(dx_ptr + offsets, _cast_to(dx, dx_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
        if WRITE_DRES:
            tl.store(dres_ptr + offsets, _cast_to(dz, dres_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
