"""Gradient norm and clipping over the gradient slots of flat buffers (clip_grad_norm_).

A block table (int64, ``[n_blocks, 2]``: element offset of the block in the
buffer, number of elements) lists the ranges that hold gradients, cut into
blocks of at most BLOCK elements, one program each: padding and the slots of
parameters without a gradient are never read or written. Every block starts
on a multiple of ALIGN elements (FlatParams aligns every slot; the launcher
takes the largest power of two that divides every slot offset, up to one
128-bit vector, and BLOCK is a multiple of it), so each program reads its
block from an aligned base pointer with 32-bit offsets (the int64 start is
added once), and the compiler issues 128-bit accesses. The
masks stay exact: a block's body (its length rounded down to ALIGN) is read
with a vector mask, and when some block length is not a multiple of ALIGN
(HAS_TAIL, decided per table) the last few elements with a short scalar one.

Norms accumulate in the partial buffer's dtype: float32, or float64 when a
float64 gradient takes part. Float parameters that must keep float64
precision (the norm order p, max_norm) come as a float32 pair hi + lo.
"""

import triton
import triton.language as tl

from . import codes
from .cast import _cast_to
from .kit import _acc_dtype

# NORM kinds (constexpr): general p, 2 (sum of squares), 1 (sum of |x|), inf (max |x|).
NORM_P = tl.constexpr(codes.NORM_P)
NORM_2 = tl.constexpr(codes.NORM_2)
NORM_1 = tl.constexpr(codes.NORM_1)
NORM_INF = tl.constexpr(codes.NORM_INF)


@triton.jit
def _block_span(blocks_ptr, ALIGN: tl.constexpr, HAS_TAIL: tl.constexpr):
    """This program's block: its first element, its length and its body length (a multiple of ALIGN)."""
    row = blocks_ptr + 2 * tl.program_id(0)
    start = tl.multiple_of(tl.load(row), ALIGN)
    length = tl.load(row + 1).to(tl.int32)
    if HAS_TAIL:
        body = tl.multiple_of((length // ALIGN) * ALIGN, ALIGN)
    else:
        body = tl.multiple_of(length, ALIGN)
    return start, length, body


@triton.jit
def _as_bits(x):
    """The bits of float32/float64 ``x`` as a signed integer of the same width."""
    if x.dtype == tl.float64:
        return x.to(tl.int64, bitcast=True)
    else:
        return x.to(tl.int32, bitcast=True)


@triton.jit
def _norm_terms(x, p, NORM: tl.constexpr):
    """Per-element terms of the norm of |x| (x >= 0 or NaN): x^p, x^2, x, or x's bits for the max.

    For the max, non-negative floats order like their bit patterns as signed
    integers, and a NaN (with its sign bit cleared by abs) sorts above +inf:
    an integer max is exact and returns NaN when a NaN is present, as torch does.
    """
    if NORM == NORM_INF:
        return _as_bits(x)
    elif NORM == NORM_2:
        return x * x
    elif NORM == NORM_1:
        return x
    else:
        # x^p = 2^(p log2 x); 0^p = 0 for p > 0 and NaN stays NaN (log2 never sees 0: no warning
        # from the interpreter's numpy for the masked lanes).
        return tl.where(x > 0, tl.exp2(p * tl.log2(tl.where(x > 0, x, 1.0))), x)


@triton.jit
def _reduce_terms(terms, NORM: tl.constexpr):
    if NORM == NORM_INF:
        return tl.max(terms, axis=0)
    else:
        return tl.sum(terms, axis=0)


@triton.jit
def _norm_partial_kernel(grad_ptr, blocks_ptr, partial_ptr, partial_offset, p_hi, p_lo, NORM: tl.constexpr,
                         ALIGN: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK: tl.constexpr):
    """partial[partial_offset + i] = sum |g|^p (or max |g|) over block i of the table."""
    ACC: tl.constexpr = partial_ptr.dtype.element_ty
    start, length, body = _block_span(blocks_ptr, ALIGN, HAS_TAIL)
    base = grad_ptr + start
    p = tl.cast(p_hi, ACC) + tl.cast(p_lo, ACC)
    index = tl.arange(0, BLOCK)
    x = tl.abs(tl.load(base + index, mask=index < body, other=0.0).to(ACC))
    value = _reduce_terms(_norm_terms(x, p, NORM), NORM)
    if HAS_TAIL:
        tail = body + tl.arange(0, ALIGN)
        x_tail = tl.abs(tl.load(base + tail, mask=tail < length, other=0.0).to(ACC))
        tail_value = _reduce_terms(_norm_terms(x_tail, p, NORM), NORM)
        if NORM == NORM_INF:
            value = tl.maximum(value, tail_value)
        else:
            value = value + tail_value
    if NORM == NORM_INF:
        value = value.to(ACC, bitcast=True)
    tl.store(partial_ptr + partial_offset + tl.program_id(0), value)


@triton.jit
def _norm_final_kernel(partial_ptr, n_partials, norm_ptr, p_hi, p_lo, NORM: tl.constexpr,
                       EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    """norm = (sum of partials)^(1/p) (or their max), in one program, stored in norm_ptr's dtype."""
    ACC: tl.constexpr = partial_ptr.dtype.element_ty
    p = tl.cast(p_hi, ACC) + tl.cast(p_lo, ACC)
    if NORM == NORM_INF:
        # Partials are >= 0 or NaN: the integer max of their bits is the max, NaN if any (see _norm_terms).
        acc = _as_bits(tl.zeros([BLOCK], ACC))
    else:
        acc = tl.zeros([BLOCK], ACC)
    for first in range(0, n_partials, BLOCK):
        offsets = first + tl.arange(0, BLOCK)
        values = tl.load(partial_ptr + offsets, mask=offsets < n_partials, other=0.0)
        if NORM == NORM_INF:
            acc = tl.maximum(acc, _as_bits(values))
        else:
            acc += values
    if NORM == NORM_INF:
        total = tl.max(acc, axis=0).to(ACC, bitcast=True)
    elif NORM == NORM_2:
        total = tl.sqrt(tl.sum(acc, axis=0))
    elif NORM == NORM_1:
        total = tl.sum(acc, axis=0)
    else:
        summed = tl.sum(acc, axis=0)
        # s^(1/p) = 2^(log2(s) / p); 0 and NaN come through unchanged, and inf too.
        total = tl.where(summed > 0, tl.exp2(tl.log2(tl.where(summed > 0, summed, 1.0)) / p), summed)
    tl.store(norm_ptr, _cast_to(total, norm_ptr.dtype.element_ty, EMULATE_BF16_RTNE))


@triton.jit
def _clip_coef(norm_ptr, max_norm, ACC: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """torch's ``clamp(max_norm / (norm + 1e-6), max=1)`` step by step, each rounded to the norm's dtype.

    torch evaluates ``max_norm / t`` as ``t.reciprocal() * max_norm``; doing the same, with IEEE
    division, gives the same coefficient bit for bit, so the clipped gradients match torch's exactly
    whenever the norms match. A NaN norm gives a NaN coefficient (torch.clamp propagates NaN).
    """
    NORM_DTYPE: tl.constexpr = norm_ptr.dtype.element_ty
    denominator = _cast_to(tl.load(norm_ptr).to(ACC) + tl.full([], 1e-6, ACC), NORM_DTYPE, EMULATE_BF16_RTNE).to(ACC)
    if tl.float64 == ACC:
        reciprocal = 1.0 / denominator
    else:
        reciprocal = tl.div_rn(tl.full([], 1.0, ACC), denominator)
    reciprocal = _cast_to(reciprocal, NORM_DTYPE, EMULATE_BF16_RTNE).to(ACC)
    coef = _cast_to(reciprocal * max_norm, NORM_DTYPE, EMULATE_BF16_RTNE).to(ACC)
    return tl.minimum(coef, 1.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _clip_segments_kernel(grad_ptr, blocks_ptr, norm_ptr, max_norm_hi, max_norm_lo, ALIGN: tl.constexpr,
                          HAS_TAIL: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    """g *= min(max_norm / (norm + 1e-6), 1) over block i, reading the norm on the device (no sync).

    A NaN norm makes the coefficient (and the gradients) NaN, as torch.clamp does.
    """
    # The norm comes in the result dtype, as torch returns it; the coefficient is computed from
    # it in float32 (float64 for a float64 norm) and rounded to that dtype, as torch does.
    ACC: tl.constexpr = _acc_dtype(norm_ptr.dtype.element_ty == tl.float64)
    start, length, body = _block_span(blocks_ptr, ALIGN, HAS_TAIL)
    base = grad_ptr + start
    max_norm = tl.cast(max_norm_hi, ACC) + tl.cast(max_norm_lo, ACC)
    coef = _clip_coef(norm_ptr, max_norm, ACC, EMULATE_BF16_RTNE)
    index = tl.arange(0, BLOCK)
    mask = index < body
    g = tl.load(base + index, mask=mask, other=0.0).to(ACC)
    tl.store(base + index, _cast_to(g * coef, grad_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    if HAS_TAIL:
        tail = body + tl.arange(0, ALIGN)
        tail_mask = tail < length
        g_tail = tl.load(base + tail, mask=tail_mask, other=0.0).to(ACC)
        tl.store(base + tail, _cast_to(g_tail * coef, grad_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=tail_mask)
