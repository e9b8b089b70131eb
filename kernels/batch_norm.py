"""Fused batch norm (+ residual) + activation: statistics, normalise, backward.

The input is viewed as ``[N, C, S]`` (S = the spatial elements; 1 for
``[N, C]``) through its strides, so NCHW and channels_last tensors are read in
place. Kernels work on tiles of BLOCK_R reduction rows (r = n * S + s) by
BLOCK_C channels; the launcher picks the tile shape so that loads run along
the memory-contiguous axis (rows for NCHW, channels for channels_last).

Training forward (3 launches): per-chunk Welford partials (count is implied,
mean and M2 stored) -> one small kernel merging them with Chan's formula into
mean / inverse std (and the running statistics update) -> one pass that
normalises, scales, shifts, adds the residual and applies the activation.
Eval forward: that last pass alone, reading the running statistics.

Backward (training): one pass reducing dy' = dy * act'(.) and dy' * x_hat per
channel into partials -> a small kernel producing d(weight), d(bias) and the
two per-channel means -> one pass writing dx (and d(residual)). In eval mode
the first pass writes dx and d(residual) itself: two launches.
"""

import triton
import triton.language as tl

from .activations import _act, _act_grad, _act_grad_from_output
from .cast import _cast_to


@triton.jit
def _bn_offsets(rows, channels, S, stride_n, stride_c, stride_s):
    """Memory offsets of rows (r = n * S + s) x channels."""
    n = rows // S
    s = rows - n * S
    return (n * stride_n + s * stride_s)[:, None] + (channels * stride_c)[None, :]


@triton.jit
def _bn_stats_partial_kernel(
    x_ptr, mean_ptr, m2_ptr,
    R, C, S, stride_n, stride_c, stride_s, rows_per_chunk,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INDEX_64: tl.constexpr,
 ACC_FP64: tl.constexpr,):
    """Mean and M2 (sum of squared deviations) of one chunk of rows, per channel."""
    if ACC_FP64:
        acc: tl.constexpr = tl.float64
    else:
        acc: tl.constexpr = tl.float32
    channel_block = tl.program_id(0)
    chunk = tl.program_id(1)
    if INDEX_64:
        chunk = chunk.to(tl.int64)
    channels = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < C
    count = tl.zeros([BLOCK_C], acc)
    mean = tl.zeros([BLOCK_C], acc)
    m2 = tl.zeros([BLOCK_C], acc)
    row_begin = chunk * rows_per_chunk
    row_end = tl.minimum(row_begin + rows_per_chunk, R)
    for row_start in range(row_begin, row_end, BLOCK_R):
        rows = row_start + tl.arange(0, BLOCK_R)
        row_mask = rows < row_end
        mask = row_mask[:, None] & channel_mask[None, :]
        x = tl.load(x_ptr + _bn_offsets(rows, channels, S, stride_n, stride_c, stride_s), mask=mask, other=0.0)
        x = x.to(acc)
        # Welford by tiles (Chan et al.): the tile's own mean and M2, then merged.
        # The tile is summed as deviations from its first row, so a channel
        # with mean 1000 and std 1 adds numbers of size 1, not 1000.
        tile_count = tl.sum(row_mask.to(acc), axis=0)
        shift = tl.sum(tl.where((rows == row_start)[:, None], x, 0.0), axis=0)
        shifted = tl.where(mask, x - shift[None, :], 0.0)
        tile_mean_shifted = tl.sum(shifted, axis=0) / tile_count
        tile_mean = shift + tile_mean_shifted
        deviation = tl.where(mask, shifted - tile_mean_shifted[None, :], 0.0)
        tile_m2 = tl.sum(deviation * deviation, axis=0)
        total = count + tile_count
        delta = tile_mean - mean
        mean += delta * (tile_count / total)
        m2 += tile_m2 + delta * delta * (count * tile_count / total)
        count = total
    tl.store(mean_ptr + chunk * C + channels, mean, mask=channel_mask)
    tl.store(m2_ptr + chunk * C + channels, m2, mask=channel_mask)


@triton.jit
def _bn_stats_final_kernel(
    mean_ptr, m2_ptr, save_mean_ptr, save_invstd_ptr, running_mean_ptr, running_var_ptr,
    R, C, rows_per_chunk, n_chunks, eps, momentum,
    UPDATE_RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
 ACC_FP64: tl.constexpr,):
    """Merges the chunk partials: batch mean and 1/sqrt(var + eps), and the running statistics.

    running_var gets the unbiased variance (M2 / (R - 1)), as torch's BatchNorm.
    """
    if ACC_FP64:
        acc: tl.constexpr = tl.float64
    else:
        acc: tl.constexpr = tl.float32
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < C
    count = tl.zeros([BLOCK_C], acc)
    mean = tl.zeros([BLOCK_C], acc)
    m2 = tl.zeros([BLOCK_C], acc)
    for chunk in range(0, n_chunks):
        chunk_count = tl.minimum(rows_per_chunk, R - chunk * rows_per_chunk).to(acc)
        chunk_mean = tl.load(mean_ptr + chunk * C + channels, mask=channel_mask, other=0.0)
        chunk_m2 = tl.load(m2_ptr + chunk * C + channels, mask=channel_mask, other=0.0)
        total = count + chunk_count
        delta = chunk_mean - mean
        mean += delta * (chunk_count / total)
        m2 += chunk_m2 + delta * delta * (count * chunk_count / total)
        count = total
    var = m2 / count
    tl.store(save_mean_ptr + channels, mean, mask=channel_mask)
    tl.store(save_invstd_ptr + channels, 1.0 / tl.sqrt(var + eps), mask=channel_mask)
    if UPDATE_RUNNING:
        unbiased = m2 / (count - 1.0)
        running_mean = tl.load(running_mean_ptr + channels, mask=channel_mask, other=0.0).to(acc)
        running_var = tl.load(running_var_ptr + channels, mask=channel_mask, other=0.0).to(acc)
        running_mean = running_mean * (1.0 - momentum) + mean * momentum
        running_var = running_var * (1.0 - momentum) + unbiased * momentum
        tl.store(running_mean_ptr + channels, running_mean.to(running_mean_ptr.dtype.element_ty), mask=channel_mask)
        tl.store(running_var_ptr + channels, running_var.to(running_var_ptr.dtype.element_ty), mask=channel_mask)


@triton.jit
def _bn_channel_params(
    mean_ptr, invstd_ptr, weight_ptr, bias_ptr, channels, channel_mask, eps,
    FROM_RUNNING: tl.constexpr, AFFINE: tl.constexpr, acc: tl.constexpr,
):
    """Per-channel mean, 1/std, weight and bias in ``acc`` (weight 1, bias 0 without AFFINE)."""
    mean = tl.load(mean_ptr + channels, mask=channel_mask, other=0.0).to(acc)
    if FROM_RUNNING:
        var = tl.load(invstd_ptr + channels, mask=channel_mask, other=1.0).to(acc)
        invstd = 1.0 / tl.sqrt(var + eps)
    else:
        invstd = tl.load(invstd_ptr + channels, mask=channel_mask, other=0.0).to(acc)
    if AFFINE:
        weight = tl.load(weight_ptr + channels, mask=channel_mask, other=0.0).to(acc)
        bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(acc)
    else:
        weight = tl.zeros_like(mean) + 1.0
        bias = tl.zeros_like(mean)
    return mean, invstd, weight, bias


@triton.jit
def _bn_tile(pid, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows, channels and masks of tile ``pid`` of a 1-D grid over (rows, channels)."""
    channel_blocks = tl.cdiv(C, BLOCK_C)
    rows = (pid // channel_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    channels = (pid % channel_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < C
    mask = (rows < R)[:, None] & channel_mask[None, :]
    return rows, channels, channel_mask, mask


@triton.jit
def _bn_act_fwd_kernel(
    x_ptr, res_ptr, y_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
    R, C, S, stride_n, stride_c, stride_s, res_stride_n, res_stride_c, res_stride_s, eps, negative_slope,
    HAS_RESIDUAL: tl.constexpr, FROM_RUNNING: tl.constexpr, AFFINE: tl.constexpr, ACT: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
 ACC_FP64: tl.constexpr,):
    """y = act((x - mean) * invstd * weight + bias + residual) for one tile; y has x's strides.

    With FROM_RUNNING, mean_ptr/invstd_ptr are the running mean and variance.
    """
    if ACC_FP64:
        acc: tl.constexpr = tl.float64
    else:
        acc: tl.constexpr = tl.float32
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    rows, channels, channel_mask, mask = _bn_tile(pid, R, C, BLOCK_R, BLOCK_C)
    mean, invstd, weight, bias = _bn_channel_params(
        mean_ptr, invstd_ptr, weight_ptr, bias_ptr, channels, channel_mask, eps, FROM_RUNNING, AFFINE, acc
    )
    scale = invstd * weight
    offsets = _bn_offsets(rows, channels, S, stride_n, stride_c, stride_s)
    # (x - mean) first: exact for x near the mean, where x * scale - mean * scale would cancel.
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc)
    z = (x - mean[None, :]) * scale[None, :] + bias[None, :]
    if HAS_RESIDUAL:
        res_offsets = _bn_offsets(rows, channels, S, res_stride_n, res_stride_c, res_stride_s)
        z += tl.load(res_ptr + res_offsets, mask=mask, other=0.0).to(acc)
    y = _act(z, ACT, negative_slope)
    tl.store(y_ptr + offsets, _cast_to(y, y_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _bn_act_grad_out(
    dy_ptr, src_ptr, x_ptr, res_ptr, rows, channels, mask, S,
    stride_n, stride_c, stride_s, res_stride_n, res_stride_c, res_stride_s, dy_stride_n, dy_stride_c, dy_stride_s,
    mean, invstd, weight, bias, negative_slope,
    HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr, ACT: tl.constexpr, acc: tl.constexpr,
):
    """dy' = dy * act'(.) over a tile, and x_hat; act' from the saved output or the recomputed pre-activation."""
    offsets = _bn_offsets(rows, channels, S, stride_n, stride_c, stride_s)
    x_hat = (tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc) - mean[None, :]) * invstd[None, :]
    dy = tl.load(dy_ptr + _bn_offsets(rows, channels, S, dy_stride_n, dy_stride_c, dy_stride_s), mask=mask, other=0.0)
    dy = dy.to(acc)
    if FROM_OUTPUT:
        # src is the saved output y, laid out like x.
        y = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(acc)
        dz = dy * _act_grad_from_output(y, ACT, negative_slope)
    else:
        z = x_hat * weight[None, :] + bias[None, :]
        if HAS_RESIDUAL:
            res_offsets = _bn_offsets(rows, channels, S, res_stride_n, res_stride_c, res_stride_s)
            z += tl.load(res_ptr + res_offsets, mask=mask, other=0.0).to(acc)
        dz = dy * _act_grad(z, ACT, negative_slope)
    return tl.where(mask, dz, 0.0), x_hat


@triton.jit
def _bn_act_bwd_reduce_kernel(
    dy_ptr, src_ptr, x_ptr, res_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
    sum_dz_ptr, sum_dz_xhat_ptr, dx_ptr, dres_ptr,
    R, C, S, stride_n, stride_c, stride_s, res_stride_n, res_stride_c, res_stride_s,
    dy_stride_n, dy_stride_c, dy_stride_s, rows_per_chunk, eps, negative_slope,
    HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr, FROM_RUNNING: tl.constexpr, AFFINE: tl.constexpr,
    ACT: tl.constexpr, WRITE_DX: tl.constexpr, WRITE_DRES: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
 ACC_FP64: tl.constexpr,):
    """Backward pass 1: per-chunk sums of dy' and dy' * x_hat for each channel.

    With running statistics (eval) dx = dy' * weight * invstd needs no sums,
    so WRITE_DX/WRITE_DRES write the input gradients here and no second pass runs.
    """
    if ACC_FP64:
        acc: tl.constexpr = tl.float64
    else:
        acc: tl.constexpr = tl.float32
    channel_block = tl.program_id(0)
    chunk = tl.program_id(1)
    if INDEX_64:
        chunk = chunk.to(tl.int64)
    channels = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < C
    mean, invstd, weight, bias = _bn_channel_params(
        mean_ptr, invstd_ptr, weight_ptr, bias_ptr, channels, channel_mask, eps, FROM_RUNNING, AFFINE, acc
    )
    sum_dz = tl.zeros([BLOCK_C], acc)
    sum_dz_xhat = tl.zeros([BLOCK_C], acc)
    row_begin = chunk * rows_per_chunk
    row_end = tl.minimum(row_begin + rows_per_chunk, R)
    for row_start in range(row_begin, row_end, BLOCK_R):
        rows = row_start + tl.arange(0, BLOCK_R)
        mask = (rows < row_end)[:, None] & channel_mask[None, :]
        dz, x_hat = _bn_act_grad_out(
            dy_ptr, src_ptr, x_ptr, res_ptr, rows, channels, mask, S,
            stride_n, stride_c, stride_s, res_stride_n, res_stride_c, res_stride_s, dy_stride_n, dy_stride_c, dy_stride_s,
            mean, invstd, weight, bias, negative_slope, HAS_RESIDUAL, FROM_OUTPUT, ACT, acc,
        )
        sum_dz += tl.sum(dz, axis=0)
        sum_dz_xhat += tl.sum(dz * x_hat, axis=0)
        offsets = _bn_offsets(rows, channels, S, stride_n, stride_c, stride_s)
        if WRITE_DX:
            dx = dz * (weight * invstd)[None, :]
            tl.store(dx_ptr + offsets, _cast_to(dx, dx_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
        if WRITE_DRES:
            tl.store(dres_ptr + offsets, _cast_to(dz, dres_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    tl.store(sum_dz_ptr + chunk * C + channels, sum_dz, mask=channel_mask)
    tl.store(sum_dz_xhat_ptr + chunk * C + channels, sum_dz_xhat, mask=channel_mask)


@triton.jit
def _bn_bwd_final_kernel(
    sum_dz_ptr, sum_dz_xhat_ptr, dweight_ptr, dbias_ptr, coef_ptr,
    R, C, n_chunks,
    WRITE_DWEIGHT: tl.constexpr, WRITE_DBIAS: tl.constexpr, BLOCK_C: tl.constexpr,
 ACC_FP64: tl.constexpr,):
    """Sums the chunk partials: d(bias) = sum dy', d(weight) = sum dy' x_hat, and their means for dx."""
    if ACC_FP64:
        acc: tl.constexpr = tl.float64
    else:
        acc: tl.constexpr = tl.float32
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < C
    sum_dz = tl.zeros([BLOCK_C], acc)
    sum_dz_xhat = tl.zeros([BLOCK_C], acc)
    for chunk in range(0, n_chunks):
        sum_dz += tl.load(sum_dz_ptr + chunk * C + channels, mask=channel_mask, other=0.0)
        sum_dz_xhat += tl.load(sum_dz_xhat_ptr + chunk * C + channels, mask=channel_mask, other=0.0)
    if WRITE_DWEIGHT:
        tl.store(dweight_ptr + channels, sum_dz_xhat.to(dweight_ptr.dtype.element_ty), mask=channel_mask)
    if WRITE_DBIAS:
        tl.store(dbias_ptr + channels, sum_dz.to(dbias_ptr.dtype.element_ty), mask=channel_mask)
    tl.store(coef_ptr + channels, sum_dz / R, mask=channel_mask)
    tl.store(coef_ptr + C + channels, sum_dz_xhat / R, mask=channel_mask)


@triton.jit
def _bn_act_bwd_dx_kernel(
    dy_ptr, src_ptr, x_ptr, res_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, coef_ptr, dx_ptr, dres_ptr,
    R, C, S, stride_n, stride_c, stride_s, res_stride_n, res_stride_c, res_stride_s,
    dy_stride_n, dy_stride_c, dy_stride_s, eps, negative_slope,
    HAS_RESIDUAL: tl.constexpr, FROM_OUTPUT: tl.constexpr, AFFINE: tl.constexpr, ACT: tl.constexpr,
    WRITE_DX: tl.constexpr, WRITE_DRES: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
 ACC_FP64: tl.constexpr,):
    """Backward pass 2 (batch statistics): dx = weight * invstd * (dy' - mean(dy') - x_hat * mean(dy' x_hat))."""
    if ACC_FP64:
        acc: tl.constexpr = tl.float64
    else:
        acc: tl.constexpr = tl.float32
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    rows, channels, channel_mask, mask = _bn_tile(pid, R, C, BLOCK_R, BLOCK_C)
    mean, invstd, weight, bias = _bn_channel_params(
        mean_ptr, invstd_ptr, weight_ptr, bias_ptr, channels, channel_mask, eps, False, AFFINE, acc
    )
    dz, x_hat = _bn_act_grad_out(
        dy_ptr, src_ptr, x_ptr, res_ptr, rows, channels, mask, S,
        stride_n, stride_c, stride_s, res_stride_n, res_stride_c, res_stride_s, dy_stride_n, dy_stride_c, dy_stride_s,
        mean, invstd, weight, bias, negative_slope, HAS_RESIDUAL, FROM_OUTPUT, ACT, acc,
    )
    offsets = _bn_offsets(rows, channels, S, stride_n, stride_c, stride_s)
    if WRITE_DX:
        mean_dz = tl.load(coef_ptr + channels, mask=channel_mask, other=0.0)
        mean_dz_xhat = tl.load(coef_ptr + C + channels, mask=channel_mask, other=0.0)
        dx = (weight * invstd)[None, :] * (dz - mean_dz[None, :] - x_hat * mean_dz_xhat[None, :])
        tl.store(dx_ptr + offsets, _cast_to(dx, dx_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    if WRITE_DRES:
        tl.store(dres_ptr + offsets, _cast_to(dz, dres_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
