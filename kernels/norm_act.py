"""Group norm and layer norm (+ residual) + activation: statistics, normalise, backward.

Both normalise *rows* (a row is one sample's group for group norm, one
token's features for layer norm) and scale each element by a per-channel
weight and bias, so one kernel family serves both. The launcher views x as
``[N, G, A, B]`` with the innermost dimension B contiguous: row ``r = n * G +
g`` starts at ``n * sN + g * sG`` and holds ``A`` runs of ``B`` elements,
``sA`` apart. The channel of element (a, b) is, by the constexpr ``CH``:

- ``CH_A``: ``g * A + a`` (group norm, NCHW: a run is one channel's H*W pixels);
- ``CH_B``: ``g * B + b`` (group norm, channels_last: a run is one pixel's
  group of channels; layer norm, G = A = 1: a run is the row, the channel its column).

Tiles are ``[BA, BB]`` (powers of two); loads and stores along B are contiguous.
B and the strides are specialised (not in ``do_not_specialize``): Triton
then knows when rows start 16-byte aligned and streams 128-bit accesses (the
sm_90 compile: every access was one element wide without it). Sums are
kept per lane in tiles and reduced across the program once, after the loops
(channels_last's d(weight) sums too: 12 barriers per tile down to none;
NCHW's, whose channel is a tile row, are reduced per tile, which kept its
backward at 64 registers where per-lane tiles took 80 and spilled in float32).

Forward: one program per (row, split). A row's A runs are split into ``S``
chunks of ``a_per`` runs when there are too few rows to fill the GPU (group
norm's few large groups); then a statistics kernel writes each chunk's mean
and M2 (shifted sums: each value minus the chunk's first, so a row with mean
1000 and std 1 sums numbers of size 1) and the normalise kernel merges a
row's chunks with Chan's formula, in chunk order (deterministic), before
normalising its own chunk: 2 launches. With one chunk per row the normalise
kernel computes the statistics itself: 1 launch, reading x twice (once when
the row fits one tile, ``ONE_TILE``: layer norm's usual rows).

Backward: dz = dy * act'(z) (z recomputed from x and the row's mean and
1/std, or act' read off the saved output), then with ``wdz = weight * dz``
and ``x_hat = (x - mean) / std`` over a row of L elements:

    dx = 1/std * (wdz - (sum(wdz) + x_hat * sum(wdz * x_hat)) / L)

The row sums need the whole row before any dx: one program per row (block)
computes them and then dx (a second pass over the row, none for ONE_TILE);
split rows write per-chunk sums and a dx kernel merges them (2 launches).
d(weight) and d(bias) are per-channel sums over rows of dz * x_hat and dz:
each program writes its channels' partial sums (group norm NCHW: a sample's
channels; channels_last: a chunk's; layer norm: a block of ``rows_per_prog``
rows, accumulated in registers) and the launcher sums the partials' rows.
d(residual) = dz.

Statistics and sums are float32 (float64 for float64 inputs); variance is
biased, as torch's group_norm and layer_norm.
"""

import triton
import triton.language as tl

from . import codes
from .activations import _act, _act_backward, _act_backward_from_output
from .bn_merge import _finite_or_zero
from .cast import _cast_to
from .kit import _acc_dtype, _float_arg

CH_A = tl.constexpr(codes.NORM_CH_A)
CH_B = tl.constexpr(codes.NORM_CH_B)


@triton.jit
def _na_row(r, G, sN, sG, INDEX_64: tl.constexpr):
    """(n, g, offset of row r's first element)."""
    if INDEX_64:
        r = r.to(tl.int64)
    n = r // G
    g = r - n * G
    return n, g, n * sN + g * sG


@triton.jit
def _na_chunk(A, a_per):
    """Runs [a_begin, a_end) of this program's chunk (program axis 1)."""
    a_begin = tl.program_id(1) * a_per
    return a_begin, tl.minimum(a_begin + a_per, A)


@triton.jit
def _na_tile(base, a0, a_end, b0, B, sA, BA: tl.constexpr, BB: tl.constexpr):
    """Runs a0 .. a0 + BA, columns b0 .. b0 + BB: (a, b, offsets, mask)."""
    a = a0 + tl.arange(0, BA)
    b = b0 + tl.arange(0, BB)
    mask = (a < a_end)[:, None] & (b < B)[None, :]
    return a, b, base + a[:, None] * sA + b[None, :], mask


@triton.jit
def _na_affine(w_ptr, bias_ptr, g, a, b, A, B, CH: tl.constexpr, AFFINE: tl.constexpr, acc: tl.constexpr):
    """Weight and bias of a tile's elements, broadcastable to [BA, BB] (1 and 0 without AFFINE)."""
    if CH == CH_A:
        channels = (g * A + a)[:, None]
        valid = (a < A)[:, None]
    else:
        channels = (g * B + b)[None, :]
        valid = (b < B)[None, :]
    if AFFINE:
        w = tl.load(w_ptr + channels, mask=valid, other=0.0).to(acc)
        bias = tl.load(bias_ptr + channels, mask=valid, other=0.0).to(acc)
    else:
        w = tl.full(channels.shape, 1.0, acc)
        bias = tl.zeros(channels.shape, acc)
    return w, bias


@triton.jit
def _na_moments(x_ptr, base, a_begin, a_end, B, sA, BA: tl.constexpr, BB: tl.constexpr, acc: tl.constexpr):
    """(mean, M2, count) of runs [a_begin, a_end) of a row: shifted sums around the chunk's first value."""
    shift = _finite_or_zero(tl.load(x_ptr + base + a_begin * sA).to(acc))
    s1 = tl.zeros([BA, BB], acc)
    s2 = tl.zeros([BA, BB], acc)
    for a0 in range(a_begin, a_end, BA):
        for b0 in range(0, B, BB):
            _, _, offsets, mask = _na_tile(base, a0, a_end, b0, B, sA, BA, BB)
            d = tl.where(mask, tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc) - shift, 0.0)
            s1 += d
            s2 += d * d
    t1 = tl.sum(tl.sum(s1, axis=1), axis=0)
    t2 = tl.sum(tl.sum(s2, axis=1), axis=0)
    count = ((a_end - a_begin) * B).to(acc)
    # The clamp keeps a NaN (a NaN input makes the variance NaN, as torch's); maximum alone would drop it.
    m2 = tl.maximum(t2 - t1 * (t1 / count), 0.0, propagate_nan=tl.PropagateNan.ALL)
    return shift + t1 / count, m2, count


@triton.jit
def _na_merged_moments(part_ptr, r, S, a_per, A, B, S_PAD: tl.constexpr, acc: tl.constexpr):
    """(mean, biased variance) of row r from its S chunks' (mean, M2), merged with Chan's formula."""
    k = tl.arange(0, S_PAD)
    valid = k < S
    means = tl.load(part_ptr + (r * S + k) * 2, mask=valid, other=0.0)
    m2s = tl.load(part_ptr + (r * S + k) * 2 + 1, mask=valid, other=0.0)
    counts = tl.where(valid, (tl.minimum(a_per, A - k * a_per) * B).to(acc), 0.0)
    total = tl.sum(counts, axis=0)
    mean = tl.sum(means * counts, axis=0) / total
    d = tl.where(valid, means - mean, 0.0)
    return mean, (tl.sum(m2s, axis=0) + tl.sum(counts * d * d, axis=0)) / total


@triton.jit(do_not_specialize=["G", "A", "a_per"])
def _na_stats_kernel(
    x_ptr, part_ptr, G, A, B, sN, sG, sA, a_per,
    BA: tl.constexpr, BB: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
):
    """Split rows: the (mean, M2) of one (row, chunk) into part[(row * S + chunk) * 2 + (0, 1)]."""
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    r = tl.program_id(0)
    _, _, base = _na_row(r, G, sN, sG, INDEX_64)
    a_begin, a_end = _na_chunk(A, a_per)
    mean, m2, _ = _na_moments(x_ptr, base, a_begin, a_end, B, sA, BA, BB, acc)
    out = part_ptr + (r * tl.num_programs(1) + tl.program_id(1)) * 2
    tl.store(out, mean)
    tl.store(out + 1, m2)


@triton.jit(do_not_specialize=["G", "A", "a_per"])
def _na_fwd_kernel(
    x_ptr, res_ptr, y_ptr, w_ptr, bias_ptr, part_ptr, mean_ptr, rstd_ptr,
    G, A, B, sN, sG, sA, a_per, eps, eps_lo, negative_slope, negative_slope_lo,
    CH: tl.constexpr, AFFINE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACT: tl.constexpr,
    SPLIT: tl.constexpr, S_PAD: tl.constexpr, ONE_TILE: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
):
    """y = act((x - mean) / std * weight + bias + residual) over one (row, chunk); writes the row's mean and
    1/std (for backward) from its first chunk's program.

    SPLIT: the row's statistics merged from the statistics kernel's chunk
    partials; otherwise (one chunk per row) computed here, from one tile held
    in registers (ONE_TILE) or a first pass over the row.
    """
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    eps = _float_arg(eps, eps_lo, ACC_FP64)
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    r = tl.program_id(0)
    _, g, base = _na_row(r, G, sN, sG, INDEX_64)
    a_begin, a_end = _na_chunk(A, a_per)
    if SPLIT:
        mean, var = _na_merged_moments(part_ptr, r, tl.num_programs(1), a_per, A, B, S_PAD, acc)
    elif ONE_TILE:
        a, b, offsets, mask = _na_tile(base, 0, A, 0, B, sA, BA, BB)
        x_tile = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc)
        count = (A * B).to(acc)
        mean = tl.sum(tl.sum(x_tile, axis=1), axis=0) / count
        d = tl.where(mask, x_tile - mean, 0.0)
        var = tl.sum(tl.sum(d * d, axis=1), axis=0) / count
    else:
        mean, m2, count = _na_moments(x_ptr, base, a_begin, a_end, B, sA, BA, BB, acc)
        var = m2 / count
    rstd = 1.0 / tl.sqrt(var + eps)
    first = tl.program_id(1) == 0
    tl.store(mean_ptr + r, mean, mask=first)
    tl.store(rstd_ptr + r, rstd, mask=first)
    for a0 in range(a_begin, a_end, BA):
        for b0 in range(0, B, BB):
            a, b, offsets, mask = _na_tile(base, a0, a_end, b0, B, sA, BA, BB)
            if not ONE_TILE:
                x_tile = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc)
            w, bias = _na_affine(w_ptr, bias_ptr, g, a, b, A, B, CH, AFFINE, acc)
            # (x - mean) first: exact for x near the mean, where x * scale - mean * scale would cancel.
            z = (x_tile - mean) * rstd * w + bias
            if HAS_RESIDUAL:
                z += tl.load(res_ptr + offsets, mask=mask, other=0.0).to(acc)
            y = _act(z, ACT, negative_slope)
            tl.store(y_ptr + offsets, _cast_to(y, y_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _na_grad_z(
    dy_ptr, src_ptr, x_ptr, offsets, mask, mean, rstd, w, bias, negative_slope,
    HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr, ACT: tl.constexpr, acc: tl.constexpr,
):
    """(dz = dy * act'(.), x_hat) over a tile, both 0 off the mask.

    src is the saved output y (FROM_OUTPUT: act' follows from it), else the
    residual (with HAS_RESIDUAL) to recompute the pre-activation.
    """
    x_hat = tl.where(mask, (tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc) - mean) * rstd, 0.0)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(acc)
    if FROM_OUTPUT:
        y = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(acc)
        dz = _act_backward_from_output(dy, y, ACT, negative_slope)
    else:
        z = x_hat * w + bias
        if HAS_RESIDUAL:
            z += tl.load(src_ptr + offsets, mask=mask, other=0.0).to(acc)
        dz = _act_backward(dy, z, ACT, negative_slope)
    return tl.where(mask, dz, 0.0), x_hat


@triton.jit
def _na_store_grads(
    dx_ptr, dres_ptr, offsets, mask, dz, wdz, x_hat, rstd, sum_wdz, sum_wdz_xhat, inv_count,
    WRITE_DX: tl.constexpr, WRITE_DRES: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
):
    """dx of a tile from its row's sums, and d(residual) = dz."""
    if WRITE_DX:
        dx = rstd * (wdz - (sum_wdz + x_hat * sum_wdz_xhat) * inv_count)
        tl.store(dx_ptr + offsets, _cast_to(dx, dx_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    if WRITE_DRES:
        tl.store(dres_ptr + offsets, _cast_to(dz, dres_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _na_dx_chunk(
    dy_ptr, src_ptr, x_ptr, w_ptr, bias_ptr, dx_ptr, dres_ptr, g, base, a_begin, a_end, A, B, sA, mean, rstd,
    sum_wdz, sum_wdz_xhat, inv_count, negative_slope,
    CH: tl.constexpr, AFFINE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr,
    ACT: tl.constexpr, WRITE_DX: tl.constexpr, WRITE_DRES: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    acc: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
):
    """The dx pass over runs [a_begin, a_end) of a row whose sums are known: dz recomputed tile by tile."""
    for a0 in range(a_begin, a_end, BA):
        for b0 in range(0, B, BB):
            a, b, offsets, mask = _na_tile(base, a0, a_end, b0, B, sA, BA, BB)
            w, bias = _na_affine(w_ptr, bias_ptr, g, a, b, A, B, CH, AFFINE, acc)
            dz, x_hat = _na_grad_z(
                dy_ptr, src_ptr, x_ptr, offsets, mask, mean, rstd, w, bias, negative_slope,
                HAS_RESIDUAL, FROM_OUTPUT, ACT, acc,
            )
            _na_store_grads(
                dx_ptr, dres_ptr, offsets, mask, dz, w * dz, x_hat, rstd, sum_wdz, sum_wdz_xhat, inv_count,
                WRITE_DX, WRITE_DRES, EMULATE_BF16_RTNE,
            )


@triton.jit(do_not_specialize=["R", "G", "A", "a_per", "rows_per_prog"])
def _na_bwd_kernel(
    dy_ptr, src_ptr, x_ptr, w_ptr, bias_ptr, mean_ptr, rstd_ptr, part_ptr, dw_part_ptr, db_part_ptr,
    dx_ptr, dres_ptr,
    R, G, A, B, sN, sG, sA, a_per, rows_per_prog, C, negative_slope, negative_slope_lo,
    CH: tl.constexpr, AFFINE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr,
    ACT: tl.constexpr, SPLIT: tl.constexpr, ONE_TILE: tl.constexpr, WRITE_DX: tl.constexpr,
    WRITE_DRES: tl.constexpr, WRITE_DWB: tl.constexpr, DWB_IN_MEMORY: tl.constexpr,
    BA: tl.constexpr, BB: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
):
    """Backward over rows [p * rows_per_prog, ...) x one chunk (program (p, chunk)).

    Per row: sums of wdz and wdz * x_hat over the chunk; SPLIT stores them in
    part[(row * S + chunk) * 2 + (0, 1)] for the dx kernel, otherwise a
    second pass (none with ONE_TILE) writes dx here. WRITE_DRES writes
    d(residual) = dz. WRITE_DWB: the channels' sums of dz * x_hat and dz go to
    row ``prow`` of dw_part/db_part (float32 rows ``C`` elements apart: the
    launcher interleaves the two, so one sum reduces both): CH_A, a sample's
    channels (prow = n, written once); CH_B, (prow = n * S + chunk), summed
    in registers over this program's rows when a run fits one tile (B <= BB),
    else added in memory (DWB_IN_MEMORY: the launcher zeroes the partials).
    """
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    p = tl.program_id(0)
    n_chunks = tl.num_programs(1)
    r_begin = p * rows_per_prog
    r_end = tl.minimum(r_begin + rows_per_prog, R)
    a_begin, a_end = _na_chunk(A, a_per)
    inv_count = 1.0 / (A * B).to(acc)
    col_w = tl.zeros([BA, BB], acc)  # CH_B in registers: the channels' sums over this program's rows, per lane
    col_b = tl.zeros([BA, BB], acc)
    # CH_B's partial row: one per (sample, chunk) for group norm (one row per program there), one per
    # program for layer norm (G == 1). Several groups of a sample share it (their channels differ).
    col_row = (p // G) * n_chunks + tl.program_id(1)
    for r in range(r_begin, r_end):
        n, g, base = _na_row(r, G, sN, sG, INDEX_64)
        mean = tl.load(mean_ptr + r).to(acc)
        rstd = tl.load(rstd_ptr + r).to(acc)
        prow = n if CH == CH_A else col_row
        sum_wdz = tl.zeros([BA, BB], acc)
        sum_wdz_xhat = tl.zeros([BA, BB], acc)
        for a0 in range(a_begin, a_end, BA):
            row_w = tl.zeros([BA], acc)  # CH_A: these runs' channels, summed along B (per tile: per-lane
            row_b = tl.zeros([BA], acc)  # tiles here took NCHW backward from 64 to 80 registers and spilled in fp32)
            for b0 in range(0, B, BB):
                a, b, offsets, mask = _na_tile(base, a0, a_end, b0, B, sA, BA, BB)
                w, bias = _na_affine(w_ptr, bias_ptr, g, a, b, A, B, CH, AFFINE, acc)
                dz, x_hat = _na_grad_z(
                    dy_ptr, src_ptr, x_ptr, offsets, mask, mean, rstd, w, bias, negative_slope,
                    HAS_RESIDUAL, FROM_OUTPUT, ACT, acc,
                )
                wdz = w * dz
                sum_wdz += wdz
                sum_wdz_xhat += wdz * x_hat
                if WRITE_DWB:
                    if CH == CH_A:
                        row_w += tl.sum(dz * x_hat, axis=1)
                        row_b += tl.sum(dz, axis=1)
                    elif DWB_IN_MEMORY:
                        cols = g * B + b
                        part_w = dw_part_ptr + prow * C + cols
                        part_b = db_part_ptr + prow * C + cols
                        tl.store(part_w, tl.load(part_w, mask=b < B, other=0.0) + tl.sum(dz * x_hat, axis=0),
                                 mask=b < B)
                        tl.store(part_b, tl.load(part_b, mask=b < B, other=0.0) + tl.sum(dz, axis=0), mask=b < B)
                    else:
                        col_w += dz * x_hat
                        col_b += dz
                if ONE_TILE and not SPLIT:
                    total = tl.sum(tl.sum(sum_wdz, axis=1), axis=0)
                    total_xhat = tl.sum(tl.sum(sum_wdz_xhat, axis=1), axis=0)
                    _na_store_grads(
                        dx_ptr, dres_ptr, offsets, mask, dz, wdz, x_hat, rstd, total, total_xhat, inv_count,
                        WRITE_DX, WRITE_DRES, EMULATE_BF16_RTNE,
                    )
                elif SPLIT and WRITE_DRES:
                    tl.store(dres_ptr + offsets, _cast_to(dz, dres_ptr.dtype.element_ty, EMULATE_BF16_RTNE),
                             mask=mask)
            if WRITE_DWB and CH == CH_A:
                runs = a0 + tl.arange(0, BA)
                tl.store(dw_part_ptr + prow * C + g * A + runs, row_w, mask=runs < a_end)
                tl.store(db_part_ptr + prow * C + g * A + runs, row_b, mask=runs < a_end)
        total = tl.sum(tl.sum(sum_wdz, axis=1), axis=0)
        total_xhat = tl.sum(tl.sum(sum_wdz_xhat, axis=1), axis=0)
        if SPLIT:
            out = part_ptr + (r * n_chunks + tl.program_id(1)) * 2
            tl.store(out, total)
            tl.store(out + 1, total_xhat)
        elif not ONE_TILE:
            _na_dx_chunk(
                dy_ptr, src_ptr, x_ptr, w_ptr, bias_ptr, dx_ptr, dres_ptr, g, base, a_begin, a_end, A, B, sA, mean,
                rstd, total, total_xhat, inv_count, negative_slope, CH, AFFINE, HAS_RESIDUAL, FROM_OUTPUT, ACT,
                WRITE_DX, WRITE_DRES, BA, BB, acc, EMULATE_BF16_RTNE,
            )
    if WRITE_DWB and CH == CH_B and not DWB_IN_MEMORY:
        b = tl.arange(0, BB)
        g_first = r_begin % G  # every row of the program has this group (G == 1, or one row per program)
        tl.store(dw_part_ptr + col_row * C + g_first * B + b, tl.sum(col_w, axis=0), mask=b < B)
        tl.store(db_part_ptr + col_row * C + g_first * B + b, tl.sum(col_b, axis=0), mask=b < B)


@triton.jit(do_not_specialize=["G", "A", "a_per"])
def _na_bwd_dx_kernel(
    dy_ptr, src_ptr, x_ptr, w_ptr, bias_ptr, mean_ptr, rstd_ptr, part_ptr, dx_ptr,
    G, A, B, sN, sG, sA, a_per, negative_slope, negative_slope_lo,
    CH: tl.constexpr, AFFINE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr,
    ACT: tl.constexpr, S_PAD: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
):
    """Split rows: dx over one (row, chunk), from the row's sums merged from its chunks' (in chunk order)."""
    acc: tl.constexpr = _acc_dtype(ACC_FP64)
    negative_slope = _float_arg(negative_slope, negative_slope_lo, ACC_FP64)
    r = tl.program_id(0)
    n_chunks = tl.num_programs(1)
    _, g, base = _na_row(r, G, sN, sG, INDEX_64)
    a_begin, a_end = _na_chunk(A, a_per)
    k = tl.arange(0, S_PAD)
    total = tl.sum(tl.load(part_ptr + (r * n_chunks + k) * 2, mask=k < n_chunks, other=0.0), axis=0)
    total_xhat = tl.sum(tl.load(part_ptr + (r * n_chunks + k) * 2 + 1, mask=k < n_chunks, other=0.0), axis=0)
    mean = tl.load(mean_ptr + r).to(acc)
    rstd = tl.load(rstd_ptr + r).to(acc)
    inv_count = 1.0 / (A * B).to(acc)
    _na_dx_chunk(
        dy_ptr, src_ptr, x_ptr, w_ptr, bias_ptr, dx_ptr, dx_ptr, g, base, a_begin, a_end, A, B, sA, mean, rstd,
        total, total_xhat, inv_count, negative_slope, CH, AFFINE, HAS_RESIDUAL, FROM_OUTPUT, ACT, True, False,
        BA, BB, acc, EMULATE_BF16_RTNE,
    )
