"""``batch_norm_act``: batch norm (+ residual) + activation, fused (kernels/batch_norm.py).

Launches: training forward 3 (partial statistics, their merge with the
running-statistics update, the normalise + residual + activation pass); eval
forward 1. Training backward 3 (a reducing pass, a small merge, the dx pass;
2 when neither x nor the residual needs a gradient); eval backward 1, or 2
with weight/bias gradients.

Statistics are float32 (float64 for float64 inputs). Saved for backward:
x, the per-channel mean and 1/std (or the running
statistics in eval), weight and bias, plus the output y for activations
whose derivative follows from it (relu, sigmoid, tanh, leaky_relu with slope
>= 0), else the residual; the pre-activation is recomputed, never stored.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from tfuse import kernels
from tfuse._backend import Backend, interpreter_active, select_backend
from tfuse._launch import launch, target_programs
from tfuse.ops._activations import ACTIVATIONS, check_activation, grad_from_output, torch_act_
from tfuse.ops._checks import check_float_dtype, is_dense

NUM_WARPS = 4
#: Elements per tile of the normalise and dx passes, and per step of the reducing passes.
TILE_ELEMENTS = 2048
_INT32_LIMIT = 2**31 - 1


def batch_norm_act(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "relu",
    negative_slope: float = 0.01,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(batch_norm(x) + residual)``: ``torch.nn.functional.batch_norm`` fused with a residual add and an activation.

    Arguments as for ``F.batch_norm`` (``x`` of shape ``[N, C, ...]``;
    statistics over every dimension but 1, in float32 with Welford/Chan
    merging; biased variance to normalise, unbiased into ``running_var``,
    updated in place with ``momentum`` when ``training``), plus ``act``
    (relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh, identity),
    ``negative_slope`` and an optional ``residual`` of ``x``'s shape added
    before the activation. NCHW and channels_last inputs are read in place;
    the output has ``x``'s layout and dtype.

    Example:
        >>> import torch
        >>> from tfuse.functional import batch_norm_act
        >>> x, skip = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
        >>> mean, var = torch.zeros(3), torch.ones(3)
        >>> y = batch_norm_act(x, mean, var, training=True, residual=skip)
        >>> y.shape
        torch.Size([4, 3, 5, 5])
    """
    act, negative_slope = check_activation("batch_norm_act", act, negative_slope)
    for name, value in (("momentum", momentum), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"tfuse.batch_norm_act: {name} must be a number, got {type(value).__name__}")
    channels = _check_inputs(x, running_mean, running_var, weight, bias, residual, training)
    backend = select_backend(x.device, "batch_norm_act")
    if backend is Backend.TORCH:
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
        if residual is not None:
            y = y + residual
        return torch_act_(y, act, negative_slope)  # y is a fresh tensor: in place is safe
    if _strides_nsc(x) is None or not is_dense(x):
        x = x.contiguous()  # the output and gradients take x's strides, so x must be dense
    if residual is not None and _strides_nsc(residual) is None:
        residual = residual.contiguous()
    use_batch_stats = training or running_mean is None
    spec = _BatchNormSpec(
        act=act,
        negative_slope=negative_slope,
        eps=float(eps),
        momentum=float(momentum),
        use_batch_stats=use_batch_stats,
        update_running=training and running_mean is not None,
        channels=channels,
    )
    tensors = (x, weight, bias, residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _BatchNormActFunction.apply(spec, x, weight, bias, residual, running_mean, running_var)
    return _forward(spec, x, weight, bias, residual, running_mean, running_var)[0]


def _check_inputs(x, running_mean, running_var, weight, bias, residual, training) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tfuse.batch_norm_act: x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("batch_norm_act", "x", x.dtype)
    if x.dim() < 2:
        raise ValueError(f"tfuse.batch_norm_act: x must have at least 2 dimensions [N, C, ...], got shape {list(x.shape)}")
    channels = x.shape[1]
    for name, tensor in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tfuse.batch_norm_act: {name} must be a torch.Tensor or None, got {type(tensor).__name__}")
        if tensor.shape != (channels,):
            raise ValueError(f"tfuse.batch_norm_act: {name} must have shape [{channels}], got {list(tensor.shape)}")
        check_float_dtype("batch_norm_act", name, tensor.dtype)
        if tensor.device != x.device:
            raise RuntimeError(f"tfuse.batch_norm_act: {name} is on {tensor.device} but x is on {x.device}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("tfuse.batch_norm_act: give both running_mean and running_var, or neither")
    if (weight is None) != (bias is None):
        raise ValueError("tfuse.batch_norm_act: give both weight and bias (affine), or neither")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"tfuse.batch_norm_act: residual must be a torch.Tensor or None, got {type(residual).__name__}")
        check_float_dtype("batch_norm_act", "residual", residual.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"tfuse.batch_norm_act: residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
        if residual.device != x.device:
            raise RuntimeError(f"tfuse.batch_norm_act: residual is on {residual.device} but x is on {x.device}")
    if training or running_mean is None:
        values_per_channel = x.numel() // max(channels, 1)
        if values_per_channel == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
    return channels


def _strides_nsc(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(stride_n, stride_c, stride_s) of ``t`` viewed as [N, C, S]; None if the spatial dims do not merge."""
    if t.dim() == 2:
        return t.stride(0), t.stride(1), 0
    spatial = [(size, stride) for size, stride in zip(t.shape[2:], t.stride()[2:]) if size != 1]
    if not spatial:
        return t.stride(0), t.stride(1), 0
    for (outer_size, outer_stride), (inner_size, inner_stride) in zip(spatial, spatial[1:]):
        if outer_stride != inner_stride * inner_size:
            return None
    return t.stride(0), t.stride(1), spatial[-1][1]


@dataclasses.dataclass(frozen=True)
class _BatchNormSpec:
    act: str
    negative_slope: float
    eps: float
    momentum: float
    use_batch_stats: bool
    update_running: bool
    channels: int

    @property
    def from_output(self) -> bool:
        return self.act == "identity" or grad_from_output(self.act, self.negative_slope)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """x as [N, C, S] and the tiling of its (rows = N * S) x channels."""

    rows: int
    channels: int
    spatial: int
    block_r: int
    block_c: int
    chunks: int
    rows_per_chunk: int
    index_64: bool

    @property
    def channel_blocks(self) -> int:
        return -(-self.channels // self.block_c)

    @property
    def tiles(self) -> int:
        return -(-self.rows // self.block_r) * self.channel_blocks


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _geometry(x: torch.Tensor, stride_c: int) -> _Geometry:
    channels = x.shape[1]
    spatial = math.prod(x.shape[2:])
    rows = x.shape[0] * spatial
    if stride_c == 1 or spatial == 1:  # channels are contiguous: tile along them
        block_c = min(_next_power_of_2(channels), 128)
    else:  # NCHW: each channel's rows are contiguous: tile along rows
        block_c = min(_next_power_of_2(channels), 4)
    block_r = max(1, min(TILE_ELEMENTS // block_c, _next_power_of_2(rows)))
    channel_blocks = -(-channels // block_c)
    row_steps = -(-rows // block_r)
    chunks = min(row_steps, max(1, target_programs(x.device) // channel_blocks))
    rows_per_chunk = -(-row_steps // chunks) * block_r
    chunks = -(-rows // rows_per_chunk)
    largest = max(x.numel(), 1) + TILE_ELEMENTS * max(abs(s) for s in x.stride())
    return _Geometry(rows, channels, spatial, block_r, block_c, chunks, rows_per_chunk, largest >= _INT32_LIMIT)


def _forward(spec: _BatchNormSpec, x, weight, bias, residual, running_mean, running_var):
    """Runs the forward kernels; returns (y, mean, invstd) (mean/invstd None in eval)."""
    y = torch.empty_like(x)  # x is dense, so y gets exactly its strides
    if x.numel() == 0:
        return y, None, None
    stride_n, stride_c, stride_s = _strides_nsc(x)
    geometry = _geometry(x, stride_c)
    affine = weight is not None
    acc_dtype = _acc_dtype(x)
    acc_fp64 = acc_dtype == torch.float64
    if spec.use_batch_stats:
        partial_mean = torch.empty((geometry.chunks, geometry.channels), dtype=acc_dtype, device=x.device)
        partial_m2 = torch.empty_like(partial_mean)
        launch(
            kernels._bn_stats_partial_kernel,
            (geometry.channel_blocks, geometry.chunks),
            (x, partial_mean, partial_m2, geometry.rows, geometry.channels, geometry.spatial,
             stride_n, stride_c, stride_s, geometry.rows_per_chunk),
            dict(
                BLOCK_R=geometry.block_r, BLOCK_C=geometry.block_c, INDEX_64=geometry.index_64, ACC_FP64=acc_fp64,
                num_warps=NUM_WARPS,
            ),
            x.device,
        )
        mean = torch.empty(geometry.channels, dtype=acc_dtype, device=x.device)
        invstd = torch.empty_like(mean)
        final_block = min(_next_power_of_2(geometry.channels), 256)
        launch(
            kernels._bn_stats_final_kernel,
            (-(-geometry.channels // final_block),),
            (partial_mean, partial_m2, mean, invstd,
             running_mean if spec.update_running else mean, running_var if spec.update_running else invstd,
             geometry.rows, geometry.channels, geometry.rows_per_chunk, geometry.chunks, spec.eps, spec.momentum),
            dict(UPDATE_RUNNING=spec.update_running, BLOCK_C=final_block, ACC_FP64=acc_fp64, num_warps=NUM_WARPS),
            x.device,
        )
        stats = (mean, invstd)
    else:
        mean = invstd = None
        stats = (running_mean, running_var)
    res_strides = _strides_nsc(residual) if residual is not None else (0, 0, 0)
    launch(
        kernels._bn_act_fwd_kernel,
        (geometry.tiles,),
        (x, residual if residual is not None else x, y, stats[0], stats[1],
         weight if affine else x, bias if affine else x,
         geometry.rows, geometry.channels, geometry.spatial, stride_n, stride_c, stride_s, *res_strides,
         spec.eps, spec.negative_slope),
        dict(
            HAS_RESIDUAL=residual is not None, FROM_RUNNING=not spec.use_batch_stats, AFFINE=affine,
            ACT=ACTIVATIONS[spec.act], EMULATE_BF16_RTNE=x.dtype == torch.bfloat16 and interpreter_active(),
            INDEX_64=geometry.index_64, BLOCK_R=geometry.block_r, BLOCK_C=geometry.block_c, ACC_FP64=acc_fp64,
            num_warps=NUM_WARPS,
        ),
        x.device,
    )
    return y, mean, invstd


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Statistics and reductions: float32, or float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _BatchNormActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, x, weight, bias, residual, running_mean, running_var):  # type: ignore[override]
        y, mean, invstd = _forward(spec, x, weight, bias, residual, running_mean, running_var)
        ctx.spec = spec
        ctx.has_residual = residual is not None
        ctx.residual_dtype = residual.dtype if residual is not None else None
        if not spec.use_batch_stats:
            mean, invstd = running_mean, running_var
        src = y if spec.from_output else residual
        ctx.save_for_backward(x, weight, bias, src, mean, invstd)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        spec = ctx.spec
        x, weight, bias, src, mean, invstd = ctx.saved_tensors
        need_x, need_weight, need_bias, need_res = ctx.needs_input_grad[1:5]
        dx = torch.empty_like(x) if need_x else None
        dres = torch.empty_like(x, dtype=ctx.residual_dtype) if need_res else None
        dweight = torch.empty_like(weight) if need_weight else None
        dbias = torch.empty_like(bias) if need_bias else None
        if x.numel() == 0:
            return (None, dx, dweight.zero_() if need_weight else None, dbias.zero_() if need_bias else None, dres, None, None)
        stride_n, stride_c, stride_s = _strides_nsc(x)
        dy_strides = _strides_nsc(dy)
        if dy_strides is None:
            dy = dy.contiguous()
            dy_strides = _strides_nsc(dy)
        geometry = _geometry(x, stride_c)
        affine = weight is not None
        residual = src if (ctx.has_residual and not spec.from_output) else None
        res_strides = _strides_nsc(residual) if residual is not None else (0, 0, 0)
        acc_dtype = _acc_dtype(x)
        sums = torch.empty((2, geometry.chunks, geometry.channels), dtype=acc_dtype, device=x.device)
        flags = dict(
            ACC_FP64=acc_dtype == torch.float64,
            HAS_RESIDUAL=residual is not None, FROM_OUTPUT=spec.from_output, AFFINE=affine, ACT=ACTIVATIONS[spec.act],
            EMULATE_BF16_RTNE=interpreter_active(), INDEX_64=geometry.index_64,
            BLOCK_R=geometry.block_r, BLOCK_C=geometry.block_c, num_warps=NUM_WARPS,
        )
        placeholder = x
        common = (
            dy, src if src is not None else placeholder, x, residual if residual is not None else placeholder,
            mean, invstd, weight if affine else placeholder, bias if affine else placeholder,
        )
        eval_mode = not spec.use_batch_stats
        launch(
            kernels._bn_act_bwd_reduce_kernel,
            (geometry.channel_blocks, geometry.chunks),
            (*common, sums[0], sums[1], dx if dx is not None else placeholder, dres if dres is not None else placeholder,
             geometry.rows, geometry.channels, geometry.spatial, stride_n, stride_c, stride_s, *res_strides, *dy_strides,
             geometry.rows_per_chunk, spec.eps, spec.negative_slope),
            dict(FROM_RUNNING=eval_mode, WRITE_DX=eval_mode and need_x, WRITE_DRES=eval_mode and need_res, **flags),
            x.device,
        )
        needs_pass_2 = not eval_mode and (need_x or need_res)
        if need_weight or need_bias or needs_pass_2:
            coef = torch.empty(2 * geometry.channels, dtype=acc_dtype, device=x.device)
            final_block = min(_next_power_of_2(geometry.channels), 256)
            launch(
                kernels._bn_bwd_final_kernel,
                (-(-geometry.channels // final_block),),
                (sums[0], sums[1], dweight if need_weight else coef, dbias if need_bias else coef, coef,
                 geometry.rows, geometry.channels, geometry.chunks),
                dict(
                    WRITE_DWEIGHT=need_weight, WRITE_DBIAS=need_bias, BLOCK_C=final_block,
                    ACC_FP64=acc_dtype == torch.float64, num_warps=NUM_WARPS,
                ),
                x.device,
            )
        if needs_pass_2:
            launch(
                kernels._bn_act_bwd_dx_kernel,
                (geometry.tiles,),
                (*common, coef, dx if dx is not None else placeholder, dres if dres is not None else placeholder,
                 geometry.rows, geometry.channels, geometry.spatial, stride_n, stride_c, stride_s, *res_strides, *dy_strides,
                 spec.eps, spec.negative_slope),
                dict(WRITE_DX=need_x, WRITE_DRES=need_res, **flags),
                x.device,
            )
        return None, dx, dweight, dbias, dres, None, None
