"""The Triton path of ``relu_depthwise_conv2d``: tiles, launch arguments and the launches (kernels/depthwise.py).

The activation is applied to each input value as the convolution loads it:
one launch forward, and in backward one launch for dx plus one for dw/db (a
deterministic reduction whose last programs merge the partials).

With ``table`` (batch norm's per-channel [mean, 1/std, scale, bias] rows,
float32 or float64), each value is normalised before the activation
(AFFINE_IN), and the dx launch writes the gradient at the batch norm's output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tfuse import kernels
from tfuse._backend import interpreter_active
from tfuse._kit import acc_dtype, acc_fp64, emulate_bf16_rtne, needs_int64, next_power_of_2, split_float
from tfuse._launch import launch, target_programs
from tfuse.ops._activations import GradSource, math_mode
from tfuse.ops._arrivals import arrival_counters
from tfuse.ops._depthwise_args import ConvSpec, _is_channels_last, _output_size

#: Elements of a forward/dx tile (BLOCK_P x BLOCK_C).
_TILE_ELEMENTS = 1024
#: Widest channel block of a channels_last tile (channels are contiguous there).
_MAX_BLOCK_C = 128
#: Chunk partials the last program of a dw/db group loads per merge step (in flight together, added in
#: order), channels_last and NCHW: see :func:`_merge_meta`.
_MERGE_CHUNKS = 16
_MERGE_CHUNKS_NCHW = 4


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """How the forward and dx kernels cut ``rows x cols`` pixels by ``channels`` into programs."""

    block_h: int
    block_w: int
    block_c: int
    tiles_w: int
    tiles_per_image: int
    c_tiles: int

    def grid(self, images: int) -> tuple[int, int]:
        return (images * self.tiles_per_image, self.c_tiles)

    channels_fastest: bool

    def meta(self) -> dict[str, int]:
        return dict(
            BLOCK_H=self.block_h, BLOCK_W=self.block_w, BLOCK_C=self.block_c, CHANNELS_FASTEST=self.channels_fastest
        )


def _tile_elements(kernel: tuple[int, int], dtype: torch.dtype, affine: bool = False) -> int:
    """Elements of a program's tile: smaller for wide kernels and float64, whose taps hold more registers
    (the sm_90 compile spilled 5x5 at 1024: benchmarks/results/sm90-kernels.md), and for the forward of a
    batch norm on load beyond 3x3 16-bit, whose three per-channel rows (mean, scale, bias) took 5x5 bfloat16
    from 86 to 137 registers and 3x3 float32 from 80 to 110 at full tiles (sm_90 compile)."""
    elements = _TILE_ELEMENTS if kernel[1] <= 5 else _TILE_ELEMENTS // 2
    if affine and (kernel[1] > 3 or dtype.itemsize > 2):
        elements //= 2
    return elements // 2 if dtype == torch.float64 else elements


def _spatial_tiles(channels: int, rows: int, cols: int, channels_last: bool, elements: int) -> _Tiles:
    """Tiles wide in channels for channels_last (channels contiguous), wide in columns for NCHW (columns are)."""
    if channels_last:
        block_c = min(next_power_of_2(channels), _MAX_BLOCK_C, elements)
        pixels = max(1, elements // block_c)
        block_w = min(next_power_of_2(cols), pixels)
        block_h = max(1, min(next_power_of_2(rows), pixels // block_w))
    else:
        block_w = min(next_power_of_2(cols), elements)
        block_h = max(1, min(next_power_of_2(rows), elements // block_w))
        block_c = max(1, min(next_power_of_2(channels), elements // (block_h * block_w)))
    tiles_w = math.ceil(cols / block_w)
    tiles_per_image = tiles_w * math.ceil(rows / block_h)
    return _Tiles(block_h, block_w, block_c, tiles_w, tiles_per_image, math.ceil(channels / block_c), channels_last)


def _flat_blocks(channels: int, pixels: int, channels_last: bool, elements: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the dw kernel, whose programs walk flattened (n, oh, ow) outputs."""
    if channels_last:
        block_c = min(next_power_of_2(channels), _MAX_BLOCK_C, elements)
        return max(1, min(next_power_of_2(pixels), elements // block_c)), block_c
    block_p = min(next_power_of_2(pixels), elements)
    return block_p, max(1, min(next_power_of_2(channels), elements // block_p))


def _empty_like_layout(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    fmt = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
    return torch.empty(tuple(shape), dtype=x.dtype, device=x.device, memory_format=fmt)


def _largest_offset(tensors: Sequence[torch.Tensor], block: int, block_c: int, spec: ConvSpec, kernel) -> int:
    """A bound on any lane's element offset (masked lanes of edge tiles and of padding included); ``block``
    bounds a tile's extent in pixels along either axis."""
    reach = max(spec.padding) + max(spec.dilation) * max(kernel) + max(spec.stride) * (block + 1) + block
    bound = 0
    for t in tensors:
        n, c, h, w = t.shape
        extents = (n + 1, c + block_c, h + reach, w + reach)
        bound = max(bound, sum(e * abs(s) for e, s in zip(extents, t.stride())))
    return bound


def _scalars(spec: ConvSpec) -> tuple:
    """The runtime geometry and slopes every kernel takes (strides are compile-time: STRIDE_H/W)."""
    return (*spec.padding, *spec.dilation, *split_float(spec.negative_slope))


def _static_meta(spec: ConvSpec, kernel: tuple[int, int], dtype: torch.dtype) -> dict:
    return dict(
        KH=kernel[0],
        KW=kernel[1],
        STRIDE_H=spec.stride[0],
        STRIDE_W=spec.stride[1],
        ACT_IN=spec.act_in.code,
        ACT_OUT=spec.act_out.code,
        MATH=math_mode(dtype, interpreter_active()),
        ACC_FP64=acc_fp64(dtype),
    )


def _forward_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec, table: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, c, h, w = x.shape
    kernel = (weight.shape[2], weight.shape[3])
    oh, ow = (_output_size((h, w)[i], kernel[i], spec.stride[i], spec.padding[i], spec.dilation[i]) for i in range(2))
    y = _empty_like_layout(x, (n, c, oh, ow))
    source = spec.saved_output
    z = _empty_like_layout(x, (n, c, oh, ow)) if source is GradSource.INPUT else None
    if y.numel() == 0:
        return y, (y if source is GradSource.OUTPUT else z)
    tiles = _spatial_tiles(c, oh, ow, _is_channels_last(x), _tile_elements(kernel, x.dtype, table is not None))
    block = max(tiles.block_h, tiles.block_w)
    launch(
        kernels._dw_fwd_kernel,
        tiles.grid(n),
        (
            x,
            weight,
            bias if bias is not None else weight,
            y,
            z if z is not None else y,
            table if table is not None else weight,
            c,
            h,
            w,
            oh,
            ow,
            tiles.tiles_w,
            tiles.tiles_per_image,
            *x.stride(),
            *y.stride(),
            weight.stride(0),
            weight.stride(2),
            weight.stride(3),
            *_scalars(spec),
        ),
        dict(
            _static_meta(spec, kernel, x.dtype),
            HAS_BIAS=bias is not None,
            STORE_Z=z is not None,
            INDEX_64=needs_int64(_largest_offset((x, y), block, tiles.block_c, spec, kernel)),
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            AFFINE_IN=table is not None,
            **tiles.meta(),
        ),
        x.device,
    )
    return y, (y if source is GradSource.OUTPUT else z)


def _backward_triton(
    gy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved_out: torch.Tensor | None,
    spec: ConvSpec,
    needed: tuple[bool, bool, bool],
    table: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dw, db), None where not ``needed``; with ``table``, the first is the gradient at batch norm's output."""
    n, c, h, w = x.shape
    _, _, oh, ow = gy.shape
    kernel = (weight.shape[2], weight.shape[3])
    saved = saved_out if saved_out is not None else gy  # an unread placeholder when act_out is identity
    meta = dict(
        _static_meta(spec, kernel, x.dtype),
        SAVED_IS_OUTPUT=spec.saved_output is GradSource.OUTPUT,
        AFFINE_IN=table is not None,
    )
    table_arg = table if table is not None else weight  # an unread placeholder without AFFINE_IN
    channels_last = _is_channels_last(x)
    dx = dw = db = None
    if needed[0]:
        dx = _empty_like_layout(x, x.shape)
        if dx.numel():
            tiles = _spatial_tiles(c, h, w, channels_last, _tile_elements(kernel, x.dtype))
            block = max(tiles.block_h, tiles.block_w)
            launch(
                kernels._dw_bwd_dx_kernel,
                tiles.grid(n),
                (
                    gy,
                    saved,
                    x,
                    weight,
                    dx,
                    table_arg,
                    c,
                    h,
                    w,
                    oh,
                    ow,
                    tiles.tiles_w,
                    tiles.tiles_per_image,
                    *gy.stride(),
                    *saved.stride(),
                    *x.stride(),
                    *dx.stride(),
                    weight.stride(0),
                    weight.stride(2),
                    weight.stride(3),
                    *_scalars(spec),
                ),
                dict(
                    meta,
                    INDEX_64=needs_int64(_largest_offset((gy, saved, x, dx), block, tiles.block_c, spec, kernel)),
                    EMULATE_BF16_RTNE=emulate_bf16_rtne(),
                    **tiles.meta(),
                ),
                x.device,
            )
    want_bias = needed[2] and bias is not None
    if needed[1] or want_bias:
        dw = torch.empty_like(weight)
        db = torch.empty_like(bias) if bias is not None else None
        _weight_grads(gy, saved, x, dw, db, kernel, spec, meta, channels_last, table_arg)
    return dx, dw if needed[1] else None, db if want_bias else None


def _weight_grads(gy, saved, x, dw, db, kernel, spec: ConvSpec, meta, channels_last: bool, table) -> None:  # type: ignore[no-untyped-def]
    """dw (and db) in one launch: partial rows per chunk of outputs, summed in chunk order by the last program
    of each (tap, channel block) to finish (kernels/depthwise.py)."""
    n, c, h, w = x.shape
    _, _, oh, ow = gy.shape
    taps = kernel[0] * kernel[1]
    n_outputs = n * oh * ow
    if n_outputs == 0 or c == 0:
        dw.zero_()
        if db is not None:
            db.zero_()
        return
    block_p, block_c = _flat_blocks(c, n_outputs, channels_last, _tile_elements(kernel, x.dtype))
    c_tiles = math.ceil(c / block_c)
    rows = taps + (db is not None)  # partial rows per chunk: the taps, and the bias
    n_chunks, tiles_per_chunk = _chunks(math.ceil(n_outputs / block_p), rows * c_tiles, x.device)
    partial = torch.empty((n_chunks, rows, c), dtype=acc_dtype(x.dtype), device=x.device)
    largest = max(_largest_offset((gy, saved, x), 1, block_c, spec, kernel), n_outputs + 2 * block_p)
    launch(
        kernels._dw_bwd_dw_partial_kernel,
        (rows, n_chunks, c_tiles),
        (
            gy,
            saved,
            x,
            partial,
            dw,
            db if db is not None else dw,
            arrival_counters(rows * c_tiles, x.device),
            table,
            c,
            h,
            w,
            oh,
            ow,
            n_outputs,
            tiles_per_chunk,
            *gy.stride(),
            *saved.stride(),
            *x.stride(),
            dw.stride(0),
            dw.stride(2),
            dw.stride(3),
            *_scalars(spec),
        ),
        dict(
            meta,
            INDEX_64=needs_int64(largest),
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            BLOCK_P=block_p,
            BLOCK_C=block_c,
            **_merge_meta(n_chunks, channels_last),
        ),
        x.device,
    )


def _merge_meta(n_chunks: int, channels_last: bool) -> dict:
    """The merge step of the dw/db reduction's last programs: MK chunk partials loaded at once (in flight
    together, then added in chunk order), and MERGE_LOOP only where one step does not cover every chunk.

    A step holds about MK loads per thread. The NCHW specialisations, whose
    reduction loop needs 53-62 registers (a quotient and a remainder per
    output), went past their bound of 64 (up to 75, sm_90 compile) with steps
    of 8 or 16 or a merge loop of 8, not with steps of 4; the channels_last
    ones (about 32) take steps of 16 at no cost. channels_last is where wide
    steps count: wide channel blocks, and many chunks (58 in the roofline's cases).
    """
    step = min(_MERGE_CHUNKS if channels_last else _MERGE_CHUNKS_NCHW, next_power_of_2(n_chunks))
    return dict(MK=step, MERGE_LOOP=n_chunks > step)


def _chunks(tiles: int, programs_per_chunk: int, device: torch.device) -> tuple[int, int]:
    """(chunks, tiles per chunk) of the dw/db reduction: about two programs per target program (target_programs),
    at most 65535 chunks (a grid axis), and no empty chunk."""
    n_chunks = max(1, min(tiles, 65535, 2 * target_programs(device) // programs_per_chunk))
    tiles_per_chunk = math.ceil(tiles / n_chunks)
    return math.ceil(tiles / tiles_per_chunk), tiles_per_chunk
