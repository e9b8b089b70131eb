"""Depthwise 2-d convolution with the preceding activation applied on load (PaddlePaddle's fuse_relu_depthwise_conv).

``y = act_out(conv2d(act_in(x), w, b, groups=C))`` for a weight ``[C, 1, KH, KW]``
(depth multiplier 1). The activation output ``act_in(x)`` is never written:
forward applies it to each input value as it is loaded, and backward
recomputes it (for the weight gradient) and its derivative (for the input
gradient) from the saved ``x``.

Addressing. Every tensor is addressed through its four strides (n, c, h, w),
so NCHW, channels_last and other strided layouts share one kernel; a stride of
1 is specialised by Triton, which makes the contiguous axis of a tile
vectorised. The forward and dx programs take a ``BLOCK_H x BLOCK_W`` block of
pixels of one image by BLOCK_C channels: the launcher makes BLOCK_C wide for
channels_last (channels are contiguous) and BLOCK_W wide for NCHW (columns
are). Convolution strides are compile-time (1 and 2 are what networks use),
so output <-> input rows are shifts. Kernel rows are a loop, the taps of a
row unrolled; loads of neighbouring pixels hit the cache lines earlier taps
brought in, so DRAM sees each input about once.

Padding is zeros *after* the activation (conv2d pads ``act_in(x)``), so
masked lanes are zeroed after ``act_in``: sigmoid(0) or hardsigmoid(0) are not 0.

AFFINE_IN (batch norm on load): ``x`` is normalised as it is loaded, ``z =
(x - mean[c]) * scale[c] + bias[c]`` from batch norm's per-channel table
(``t_ptr``: rows mean, 1/std, scale, bias; kernels/batch_norm.py), and
``act_in`` applies to ``z``: a BN -> activation -> depthwise conv block whose
normalised activation is never written. The dx kernel then writes ``dz``
(the gradient at the batch norm's output), which batch norm's backward turns
into dx.

Kernels:

* ``_dw_fwd_kernel``: one output tile, all taps; optional bias, ``act_out``
  epilogue, and a store of the pre-activation ``z`` when ``act_out``'s
  derivative needs it.
* ``_dw_bwd_dx_kernel``: one input tile: the transposed gather of
  ``gz = d act_out`` over the taps whose stride lines up, times
  ``w``, then ``act_in'(x)`` (torch's selects for relu & co.).
* ``_dw_bwd_dw_partial_kernel``: the weight and bias gradients, a deterministic
  reduction in one launch. One program per (tap, chunk of pixels, channel
  block) sums ``gz * act_in(x)`` over its chunk (the bias "tap" sums ``gz``)
  into a float32 partial row; the last program of each (tap, channel block)
  to finish adds the rows up in chunk order and writes ``dw``/``db`` in their
  dtype ("last program merges", as batch norm's reductions: kernels/bn_merge.py).
  Each program stores its partial, then arrives at its (channel block, tap)'s
  int32 counter: a CTA barrier, then an atomic add with acq_rel semantics at
  GPU scope, whose release publishes the program's partial and whose acquire,
  in the program that reads back ``n_chunks - 1``, makes every other chunk's
  partial visible to it. That program merges and puts the counter back to 0,
  so the counters need no clearing between launches or CUDA graph replays.
  Nothing waits for another program, so the grid may take several waves.
"""

import triton
import triton.language as tl

from .activations import _act_backward_from_output, _activation, _activation_backward
from .bn_merge import _bn_arrive, _bn_only_if
from .cast import _cast_to
from .kit import _acc_dtype, _float_arg


@triton.jit
def _spatial_tile(pid, tiles_w, tiles_per_image, rows, cols, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
                  INDEX_64: tl.constexpr):
    """(image n, row, column, mask) of the ``BLOCK_H x BLOCK_W`` pixels of program ``pid``, flattened to
    ``[BLOCK_H * BLOCK_W, 1]`` lanes (images are folded into axis 0). Lane -> (row, column) is a shift and a
    mask (BLOCK_W is a power of two), so no lane divides by a runtime size. Pixel values are 2-D columns, so
    they broadcast against the channel row without a layout conversion (through shared memory) per tap."""
    n = pid // tiles_per_image
    t = pid % tiles_per_image
    lane = tl.arange(0, BLOCK_H * BLOCK_W)[:, None]  # 2-D from the start: no per-tap layout conversions
    row = (t // tiles_w) * BLOCK_H + lane // BLOCK_W
    col = (t % tiles_w) * BLOCK_W + lane % BLOCK_W
    mask = (row < rows) & (col < cols)
    if INDEX_64:
        n = n.to(tl.int64)
        row = row.to(tl.int64)
        col = col.to(tl.int64)
    return n, row, col, mask


@triton.jit
def _table_row(t_ptr, row, c, cmask, C, BLOCK_P: tl.constexpr, CHANNELS_FASTEST: tl.constexpr, ACC: tl.constexpr):
    """Row ``row`` of batch norm's per-channel table for the tile's channels, in the tile's layout
    (:func:`_tap_weights`' reasoning: broadcast where channels are the fastest axis)."""
    return _tap_weights(t_ptr + row * C + c, cmask, BLOCK_P, CHANNELS_FASTEST, ACC)


@triton.jit
def _grad_of_z(gy_ptr, s_ptr, g_offsets, s_offsets, mask, ACT_OUT: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr,
               slope, MATH: tl.constexpr, ACC: tl.constexpr):
    """``gz = gy * act_out'``, loaded at output offsets (0 where masked)."""
    g = tl.load(gy_ptr + g_offsets, mask=mask, other=0.0).to(ACC)
    if ACT_OUT != 0:  # IDENTITY is code 0 (kernels/codes.py)
        s = tl.load(s_ptr + s_offsets, mask=mask, other=0.0).to(ACC)
        if SAVED_IS_OUTPUT:
            g = _act_backward_from_output(g, s, ACT_OUT, slope)
        else:
            g = _activation_backward(g, s, ACT_OUT, slope, MATH)
        g = tl.where(mask, g, 0.0)
    return g


@triton.jit
def _tap_weights(w_ptrs, cmask, BLOCK_P: tl.constexpr, CHANNELS_FASTEST: tl.constexpr, ACC: tl.constexpr):
    """One tap's weights (``w_ptrs``, ``[1, BLOCK_C]``) for the tile's channels, in the tile's layout.

    Where channels are the tile's fastest axis (channels_last), a ``[1,
    BLOCK_C]`` load gets a layout of its own, and multiplying it into the
    tile converts the tile through shared memory at every tap (two barriers
    each, sm_90 compile); loaded broadcast to the tile's shape it takes the
    tile's layout, and its repeated addresses are served by one cache line per
    warp. Where pixels are fastest (NCHW) the row load already fits.
    """
    if CHANNELS_FASTEST:
        w = tl.load(tl.broadcast_to(w_ptrs, [BLOCK_P, w_ptrs.shape[1]]),
                    mask=tl.broadcast_to(cmask, [BLOCK_P, w_ptrs.shape[1]]), other=0.0)
    else:
        w = tl.load(w_ptrs, mask=cmask, other=0.0)
    return w.to(ACC)


@triton.jit
def _dw_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, t_ptr,
    C, H, W, OH, OW, tiles_w, tiles_per_image,
    sxn, sxc, sxh, sxw, syn, syc, syh, syw, swc, swh, sww,
    pad_h, pad_w, dil_h, dil_w, slope_hi, slope_lo,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, ACT_IN: tl.constexpr,
    ACT_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr, MATH: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_FP64: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, CHANNELS_FASTEST: tl.constexpr, AFFINE_IN: tl.constexpr,
):
    """One output tile (``BLOCK_H x BLOCK_W`` pixels by BLOCK_C channels) of ``act_out(conv(act_in(x)) + b)``;
    ``z`` stored when STORE_Z.

    Kernel rows are a loop and the taps of a row are unrolled: the loads of
    one row are in flight together, and registers stay bounded for 7x7.
    """
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    slope = _float_arg(slope_hi, slope_lo, ACC_FP64)  # leaky_relu's, for act_in and act_out alike
    n, oh, ow, pmask = _spatial_tile(tl.program_id(0), tiles_w, tiles_per_image, OH, OW, BLOCK_H, BLOCK_W, INDEX_64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    cmask = c < C
    if INDEX_64:
        c = c.to(tl.int64)
    x_base = x_ptr + n * sxn + c * sxc
    w_base = w_ptr + c * swc  # [1, BLOCK_C]: weights load straight into the tile's layout
    if AFFINE_IN:  # batch norm's per-channel mean, scale and bias, loaded once per program
        t_mean = _table_row(t_ptr, 0, c, cmask, C, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
        t_scale = _table_row(t_ptr, 2, c, cmask, C, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
        t_bias = _table_row(t_ptr, 3, c, cmask, C, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
    acc = tl.zeros([BLOCK_H * BLOCK_W, BLOCK_C], ACC)
    for kh in range(0, KH):
        ih = oh * STRIDE_H - pad_h + kh * dil_h
        hmask = pmask & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = ow * STRIDE_W - pad_w + kw * dil_w
            m = hmask & (iw >= 0) & (iw < W) & cmask
            xv = tl.load(x_base + ih * sxh + iw * sxw, mask=m, other=0.0).to(ACC)
            if AFFINE_IN:  # (x - mean) first, as batch norm computes it: exact near the mean
                xv = (xv - t_mean) * t_scale + t_bias
            a = tl.where(m, _activation(xv, ACT_IN, slope, MATH), 0.0)
            wv = _tap_weights(w_base + kh * swh + kw * sww, cmask, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
            acc += a * wv
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cmask, other=0.0).to(ACC)
    y_offsets = n * syn + c * syc + oh * syh + ow * syw
    mask = pmask & cmask
    if STORE_Z:
        tl.store(z_ptr + y_offsets, _cast_to(acc, z_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)
    y = _activation(acc, ACT_OUT, slope, MATH)
    tl.store(y_ptr + y_offsets, _cast_to(y, y_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _dw_bwd_dx_kernel(
    gy_ptr, s_ptr, x_ptr, w_ptr, dx_ptr, t_ptr,
    C, H, W, OH, OW, tiles_w, tiles_per_image,
    sgn, sgc, sgh, sgw, ssn, ssc, ssh, ssw, sxn, sxc, sxh, sxw, sdn, sdc, sdh, sdw, swc, swh, sww,
    pad_h, pad_w, dil_h, dil_w, slope_hi, slope_lo,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, ACT_IN: tl.constexpr,
    ACT_OUT: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr, MATH: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr, CHANNELS_FASTEST: tl.constexpr, AFFINE_IN: tl.constexpr,
):
    """One input tile of ``dx = act_in'(x) * sum_taps gz[oh, ow] * w[tap]`` (with AFFINE_IN: ``dz =
    act_in'(z) * ...`` at batch norm's output ``z``, recomputed from x and the table).

    Input pixel (ih, iw) meets tap (kh, kw) at output row ``oh = (ih + pad_h -
    kh * dil_h) / STRIDE_H`` when that division is exact and in range (the
    same for columns); the strides are compile-time, so it is a shift for 2.
    """
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    slope = _float_arg(slope_hi, slope_lo, ACC_FP64)  # leaky_relu's, for act_in and act_out alike
    n, ih, iw, pmask = _spatial_tile(tl.program_id(0), tiles_w, tiles_per_image, H, W, BLOCK_H, BLOCK_W, INDEX_64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    cmask = c < C
    if INDEX_64:
        c = c.to(tl.int64)
    g_base = n * sgn + c * sgc
    s_base = n * ssn + c * ssc
    w_base = w_ptr + c * swc
    acc = tl.zeros([BLOCK_H * BLOCK_W, BLOCK_C], ACC)
    for kh in range(0, KH):
        oh_scaled = ih + pad_h - kh * dil_h
        oh = oh_scaled // STRIDE_H  # used only where oh_scaled >= 0: floor and truncation agree there
        hmask = pmask & (oh_scaled >= 0) & (oh * STRIDE_H == oh_scaled) & (oh < OH)
        for kw in tl.static_range(KW):
            ow_scaled = iw + pad_w - kw * dil_w
            ow = ow_scaled // STRIDE_W
            m = hmask & (ow_scaled >= 0) & (ow * STRIDE_W == ow_scaled) & (ow < OW) & cmask
            g = _grad_of_z(
                gy_ptr, s_ptr, g_base + oh * sgh + ow * sgw, s_base + oh * ssh + ow * ssw, m,
                ACT_OUT, SAVED_IS_OUTPUT, slope, MATH, ACC,
            )
            wv = _tap_weights(w_base + kh * swh + kw * sww, cmask, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
            acc += g * wv
    mask = pmask & cmask
    xv = tl.load(x_ptr + n * sxn + c * sxc + ih * sxh + iw * sxw, mask=mask, other=0.0).to(ACC)
    if AFFINE_IN:
        t_mean = _table_row(t_ptr, 0, c, cmask, C, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
        t_scale = _table_row(t_ptr, 2, c, cmask, C, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
        t_bias = _table_row(t_ptr, 3, c, cmask, C, BLOCK_H * BLOCK_W, CHANNELS_FASTEST, ACC)
        xv = (xv - t_mean) * t_scale + t_bias
    dx = _activation_backward(acc, xv, ACT_IN, slope, MATH)
    dx_offsets = n * sdn + c * sdc + ih * sdh + iw * sdw
    tl.store(dx_ptr + dx_offsets, _cast_to(dx, dx_ptr.dtype.element_ty, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _dw_bwd_dw_partial_kernel(
    gy_ptr, s_ptr, x_ptr, partial_ptr, dw_ptr, db_ptr, counter_ptr, t_ptr,
    C, H, W, OH, OW, n_outputs, tiles_per_chunk,
    sgn, sgc, sgh, sgw, ssn, ssc, ssh, ssw, sxn, sxc, sxh, sxw, swc, swh, sww,
    pad_h, pad_w, dil_h, dil_w, slope_hi, slope_lo,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, ACT_IN: tl.constexpr,
    ACT_OUT: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr, MATH: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_FP64: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
    MK: tl.constexpr, MERGE_LOOP: tl.constexpr, AFFINE_IN: tl.constexpr,
):
    """dw/db in one launch: partial[chunk, tap, c] = sum over the chunk's outputs of gz * act_in(x at the tap),
    then the last program of each (tap, channel block) adds the chunks' partials up and stores dw[c, tap] or db[c].

    Axis 0 is the tap (``KH * KW`` of them, plus one for the bias, which sums
    gz alone), so the programs that read one chunk run side by side and share
    its loads in the cache; axis 1 the chunk of flattened (n, oh, ow) outputs,
    axis 2 the channel block. Products accumulate per lane over the chunk and
    are summed across lanes once, at the end. counter_ptr: one int32 arrival
    counter per (channel block, tap), 0 before and after the launch.
    """
    ACC: tl.constexpr = _acc_dtype(ACC_FP64)
    slope = _float_arg(slope_hi, slope_lo, ACC_FP64)  # leaky_relu's, for act_in and act_out alike
    tap = tl.program_id(0)
    chunk = tl.program_id(1)
    c = (tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    cmask = c < C
    kh = tap // KW
    kw = tap % KW
    if INDEX_64:
        c = c.to(tl.int64)
    is_tap = (c * 0 + tap) < KH * KW  # per lane (masks are tensors); the program of tap KH * KW sums db
    if AFFINE_IN:  # the dw programs walk flattened outputs, channels a row: no tile layout to match
        t_mean = tl.load(t_ptr + c, mask=cmask, other=0.0).to(ACC)
        t_scale = tl.load(t_ptr + 2 * C + c, mask=cmask, other=0.0).to(ACC)
        t_bias = tl.load(t_ptr + 3 * C + c, mask=cmask, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for t in range(0, tiles_per_chunk):
        q = (chunk * tiles_per_chunk + t) * BLOCK_P + tl.arange(0, BLOCK_P)[:, None]
        qmask = q < n_outputs
        if INDEX_64:
            q = q.to(tl.int64)
        n = q // (OH * OW)
        r = q % (OH * OW)
        oh = r // OW
        ow = r % OW
        m = qmask & cmask
        g = _grad_of_z(
            gy_ptr, s_ptr, n * sgn + oh * sgh + ow * sgw + c * sgc, n * ssn + oh * ssh + ow * ssw + c * ssc, m,
            ACT_OUT, SAVED_IS_OUTPUT, slope, MATH, ACC,
        )
        ih = oh * STRIDE_H - pad_h + kh * dil_h
        iw = ow * STRIDE_W - pad_w + kw * dil_w
        xm = qmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & cmask & is_tap
        xv = tl.load(x_ptr + n * sxn + ih * sxh + iw * sxw + c * sxc, mask=xm, other=0.0).to(ACC)
        if AFFINE_IN:
            xv = (xv - t_mean) * t_scale + t_bias
        a = tl.where(xm, _activation(xv, ACT_IN, slope, MATH), 0.0)
        acc += g * tl.where(is_tap, a, 1.0)
    taps = tl.num_programs(0)  # KH * KW, plus one with a bias
    row = taps.to(tl.int64) * C  # a chunk's partials: taps rows of C (tap-major)
    column = partial_ptr + tap * C + c  # this program's (tap, channels) in chunk 0
    tl.store(column + chunk * row, tl.sum(acc, axis=0)[None, :], mask=cmask)
    # Arrive at this (channel block, tap)'s counter (_bn_arrive): a CTA barrier orders every thread's partial
    # store before the atomic add, whose release (acq_rel, GPU scope) publishes them; in the program that arrives
    # last, its acquire makes every other chunk's partial visible, and that program merges them (reading at L2).
    # The merge is predicated on being last rather than branched around, as batch norm's.
    last = _bn_arrive(counter_ptr + tl.program_id(2) * taps + tap, tl.num_programs(1), tap >= 0)
    total = _dw_sum_chunks(column, row, tl.num_programs(1), _bn_only_if(cmask, last), last, MK, MERGE_LOOP, ACC)
    w_offsets = c * swc + kh * swh + kw * sww
    tl.store(dw_ptr + w_offsets, _cast_to(total, dw_ptr.dtype.element_ty, EMULATE_BF16_RTNE),
             mask=_bn_only_if(cmask, last & (tap < KH * KW)))
    tl.store(db_ptr + c, _cast_to(total, db_ptr.dtype.element_ty, EMULATE_BF16_RTNE),
             mask=_bn_only_if(cmask, last & (tap == KH * KW)))


@triton.jit
def _dw_sum_chunks(column, row, n_chunks, mask, active, MK: tl.constexpr, LOOP: tl.constexpr, ACC: tl.constexpr):
    """sum over chunks k = 0 .. n_chunks of ``column[k * row]`` (``[1, BLOCK_C]`` partials), one chunk after the
    other: the order of a sequential sum whatever order the programs finished in, so dw is deterministic.

    MK chunks are loaded per step, so MK loads are in flight, but added one by
    one in chunk order. Without LOOP (n_chunks <= MK) the one step is all: no
    loop after the reduction loop, which otherwise costs the NCHW
    specialisations up to 19 registers (sm_90 compile). Partials are read at
    L2 (``.cg``: other programs of this launch wrote them); nothing is read
    where ``active`` is False (``mask`` is all False there, and the loop empty).
    """
    total = tl.zeros(mask.shape, ACC)
    if LOOP:
        for start in range(0, tl.where(active, n_chunks, 0), MK):
            total = _dw_add_chunks(total, column + start * row, row, n_chunks - start, mask, MK)
    else:
        total = _dw_add_chunks(total, column, row, n_chunks, mask, MK)
    return total


@triton.jit
def _dw_add_chunks(total, ptrs, row, left, mask, MK: tl.constexpr):
    """``total`` plus the partials ``ptrs[k * row]`` of the next ``min(MK, left)`` chunks, in chunk order.

    Chunks past the last add -0.0, which leaves every float as it is (+0.0 would turn a -0.0 into +0.0).
    """
    for k in tl.static_range(MK):
        total += tl.load(ptrs + k * row, mask=_bn_only_if(mask, k < left), other=-0.0, cache_modifier=".cg")
    return total
