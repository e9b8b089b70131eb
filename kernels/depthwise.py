"""Depthwise 2-d convolution with the preceding activation applied on load (the seeds' fuse_relu_depthwise_conv).

``y = act_out(conv2d(act_in(x), w, b, groups=C))`` for a weight ``[C, 1, KH, KW]``
(depth multiplier 1). The activation output ``act_in(x)`` is never written:
forward applies it to each input value as it is loaded, and backward
recomputes it (for the weight gradient) and its derivative (for the input
gradient) from the saved ``x``.

Addressing. Every tensor is addressed through its four strides (n, c, h, w),
so NCHW, channels_last and other strided layouts share one kernel; a stride of
1 is specialised by Triton, which makes the contiguous axis of a tile
vectorised. A program's tile is ``[BLOCK_P, BLOCK_C]``: BLOCK_P output (or
input) pixels of one image by BLOCK_C channels; the launcher makes BLOCK_C
wide for channels_last (channels are contiguous) and narrow for NCHW (pixels
are). Taps are unrolled (``KH x KW`` static loops); their loads of
neighbouring pixels hit the cache lines the previous taps brought in, so DRAM
sees each input about once.

Padding is zeros *after* the activation (conv2d pads ``act_in(x)``), so
masked lanes are zeroed after ``act_in``: sigmoid(0) or hardsigmoid(0) are not 0.

Kernels:

* ``_dw_fwd_kernel``: one output tile, all taps; optional bias, ``act_out``
  epilogue, and a store of the pre-activation ``z`` when ``act_out``'s
  derivative needs it.
* ``_dw_bwd_dx_kernel``: one input tile: the transposed gather of
  ``gz = d act_out`` over the taps whose stride lines up, times
  ``w``, then ``act_in'(x)`` (torch's selects for relu & co.).
* ``_dw_bwd_dw_partial_kernel`` and ``_dw_bwd_dw_final_kernel``: the weight
  and bias gradients as a two-stage deterministic reduction. Stage 1: one
  program per (tap, chunk of pixels, channel block) sums ``gz * act_in(x)``
  over its chunk (the bias "tap" sums ``gz``) into a float32 partial row;
  stage 2 adds the rows in chunk order and writes ``dw``/``db`` in their dtype.
"""

import triton
import triton.language as tl

from .activations import _act_backward_from_output, _activation, _activation_backward
from .cast import _cast_to
from .kit import _acc_dtype


@triton.jit
def _pixel_tile(pid_p, p_tiles, n_pixels, width, BLOCK_P: tl.constexpr, INDEX_64: tl.constexpr):
    """(image n, row, column, mask) of the BLOCK_P pixels of tile ``pid_p`` (images are folded into axis 0)."""
    n = pid_p // p_tiles
    p = (pid_p % p_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = p < n_pixels
    if INDEX_64:
        n = n.to(tl.int64)
        p = p.to(tl.int64)
    return n, p // width, p % width, mask


@triton.jit
def _grad_of_z(gy_ptr, s_ptr, g_offsets, s_offsets, mask, ACT_OUT: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr,
               slope_out, MATH: tl.constexpr, ACC: tl.constexpr):
    """``gz = gy * act_out'``, loaded at output offsets (0 where masked)."""
    g = tl.load(gy_ptr + g_offsets, mask=mask, other=0.0).to(ACC)
    if ACT_OUT != 0:  # IDENTITY is code 0 (kernels/codes.py)
        s = tl.load(s_ptr + s_offsets, mask=mask, other=0.0).to(ACC)
        if SAVED_IS_OUTPUT:
            g = _act_backward_from_output(g, s, ACT_OUT, slope_out)
        else:
            g = _activation_backward(g, s, ACT_OUT, slope_out, MATH)
        g = tl.where(mask, g, 0.0)
    return g


@triton.jit
def _dw_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, z_ptr,
    C, H, W, OH, OW, p_tiles,
    sxn, sxc, sxh, sxw, syn, syc, syh, syw, swc, swh, sww,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, slope_in, slope_out,
    KH: tl.constexpr, KW: tl.constexpr, ACT_IN: tl.constexpr, ACT_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr, MATH: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One ``[BLOCK_P, BLOCK_C]`` output tile of ``act_out(conv(act_in(x)) + b)``; ``z`` stored when STORE_Z."""
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    n, oh, ow, pmask = _pixel_tile(tl.program_id(0), p_tiles, OH * OW, OW, BLOCK_P, INDEX_64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    if INDEX_64:
        c = c.to(tl.int64)
    x_base = x_ptr + n * sxn + c[None, :] * sxc
    w_base = w_ptr + c * swc
    acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for kh in tl.static_range(KH):
        ih = oh * stride_h - pad_h + kh * dil_h
        hmask = pmask & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = ow * stride_w - pad_w + kw * dil_w
            m = (hmask & (iw >= 0) & (iw < W))[:, None] & cmask[None, :]
            xv = tl.load(x_base + (ih * sxh + iw * sxw)[:, None], mask=m, other=0.0).to(ACC)
            a = tl.where(m, _activation(xv, ACT_IN, slope_in, MATH), 0.0)
            wv = tl.load(w_base + kh * swh + kw * sww, mask=cmask, other=0.0).to(ACC)
            acc += a * wv[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cmask, other=0.0).to(ACC)[None, :]
    y_offsets = n * syn + c[None, :] * syc + (oh * syh + ow * syw)[:, None]
    mask = pmask[:, None] & cmask[None, :]
    if STORE_Z:
        tl.store(z_ptr + y_offsets, _cast_to(acc, z_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    y = _activation(acc, ACT_OUT, slope_out, MATH)
    tl.store(y_ptr + y_offsets, _cast_to(y, y_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _dw_bwd_dx_kernel(
    gy_ptr, s_ptr, x_ptr, w_ptr, dx_ptr,
    C, H, W, OH, OW, p_tiles,
    sgn, sgc, sgh, sgw, ssn, ssc, ssh, ssw, sxn, sxc, sxh, sxw, sdn, sdc, sdh, sdw, swc, swh, sww,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, slope_in, slope_out,
    KH: tl.constexpr, KW: tl.constexpr, ACT_IN: tl.constexpr, ACT_OUT: tl.constexpr,
    SAVED_IS_OUTPUT: tl.constexpr, MATH: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One ``[BLOCK_P, BLOCK_C]`` tile of ``dx = act_in'(x) * sum_taps gz[oh, ow] * w[tap]``.

    Input pixel (ih, iw) meets tap (kh, kw) at output row ``oh = (ih + pad_h -
    kh * dil_h) / stride_h`` when that division is exact and in range (the
    same for columns).
    """
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    n, ih, iw, pmask = _pixel_tile(tl.program_id(0), p_tiles, H * W, W, BLOCK_P, INDEX_64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    if INDEX_64:
        c = c.to(tl.int64)
    g_base = n * sgn + c[None, :] * sgc
    s_base = n * ssn + c[None, :] * ssc
    w_base = w_ptr + c * swc
    acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for kh in tl.static_range(KH):
        oh_scaled = ih + pad_h - kh * dil_h
        oh = oh_scaled // stride_h  # oh_scaled >= 0 wherever it is used: floor and truncation agree
        hmask = pmask & (oh_scaled >= 0) & (oh * stride_h == oh_scaled) & (oh < OH)
        for kw in tl.static_range(KW):
            ow_scaled = iw + pad_w - kw * dil_w
            ow = ow_scaled // stride_w
            m = (hmask & (ow_scaled >= 0) & (ow * stride_w == ow_scaled) & (ow < OW))[:, None] & cmask[None, :]
            g = _grad_of_z(
                gy_ptr, s_ptr, g_base + (oh * sgh + ow * sgw)[:, None], s_base + (oh * ssh + ow * ssw)[:, None], m,
                ACT_OUT, SAVED_IS_OUTPUT, slope_out, MATH, ACC,
            )
            wv = tl.load(w_base + kh * swh + kw * sww, mask=cmask, other=0.0).to(ACC)
            acc += g * wv[None, :]
    mask = pmask[:, None] & cmask[None, :]
    xv = tl.load(x_ptr + n * sxn + c[None, :] * sxc + (ih * sxh + iw * sxw)[:, None], mask=mask, other=0.0)
    dx = _activation_backward(acc, xv.to(ACC), ACT_IN, slope_in, MATH)
    dx_offsets = n * sdn + c[None, :] * sdc + (ih * sdh + iw * sdw)[:, None]
    tl.store(dx_ptr + dx_offsets, _cast_to(dx, dx_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _dw_bwd_dw_partial_kernel(
    gy_ptr, s_ptr, x_ptr, partial_ptr,
    C, H, W, OH, OW, n_outputs, tiles_per_chunk,
    sgn, sgc, sgh, sgw, ssn, ssc, ssh, ssw, sxn, sxc, sxh, sxw,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, slope_in, slope_out,
    KH: tl.constexpr, KW: tl.constexpr, ACT_IN: tl.constexpr, ACT_OUT: tl.constexpr,
    SAVED_IS_OUTPUT: tl.constexpr, MATH: tl.constexpr, INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Stage 1 of dw/db: partial[chunk, tap, c] = sum over the chunk's outputs of gz * act_in(x at the tap).

    Axis 0 is the tap (``KH * KW`` of them, plus one for the bias, which sums
    gz alone), so the programs that read one chunk run side by side and share
    its loads in the cache; axis 1 the chunk of flattened (n, oh, ow) outputs,
    axis 2 the channel block.
    """
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    tap = tl.program_id(0)
    chunk = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    kh = tap // KW
    kw = tap % KW
    if INDEX_64:
        c = c.to(tl.int64)
    is_tap = (c * 0 + tap) < KH * KW  # per lane (masks are tensors); the program of tap KH * KW sums db
    acc = tl.zeros([BLOCK_C], ACC)
    for t in range(0, tiles_per_chunk):
        q = (chunk * tiles_per_chunk + t) * BLOCK_P + tl.arange(0, BLOCK_P)
        qmask = q < n_outputs
        if INDEX_64:
            q = q.to(tl.int64)
        n = q // (OH * OW)
        r = q % (OH * OW)
        oh = r // OW
        ow = r % OW
        m = qmask[:, None] & cmask[None, :]
        g = _grad_of_z(
            gy_ptr, s_ptr, (n * sgn + oh * sgh + ow * sgw)[:, None] + c[None, :] * sgc,
            (n * ssn + oh * ssh + ow * ssw)[:, None] + c[None, :] * ssc, m, ACT_OUT, SAVED_IS_OUTPUT, slope_out, MATH,
            ACC,
        )
        ih = oh * stride_h - pad_h + kh * dil_h
        iw = ow * stride_w - pad_w + kw * dil_w
        xm = (qmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))[:, None] & (cmask & is_tap)[None, :]
        xv = tl.load(x_ptr + (n * sxn + ih * sxh + iw * sxw)[:, None] + c[None, :] * sxc, mask=xm, other=0.0)
        a = tl.where(xm, _activation(xv.to(ACC), ACT_IN, slope_in, MATH), 0.0)
        a = tl.where(is_tap[None, :], a, 1.0)
        acc += tl.sum(g * a, axis=0)
    row = (chunk * (KH * KW + 1) + tap).to(tl.int64) * C
    tl.store(partial_ptr + row + c, acc, mask=cmask)


@triton.jit
def _dw_bwd_dw_final_kernel(
    partial_ptr, dw_ptr, db_ptr, C, n_chunks, n_values, swc, swh, sww,
    KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_FP64: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Stage 2 of dw/db: adds the partial rows in chunk order (deterministic), stores dw[c, tap] and db[c].

    A chunk's row holds ``(KH * KW + 1) * C`` values (tap-major); ``n_values``
    of them are used: ``(KH * KW + HAS_BIAS) * C``.
    """
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = j < n_values
    row = (KH * KW + 1) * C
    acc = tl.zeros([BLOCK], ACC)
    ptrs = partial_ptr + j
    for _ in range(0, n_chunks):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += row  # pointer arithmetic is 64-bit: no int32 product over all the chunks
    tap = j // C
    c = j % C
    is_weight = tap < KH * KW
    w_offsets = c * swc + (tap // KW) * swh + (tap % KW) * sww
    tl.store(dw_ptr + w_offsets, _cast_to(acc, dw_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask & is_weight)
    if HAS_BIAS:
        tl.store(db_ptr + c, _cast_to(acc, db_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask & (tap == KH * KW))
