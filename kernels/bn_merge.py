"""The merges of batch norm's reduction passes (kernels/batch_norm.py): the last program of a group merges.

Each program of a reducing pass stores its chunk partials, then arrives at
its block's counter (:func:`_bn_arrive`: a barrier, one acq_rel atomic); the
last to arrive merges the block's chunks, in a fixed order, and arrives at
its column group's counter, whose last merges the blocks and writes the
per-channel results (:func:`_bn_stats_finish` for the forward's table and
running statistics, :func:`_bn_bwd_finish` for d(weight), d(bias) and the dx
coefficients). Counters return to 0 when merged, so they need no clearing
between launches or CUDA-graph replays. The merges are predicated rather
than branched (a branch made ptxas spill in one backward specialisation).
"""

import triton
import triton.language as tl


@triton.jit
def _finite_or_zero(values):
    """A shift must be finite: an inf shift turns an inf mean into inf - inf = NaN (torch's CPU mean is inf).

    Any finite shift gives the same statistics; 0 stands in for inf/NaN.
    """
    return tl.where(tl.abs(values) < float("inf"), values, 0.0)


@triton.jit
def _bn_arrive(counter_ptr, arrivals, active):
    """Counts this program in at ``counter_ptr``, where ``arrivals`` programs arrive; True in the last of them.

    Call after the stores to publish. The CTA barrier orders every thread's
    stores before the atomic, whose release (acq_rel, GPU scope) publishes
    them; its acquire makes what the programs that arrived before published
    visible to the last one (which reads it at L2, ``.cg``). The last one puts
    the counter back to 0: every program that counts there has arrived, so it
    is ready for the next launch. Programs where ``active`` is False do not count.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, mask=active, sem="acq_rel", scope="gpu")
    last = active & (arrived == arrivals - 1)
    tl.store(counter_ptr, 0, mask=last)
    return last


@triton.jit
def _bn_only_if(mask, flag):
    """``mask`` where the scalar ``flag`` holds, else all False (a select: the interpreter's ``mask & flag``
    of a tensor and a scalar is no boolean tensor)."""
    return tl.where(flag, mask, False)


@triton.jit
def _bn_merge_block(n_chunks, CPB):
    """(block, its first chunk, its chunks, blocks) of this program's chunk (program axis 1): blocks of CPB chunks."""
    block = tl.program_id(1) // CPB
    first = block * CPB
    return block, first, tl.minimum(first + CPB, n_chunks) - first, tl.cdiv(n_chunks, CPB)


@triton.jit
def _bn_group_channels(start, end, SS, MC: tl.constexpr):
    """The channels of column window [start, end) (whole channels, at most MC) and their mask."""
    local = tl.arange(0, MC)
    return start // SS + local, local < (end - start) // SS


@triton.jit
def _bn_chan_merge(
    means_ptr, m2_ptr, first, n_items, rows_per_item, n_rows, SS, channels, channel_mask, C, active,
    MK: tl.constexpr, MC: tl.constexpr, acc: tl.constexpr,
):
    """Mean, M2 and count of items ``first .. first + n_items`` (chunks of rows, or blocks of chunks: item i
    covers rows i * rows_per_item .. on, as many as there are) per channel.

    Chan's formula around the first item's mean, MK items at a time, in item
    order whatever order their programs finished in. Item i's mean and M2 are
    at means_ptr/m2_ptr + i * C + channel, read at L2 (``.cg``: other programs
    of this launch wrote them). Reads nothing where ``active`` is False.
    """
    channel_mask = _bn_only_if(channel_mask, active)
    shift = tl.load(means_ptr + first * C + channels, mask=channel_mask, other=0.0, cache_modifier=".cg")
    shift = _finite_or_zero(shift)  # the first item's mean
    w1 = tl.zeros([MK, MC], acc)
    w2 = tl.zeros([MK, MC], acc)
    for i0 in range(0, tl.where(active, n_items, 0), MK):
        local = i0 + tl.arange(0, MK)
        items = first + local
        mask = (local < n_items)[:, None] & channel_mask[None, :]
        count = (tl.minimum(rows_per_item, n_rows - items * rows_per_item).to(acc) * SS)[:, None]
        offsets = items[:, None] * C + channels[None, :]
        mean = tl.load(means_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        m2 = tl.load(m2_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        d = tl.where(mask, mean - shift[None, :], 0.0)
        w1 += count * d
        w2 += m2 + count * d * d
    s1 = tl.sum(w1, axis=0)
    s2 = tl.sum(w2, axis=0)
    row_begin = first * rows_per_item
    total = (tl.minimum(n_rows, row_begin + n_items * rows_per_item) - row_begin).to(acc) * SS
    mean = shift + s1 / total
    # The clamp keeps a NaN (a NaN input makes the variance NaN, as torch's); maximum alone would drop it.
    m2 = tl.maximum(s2 - s1 * (s1 / total), 0.0, propagate_nan=tl.PropagateNan.ALL)
    return mean, m2, total


@triton.jit
def _bn_sum_merge(
    sums1_ptr, sums2_ptr, first, n_items, channels, channel_mask, C, active,
    MK: tl.constexpr, MC: tl.constexpr, acc: tl.constexpr,
):
    """Sums over items ``first .. first + n_items`` of the two partial sums per channel (item i's at
    sums_ptr + i * C + channel, read at L2), MK items at a time in item order; nothing read where not ``active``."""
    channel_mask = _bn_only_if(channel_mask, active)
    w1 = tl.zeros([MK, MC], acc)
    w2 = tl.zeros([MK, MC], acc)
    for i0 in range(0, tl.where(active, n_items, 0), MK):
        local = i0 + tl.arange(0, MK)
        mask = (local < n_items)[:, None] & channel_mask[None, :]
        offsets = (first + local)[:, None] * C + channels[None, :]
        w1 += tl.load(sums1_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        w2 += tl.load(sums2_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return tl.sum(w1, axis=0), tl.sum(w2, axis=0)


@triton.jit
def _bn_stats_finish(
    buf_ptr, running_mean_ptr, running_var_ptr, weight_ptr, bias_ptr, channels, channel_mask, C,
    mean, m2, total, eps, momentum, UPDATE_RUNNING: tl.constexpr, AFFINE: tl.constexpr, acc: tl.constexpr,
):
    """Writes the table buf[0:4C] = [mean, 1/sqrt(var + eps), weight/sqrt(var + eps), bias] of ``channels``
    and updates their running statistics (running_var gets the unbiased variance, as torch)."""
    invstd = 1.0 / tl.sqrt(m2 / total + eps)
    if AFFINE:
        weight = tl.load(weight_ptr + channels, mask=channel_mask, other=0.0).to(acc)
        bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(acc)
        scale = invstd * weight
    else:
        scale = invstd
        bias = tl.zeros_like(mean)
    tl.store(buf_ptr + channels, mean, mask=channel_mask)
    tl.store(buf_ptr + C + channels, invstd, mask=channel_mask)
    tl.store(buf_ptr + 2 * C + channels, scale, mask=channel_mask)
    tl.store(buf_ptr + 3 * C + channels, bias, mask=channel_mask)
    if UPDATE_RUNNING:
        unbiased = m2 / (total - 1.0)
        running_mean = tl.load(running_mean_ptr + channels, mask=channel_mask, other=0.0).to(acc)
        running_var = tl.load(running_var_ptr + channels, mask=channel_mask, other=0.0).to(acc)
        running_mean = running_mean * (1.0 - momentum) + mean * momentum
        running_var = running_var * (1.0 - momentum) + unbiased * momentum
        tl.store(running_mean_ptr + channels, running_mean.to(running_mean_ptr.dtype.element_ty), mask=channel_mask)
        tl.store(running_var_ptr + channels, running_var.to(running_var_ptr.dtype.element_ty), mask=channel_mask)


@triton.jit
def _bn_bwd_finish(
    buf_ptr, p_ptr, dweight_ptr, dbias_ptr, channels, channel_mask, C, sum_dz, sum_dz_xhat, total,
    WRITE_DWEIGHT: tl.constexpr, WRITE_DBIAS: tl.constexpr, WRITE_COEF: tl.constexpr,
):
    """d(bias) = sum dy', d(weight) = sum dy' x_hat of ``channels``; WRITE_COEF (batch statistics, dx wanted)
    also their row of the dx pass's table buf[0:5C] = [mean, scale, bias, scale * mean(dy'),
    scale / std * mean(dy' x_hat)], from the forward's table p_ptr."""
    if WRITE_DWEIGHT:
        tl.store(dweight_ptr + channels, sum_dz_xhat.to(dweight_ptr.dtype.element_ty), mask=channel_mask)
    if WRITE_DBIAS:
        tl.store(dbias_ptr + channels, sum_dz.to(dbias_ptr.dtype.element_ty), mask=channel_mask)
    if WRITE_COEF:
        mean = tl.load(p_ptr + channels, mask=channel_mask, other=0.0)
        invstd = tl.load(p_ptr + C + channels, mask=channel_mask, other=0.0)
        scale = tl.load(p_ptr + 2 * C + channels, mask=channel_mask, other=0.0)
        bias = tl.load(p_ptr + 3 * C + channels, mask=channel_mask, other=0.0)
        tl.store(buf_ptr + channels, mean, mask=channel_mask)
        tl.store(buf_ptr + C + channels, scale, mask=channel_mask)
        tl.store(buf_ptr + 2 * C + channels, bias, mask=channel_mask)
        tl.store(buf_ptr + 3 * C + channels, scale * (sum_dz / total), mask=channel_mask)
        tl.store(buf_ptr + 4 * C + channels, scale * invstd * (sum_dz_xhat / total), mask=channel_mask)
