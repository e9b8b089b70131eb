"""Multi-tensor optimizer updates over flat buffers: one launch per buffer.

The parameters, gradients and optimizer state of a flat buffer share one
layout, so an update is elementwise over element ranges. The launcher passes
a block table (``starts``, ``ends``: element ranges of at most BLOCK
elements, one program each, covering only the parameters that have a
gradient this step) and, per block, a row index into a small table of
per-step coefficients (float64): one row per (parameter group, step count),
so groups with different hyperparameters and parameters whose step counts
differ (some skipped steps with grad None) still take one launch.

Math is done in float32 (float64 for float64 buffers) whatever the storage
dtype; with a master buffer (MASTER), parameters are read from and written
to float32 masters, and the low-precision parameter is written rounded.
Gradients are divided by ``*grad_scale`` when GRAD_SCALE is set (AMP
unscaling inside the update) and stored back unscaled, as torch's fused
optimizers leave them; with FOUND_INF a non-zero ``*found_inf`` skips the
whole update on the device. The coefficient table may be computed on the
device (capturable optimizers) or on the host: the kernel only reads it.
"""

import triton
import triton.language as tl

from .cast import _cast_to
from .kit import _acc_dtype

# Columns of an Adam coefficient row. 1 - beta comes from the host in float64:
# computed in float32 from a rounded beta2 = 0.999 it would be 1.3e-5 off.
ADAM_STEP_SIZE = tl.constexpr(0)  # lr / (1 - beta1**step)
ADAM_BETA1 = tl.constexpr(1)
ADAM_ONE_MINUS_BETA1 = tl.constexpr(2)
ADAM_BETA2 = tl.constexpr(3)
ADAM_ONE_MINUS_BETA2 = tl.constexpr(4)
ADAM_EPS = tl.constexpr(5)
ADAM_WEIGHT_DECAY = tl.constexpr(6)  # L2 term added to the gradient (Adam); 0 for decoupled decay
ADAM_DECAY = tl.constexpr(7)  # factor on the parameter before the update: 1 - lr * wd (AdamW), else 1
ADAM_BC2_SQRT = tl.constexpr(8)  # sqrt(1 - beta2**step)
ADAM_GRAD_SIGN = tl.constexpr(9)  # -1 when maximizing
ADAM_AMSGRAD = tl.constexpr(10)  # 1: keep and use max_exp_avg_sq
ADAM_ROW = tl.constexpr(11)

# Columns of an SGD coefficient row.
SGD_LR = tl.constexpr(0)
SGD_MOMENTUM = tl.constexpr(1)
SGD_ONE_MINUS_DAMPENING = tl.constexpr(2)
SGD_WEIGHT_DECAY = tl.constexpr(3)
SGD_NESTEROV = tl.constexpr(4)
SGD_GRAD_SIGN = tl.constexpr(5)
SGD_FIRST_STEP = tl.constexpr(6)  # 1: the momentum buffer starts as the gradient
SGD_ROW = tl.constexpr(7)


@triton.jit
def _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC: tl.constexpr, GRAD_SCALE: tl.constexpr,
               EMULATE_BF16_RTNE: tl.constexpr):
    """The gradient in ACC; with GRAD_SCALE, unscaled and written back unscaled (as torch's fused optimizers do)."""
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(ACC)
    if GRAD_SCALE:
        grad = grad / tl.load(grad_scale_ptr).to(ACC)
        tl.store(grad_ptr + offsets, _cast_to(grad, grad_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    return grad


@triton.jit
def _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr,
           START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr, FOUND_INF: tl.constexpr):
    """This program's element offsets, their mask, and a pointer to its coefficient row.

    With FOUND_INF, a non-zero ``*found_inf`` (GradScaler found inf/NaN
    gradients) masks every element: the step is skipped on the device, nothing
    is read or written (as torch's fused optimizers do), and no host reads the flag.

    The alignment hints let the compiler use 128-bit accesses: block starts are
    parameter offsets (aligned by FlatParams) plus multiples of BLOCK, and the
    launcher rounds run ends up into the zero padding when the update keeps
    zeros at zero (END_ALIGN > 1); otherwise masks are per element.
    """
    block = tl.program_id(0)
    start = tl.multiple_of(tl.load(starts_ptr + block), START_ALIGN)
    end = tl.multiple_of(tl.load(ends_ptr + block), END_ALIGN)
    if FOUND_INF:
        end = tl.where(tl.load(found_inf_ptr) != 0, start, end)  # an empty block: every lane masked
    offsets = start + tl.arange(0, BLOCK)
    return offsets, offsets < end, rows_ptr + tl.load(block_rows_ptr + block) * ROW


@triton.jit
def _load_param(param_ptr, master_ptr, offsets, mask, ACC: tl.constexpr, MASTER: tl.constexpr):
    if MASTER:
        return tl.load(master_ptr + offsets, mask=mask, other=0.0).to(ACC)
    else:
        return tl.load(param_ptr + offsets, mask=mask, other=0.0).to(ACC)


@triton.jit
def _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """Writes the updated parameter (and its float32 master), rounded to nearest even."""
    if MASTER:
        tl.store(master_ptr + offsets, param.to(master_ptr.dtype.element_ty), mask=mask)
    tl.store(param_ptr + offsets, _cast_to(param, param_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _adam_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, grad_scale_ptr, found_inf_ptr,
    ACC_FP64: tl.constexpr, AMSGRAD: tl.constexpr, MASTER: tl.constexpr, GRAD_SCALE: tl.constexpr,
    FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """Adam / AdamW (torch.optim semantics) over one block of a flat buffer."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, ADAM_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    step_size = tl.load(row + ADAM_STEP_SIZE).to(ACC)
    beta1 = tl.load(row + ADAM_BETA1).to(ACC)
    one_minus_beta1 = tl.load(row + ADAM_ONE_MINUS_BETA1).to(ACC)
    beta2 = tl.load(row + ADAM_BETA2).to(ACC)
    one_minus_beta2 = tl.load(row + ADAM_ONE_MINUS_BETA2).to(ACC)
    eps = tl.load(row + ADAM_EPS).to(ACC)
    weight_decay = tl.load(row + ADAM_WEIGHT_DECAY).to(ACC)
    decay = tl.load(row + ADAM_DECAY).to(ACC)
    bc2_sqrt = tl.load(row + ADAM_BC2_SQRT).to(ACC)
    grad_sign = tl.load(row + ADAM_GRAD_SIGN).to(ACC)

    grad = _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC, GRAD_SCALE, EMULATE_BF16_RTNE) * grad_sign
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    param = param * decay
    if weight_decay != 0:
        grad = grad + param * weight_decay
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(ACC)
    # other=1: masked lanes then never divide 0 by 0 when eps == 0 (no effect on stored lanes).
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=1.0).to(ACC)
    # exp_avg.lerp_(grad, 1 - beta1), with torch's two-sided lerp formula.
    if one_minus_beta1 < 0.5:
        exp_avg = exp_avg + (grad - exp_avg) * one_minus_beta1
    else:
        exp_avg = grad - (grad - exp_avg) * beta1
    exp_avg_sq = exp_avg_sq * beta2 + grad * grad * one_minus_beta2
    second_moment = exp_avg_sq
    if AMSGRAD:
        max_ptrs = max_exp_avg_sq_ptr + offsets
        if tl.load(row + ADAM_AMSGRAD) != 0:
            max_sq = tl.load(max_ptrs, mask=mask, other=0.0).to(ACC)
            max_sq = tl.maximum(max_sq, exp_avg_sq, propagate_nan=tl.PropagateNan.ALL)
            tl.store(max_ptrs, _cast_to(max_sq, max_exp_avg_sq_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
            second_moment = max_sq
    denom = tl.sqrt(second_moment) / bc2_sqrt + eps
    param = param - (exp_avg / denom) * step_size
    tl.store(exp_avg_ptr + offsets, _cast_to(exp_avg, exp_avg_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    exp_avg_sq_out = _cast_to(exp_avg_sq, exp_avg_sq_ptr.dtype.element_ty, EMULATE_BF16_RTNE)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq_out, mask=mask)
    _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER, EMULATE_BF16_RTNE)


@triton.jit
def _sgd_kernel(
    param_ptr, grad_ptr, momentum_buffer_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, grad_scale_ptr, found_inf_ptr,
    ACC_FP64: tl.constexpr, MOMENTUM: tl.constexpr, MASTER: tl.constexpr, GRAD_SCALE: tl.constexpr,
    FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """SGD with optional momentum, dampening and Nesterov (torch.optim.SGD semantics) over one block."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, SGD_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    lr = tl.load(row + SGD_LR).to(ACC)
    weight_decay = tl.load(row + SGD_WEIGHT_DECAY).to(ACC)
    grad_sign = tl.load(row + SGD_GRAD_SIGN).to(ACC)

    grad = _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC, GRAD_SCALE, EMULATE_BF16_RTNE) * grad_sign
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    if weight_decay != 0:
        grad = grad + param * weight_decay
    if MOMENTUM:
        momentum = tl.load(row + SGD_MOMENTUM).to(ACC)
        if momentum != 0:
            buffer_ptrs = momentum_buffer_ptr + offsets
            if tl.load(row + SGD_FIRST_STEP) != 0:
                buffer = grad  # torch: the buffer starts as a copy of the gradient
            else:
                one_minus_dampening = tl.load(row + SGD_ONE_MINUS_DAMPENING).to(ACC)
                buffer = tl.load(buffer_ptrs, mask=mask, other=0.0).to(ACC) * momentum + grad * one_minus_dampening
            tl.store(buffer_ptrs, _cast_to(buffer, momentum_buffer_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
            if tl.load(row + SGD_NESTEROV) != 0:
                grad = grad + buffer * momentum
            else:
                grad = buffer
    param = param - grad * lr
    _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER, EMULATE_BF16_RTNE)


# Columns of a Lion coefficient row.
LION_LR = tl.constexpr(0)
LION_BETA1 = tl.constexpr(1)
LION_ONE_MINUS_BETA1 = tl.constexpr(2)
LION_BETA2 = tl.constexpr(3)
LION_ONE_MINUS_BETA2 = tl.constexpr(4)
LION_DECAY = tl.constexpr(5)  # 1 - lr * weight_decay (decoupled, as AdamW)
LION_GRAD_SIGN = tl.constexpr(6)  # -1 when maximizing
LION_ROW = tl.constexpr(7)


@triton.jit
def _lion_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, grad_scale_ptr, found_inf_ptr,
    ACC_FP64: tl.constexpr, MASTER: tl.constexpr, GRAD_SCALE: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """Lion (Chen et al. 2023) over one block: the sign of an interpolated momentum, decoupled weight decay."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, LION_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    lr = tl.load(row + LION_LR).to(ACC)
    beta1 = tl.load(row + LION_BETA1).to(ACC)
    one_minus_beta1 = tl.load(row + LION_ONE_MINUS_BETA1).to(ACC)
    beta2 = tl.load(row + LION_BETA2).to(ACC)
    one_minus_beta2 = tl.load(row + LION_ONE_MINUS_BETA2).to(ACC)
    decay = tl.load(row + LION_DECAY).to(ACC)
    grad_sign = tl.load(row + LION_GRAD_SIGN).to(ACC)

    grad = _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC, GRAD_SCALE, EMULATE_BF16_RTNE) * grad_sign
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(ACC)
    direction = exp_avg * beta1 + grad * one_minus_beta1
    # sign() as torch.sign: 0 at 0, NaN for NaN (x / |x| is NaN at 0; the select keeps NaN where x is NaN).
    sign = tl.where(direction > 0, 1.0, tl.where(direction < 0, -1.0, direction * 0.0)).to(ACC)
    param = param * decay - sign * lr
    exp_avg = exp_avg * beta2 + grad * one_minus_beta2
    tl.store(exp_avg_ptr + offsets, _cast_to(exp_avg, exp_avg_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER, EMULATE_BF16_RTNE)


# Columns of an Adagrad coefficient row.
ADAGRAD_CLR = tl.constexpr(0)  # lr / (1 + (step - 1) * lr_decay)
ADAGRAD_WEIGHT_DECAY = tl.constexpr(1)
ADAGRAD_EPS = tl.constexpr(2)
ADAGRAD_GRAD_SIGN = tl.constexpr(3)  # -1 when maximizing
ADAGRAD_ROW = tl.constexpr(4)


@triton.jit
def _adagrad_kernel(
    param_ptr, grad_ptr, sum_ptr, master_ptr,
    starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, grad_scale_ptr, found_inf_ptr,
    ACC_FP64: tl.constexpr, MASTER: tl.constexpr, GRAD_SCALE: tl.constexpr, FOUND_INF: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr, START_ALIGN: tl.constexpr, END_ALIGN: tl.constexpr,
):
    """Adagrad (torch.optim.Adagrad semantics, dense gradients) over one block of a flat buffer."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    offsets, mask, row = _block(starts_ptr, ends_ptr, block_rows_ptr, rows_ptr, found_inf_ptr, ADAGRAD_ROW, BLOCK,
                                START_ALIGN, END_ALIGN, FOUND_INF)
    clr = tl.load(row + ADAGRAD_CLR).to(ACC)
    weight_decay = tl.load(row + ADAGRAD_WEIGHT_DECAY).to(ACC)
    eps = tl.load(row + ADAGRAD_EPS).to(ACC)
    grad_sign = tl.load(row + ADAGRAD_GRAD_SIGN).to(ACC)

    grad = _load_grad(grad_ptr, offsets, mask, grad_scale_ptr, ACC, GRAD_SCALE, EMULATE_BF16_RTNE) * grad_sign
    param = _load_param(param_ptr, master_ptr, offsets, mask, ACC, MASTER)
    if weight_decay != 0:
        grad = grad + param * weight_decay
    # other=1: masked lanes never divide 0 by 0 when eps == 0 (no effect on stored lanes).
    total = tl.load(sum_ptr + offsets, mask=mask, other=1.0).to(ACC) + grad * grad
    param = param - clr * (grad / (tl.sqrt(total) + eps))
    tl.store(sum_ptr + offsets, _cast_to(total, sum_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    _store_param(param_ptr, master_ptr, offsets, mask, param, MASTER, EMULATE_BF16_RTNE)
