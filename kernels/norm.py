"""Gradient norm and clipping over segments of flat buffers (clip_grad_norm_).

A segment table lists the [start, end) element ranges that hold gradients;
the launcher cuts them into blocks of at most BLOCK elements, one program
each, so padding and the slots of parameters without a gradient are never
read. Norms accumulate in the partial buffer's dtype: float32, or float64
when a float64 gradient takes part.
"""

import triton
import triton.language as tl

# NORM kinds (constexpr): general p, 2 (sum of squares), 1 (sum of |x|), inf (max |x|).
NORM_P = tl.constexpr(0)
NORM_2 = tl.constexpr(1)
NORM_1 = tl.constexpr(2)
NORM_INF = tl.constexpr(3)


@triton.jit
def _norm_partial_kernel(grad_ptr, starts_ptr, ends_ptr, partial_ptr, partial_offset, p, NORM: tl.constexpr, BLOCK: tl.constexpr):
    """partial[partial_offset + i] = sum |g|^p (or max |g|) over block i."""
    block = tl.program_id(0)
    start = tl.load(starts_ptr + block)
    end = tl.load(ends_ptr + block)
    offsets = start + tl.arange(0, BLOCK)
    x = tl.abs(tl.load(grad_ptr + offsets, mask=offsets < end, other=0.0).to(partial_ptr.dtype.element_ty))
    if NORM == NORM_INF:
        # tl.max may skip NaN; a NaN gradient must make the norm NaN, as in torch.
        value = tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), tl.max(x, axis=0))
    elif NORM == NORM_2:
        value = tl.sum(x * x, axis=0)
    elif NORM == NORM_1:
        value = tl.sum(x, axis=0)
    else:
        value = tl.sum(tl.where(x > 0, tl.exp(p * tl.log(tl.where(x > 0, x, 1.0))), 0.0), axis=0)
    tl.store(partial_ptr + partial_offset + block, value)


@triton.jit
def _norm_final_kernel(partial_ptr, n_partials, norm_ptr, p, NORM: tl.constexpr, BLOCK: tl.constexpr):
    """norm = (sum of partials)^(1/p) (or their max), in one program."""
    acc = tl.zeros([BLOCK], partial_ptr.dtype.element_ty)
    for start in range(0, n_partials, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        values = tl.load(partial_ptr + offsets, mask=offsets < n_partials, other=0.0)
        if NORM == NORM_INF:
            acc = tl.where((acc != acc) | (values != values), float("nan"), tl.maximum(acc, values))
        else:
            acc += values
    if NORM == NORM_INF:
        total = tl.where(tl.sum((acc != acc).to(tl.int32), axis=0) > 0, float("nan"), tl.max(acc, axis=0))
    elif NORM == NORM_2:
        total = tl.sqrt(tl.sum(acc, axis=0))
    elif NORM == NORM_1:
        total = tl.sum(acc, axis=0)
    else:
        summed = tl.sum(acc, axis=0)
        total = tl.where(summed > 0, tl.exp(tl.log(tl.where(summed > 0, summed, 1.0)) / p), 0.0)
    tl.store(norm_ptr, total)


@triton.jit
def _clip_segments_kernel(grad_ptr, starts_ptr, ends_ptr, norm_ptr, max_norm, BLOCK: tl.constexpr):
    """g *= min(max_norm / (norm + 1e-6), 1) over block i, reading the norm on the device (no sync)."""
    block = tl.program_id(0)
    start = tl.load(starts_ptr + block)
    end = tl.load(ends_ptr + block)
    norm = tl.load(norm_ptr)
    coef = tl.minimum(max_norm / (norm + 1e-6), 1.0)
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < end
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
    tl.store(grad_ptr + offsets, (g.to(norm_ptr.dtype.element_ty) * coef).to(grad_ptr.dtype.element_ty), mask=mask)
