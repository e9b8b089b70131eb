"""Layer-wise adaptive updates (LAMB, LARS) over flat buffers: per-parameter trust ratios in three launches.

A flat buffer's runs are one parameter each here (the launcher does not merge
neighbours), cut into blocks that never straddle two parameters:

1. ``_lamb_moments_kernel``: per block, the Adam moments (stored), the update
   direction ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p`` from the
   unrounded moments (stored in a scratch buffer of the accumulator dtype)
   and the block's sums of ``p**2`` and ``u**2``.
2. ``_trust_ratio_kernel``: per parameter (run), the sums of its blocks in a
   fixed order (deterministic), then ``lr * trust`` with
   ``trust = ||p|| / ||u||`` (1 where either norm is 0, or where the row does
   not adapt), clipped at 1 when the row says so.
3. ``_lamb_update_kernel``: ``p -= (lr * trust) * u``, with the ``u`` whose
   norm was taken (float32 maths rounded once, as the other optimizers).

LARS takes the same three steps: ``_lars_norms_kernel`` (sums of ``p**2`` and
``g**2``), the trust-ratio kernel with LARS's ratio, ``_lars_update_kernel``
(momentum with the scaled learning rate).

Blocks read a coefficient row as the other optimizer kernels do (LAMB_* and
LARS_* columns); with FOUND_INF set every block is empty and nothing is written.
"""

import triton
import triton.language as tl

from .cast import _cast_to
from .kit import _acc_dtype
from .optim import _block, _load_grad, _load_param, _store_param

# Columns of a LAMB coefficient row.
LAMB_LR = tl.constexpr(0)
LAMB_BETA1 = tl.constexpr(1)
LAMB_ONE_MINUS_BETA1 = tl.constexpr(2)
LAMB_BETA2 = tl.constexpr(3)
LAMB_ONE_MINUS_BETA2 = tl.constexpr(4)
LAMB_EPS = tl.constexpr(5)
LAMB_WEIGHT_DECAY = tl.constexpr(6)
LAMB_BC1 = tl.constexpr(7)  # 1 - beta1**step (1 without bias correction)
LAMB_BC2_SQRT = tl.constexpr(8)  # sqrt(1 - beta2**step) (1 without bias correction)
LAMB_GRAD_SIGN = tl.constexpr(9)  # -1 when maximizing
LAMB_ADAPT = tl.constexpr(10)  # 1: scale by the trust ratio; 0: plain lr (a group not adapted)
LAMB_TRUST_CLIP = tl.constexpr(11)  # 1: trust ratio at most 1
LAMB_ROW = tl.constexpr(12)


@triton.jit
def _lamb_direction(exp_avg, exp_avg_sq, param, row, ACC: tl.constexpr):
    eps = tl.load(row + LAMB_EPS).to(ACC)
    bc1 = tl.load(row + LAMB_BC1).to(ACC)
    bc2_sqrt = tl.load(row + LAMB_BC2_SQRT).to(ACC)
    weight_decay = tl.load(row + LAMB_WEIGHT_DECAY).to(ACC)
    return (exp_avg / bc1) / (tl.sqrt(exp_avg_sq) / bc2_sqrt + eps) + param * weight_decay


@triton.jit
def _lamb_moments_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, grad_scale_ptr, found_inf_ptr, partials_ptr, direction_ptr,
    ACC_FP64: tl.constexpr, MASTER: tl.constexpr, GRAD_SCALE: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """Phase 1: the moments of one block, its direction u (scratch), and its partial sums of p**2 and u**2 (at
    partials[2 * block])."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, LAMB_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    beta1 = tl.load(row + LAMB_BETA1).to(ACC)
    one_minus_beta1 = tl.load(row + LAMB_ONE_MINUS_BETA1).to(ACC)
    beta2 = tl.load(row + LAMB_BETA2).to(ACC)
    one_minus_beta2 = tl.load(row + LAMB_ONE_MINUS_BETA2).to(ACC)
    grad_sign = tl.load(row + LAMB_GRAD_SIGN).to(ACC)

    grad = _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC, GRAD_SCALE, EMULATE_BF16_RTNE) * grad_sign
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(ACC) * beta1 + grad * one_minus_beta1
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(ACC) * beta2
    exp_avg_sq = exp_avg_sq + grad * grad * one_minus_beta2
    tl.store(exp_avg_ptr + offsets, _cast_to(exp_avg, exp_avg_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    exp_avg_sq_out = _cast_to(exp_avg_sq, exp_avg_sq_ptr.dtype.element_ty, EMULATE_BF16_RTNE)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq_out, mask=mask)
    direction = tl.where(mask, _lamb_direction(exp_avg, exp_avg_sq, param, row, ACC), 0.0)
    tl.store(direction_ptr + offsets, direction, mask=mask)
    block = tl.program_id(0)
    tl.store(partials_ptr + 2 * block, tl.sum(param * param, axis=0))
    tl.store(partials_ptr + 2 * block + 1, tl.sum(direction * direction, axis=0))


@triton.jit
def _trust_ratio_kernel(
    partials_ptr, run_first_ptr, run_blocks_ptr, run_rows_ptr, rows_ptr, scaled_lr_ptr,
    ROW: tl.constexpr, LR: tl.constexpr, ADAPT: tl.constexpr, TRUST_CLIP: tl.constexpr, CHUNK: tl.constexpr,
    LARS: tl.constexpr, ETA: tl.constexpr, WEIGHT_DECAY: tl.constexpr, EPS: tl.constexpr,
):
    """Phase 2, one program per parameter (run): its norms from its blocks' partial sums, summed in a fixed
    order, and ``scaled_lr = lr * trust``. LAMB: trust = ||p|| / ||u||, at most 1 with the row's trust clip.
    LARS: trust = eta ||p|| / (||g|| + weight_decay ||p|| + eps). Either: 1 where a norm is 0 or the row does
    not adapt. (TRUST_CLIP, ETA, WEIGHT_DECAY, EPS: columns of the row, for the family that reads them.)"""
    run = tl.program_id(0)
    first = tl.load(run_first_ptr + run)
    count = tl.load(run_blocks_ptr + run)
    row = rows_ptr + tl.load(run_rows_ptr + run) * ROW
    acc_w = tl.zeros([CHUNK], dtype=partials_ptr.dtype.element_ty)
    acc_x = tl.zeros([CHUNK], dtype=partials_ptr.dtype.element_ty)
    for offset in range(0, count, CHUNK):
        index = offset + tl.arange(0, CHUNK)
        mask = index < count
        acc_w += tl.load(partials_ptr + 2 * (first + index), mask=mask, other=0.0)
        acc_x += tl.load(partials_ptr + 2 * (first + index) + 1, mask=mask, other=0.0)
    w_norm = tl.sqrt(tl.sum(acc_w, axis=0))
    x_norm = tl.sqrt(tl.sum(acc_x, axis=0))  # ||u|| (LAMB) or ||g|| (LARS)
    if LARS:
        eta = tl.load(row + ETA).to(w_norm.dtype)
        weight_decay = tl.load(row + WEIGHT_DECAY).to(w_norm.dtype)
        eps = tl.load(row + EPS).to(w_norm.dtype)
        ratio = tl.where((w_norm > 0) & (x_norm > 0), eta * w_norm / (x_norm + weight_decay * w_norm + eps), 1.0)
    else:
        ratio = tl.where((w_norm > 0) & (x_norm > 0), w_norm / x_norm, 1.0)
        ratio = tl.where(tl.load(row + TRUST_CLIP) != 0, tl.minimum(ratio, 1.0), ratio)
    ratio = tl.where(tl.load(row + ADAPT) != 0, ratio, 1.0)
    tl.store(scaled_lr_ptr + run, tl.load(row + LR).to(ratio.dtype) * ratio)


@triton.jit
def _lamb_update_kernel(
    param_ptr, master_ptr, direction_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, scaled_lr_ptr, block_runs_ptr,
    ACC_FP64: tl.constexpr, MASTER: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """Phase 3: p -= (lr * trust) * u over one block."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, _row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, LAMB_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    scaled_lr = tl.load(scaled_lr_ptr + tl.load(block_runs_ptr + tl.program_id(0))).to(ACC)
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    direction = tl.load(direction_ptr + offsets, mask=mask, other=0.0).to(ACC)
    param = param - direction * scaled_lr
    _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER, EMULATE_BF16_RTNE)


# Columns of a LARS coefficient row.
LARS_LR = tl.constexpr(0)
LARS_MOMENTUM = tl.constexpr(1)
LARS_WEIGHT_DECAY = tl.constexpr(2)
LARS_TRUST_COEFFICIENT = tl.constexpr(3)  # eta
LARS_EPS = tl.constexpr(4)
LARS_NESTEROV = tl.constexpr(5)
LARS_GRAD_SIGN = tl.constexpr(6)  # -1 when maximizing
LARS_ADAPT = tl.constexpr(7)
LARS_ROW = tl.constexpr(8)


@triton.jit
def _lars_norms_kernel(
    param_ptr, grad_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, grad_scale_ptr, found_inf_ptr, partials_ptr,
    ACC_FP64: tl.constexpr, MASTER: tl.constexpr, GRAD_SCALE: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """LARS phase 1: one block's sums of p**2 and g**2 (g unscaled, and written back so, under GRAD_SCALE)."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, _row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, LARS_ROW, BLOCK,
                                 START_ALIGN, END_ALIGN, FOUND_INF)
    grad = _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC, GRAD_SCALE, EMULATE_BF16_RTNE)
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    block = tl.program_id(0)
    tl.store(partials_ptr + 2 * block, tl.sum(param * param, axis=0))
    tl.store(partials_ptr + 2 * block + 1, tl.sum(grad * grad, axis=0))


@triton.jit
def _lars_update_kernel(
    param_ptr, grad_ptr, momentum_buffer_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, scaled_lr_ptr, block_runs_ptr,
    ACC_FP64: tl.constexpr, MASTER: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """LARS phase 3 over one block: v = momentum v + scaled_lr (g + weight_decay p); p -= v (Nesterov:
    p -= momentum v + scaled_lr (g + weight_decay p))."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, LARS_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    scaled_lr = tl.load(scaled_lr_ptr + tl.load(block_runs_ptr + tl.program_id(0))).to(ACC)
    momentum = tl.load(row + LARS_MOMENTUM).to(ACC)
    weight_decay = tl.load(row + LARS_WEIGHT_DECAY).to(ACC)
    grad_sign = tl.load(row + LARS_GRAD_SIGN).to(ACC)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(ACC) * grad_sign
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    step = (grad + param * weight_decay) * scaled_lr
    buffer = tl.load(momentum_buffer_ptr + offsets, mask=mask, other=0.0).to(ACC) * momentum + step
    tl.store(momentum_buffer_ptr + offsets, _cast_to(buffer, momentum_buffer_ptr.dtype.element_ty, EMULATE_BF16_RTNE),
             mask=mask)
    if tl.load(row + LARS_NESTEROV) != 0:
        param = param - (buffer * momentum + step)
    else:
        param = param - buffer
    _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER, EMULATE_BF16_RTNE)
