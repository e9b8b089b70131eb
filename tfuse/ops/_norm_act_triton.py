"""The Triton path of ``group_norm_act`` and ``layer_norm_act``: views, tilings, launches and the autograd
Function (kernels/norm_act.py).

x is read in place when it is contiguous (group norm: NCHW; layer norm:
rows of the normalised size) or, for group norm, channels innermost
(channels_last); any other layout is copied to contiguous first. The
residual and dy take x's layout (copied when theirs differs).

Launches (see kernels/norm_act.py): forward 1, or 2 when a group norm has
too few rows (samples x groups) to fill the device and its rows are split;
backward 1 (2 when split), plus one ``sum`` over the rows of the
per-channel partials when weight or bias needs a gradient. Saved for
backward: x, weight, bias, the rows' mean and 1/std, and the output (for
activations whose derivative follows from it) or else the residual; the
pre-activation is recomputed.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.autograd.function import once_differentiable

from tfuse import kernels
from tfuse._kit import (
    NUM_WARPS,
    acc_dtype,
    acc_fp64,
    emulate_bf16_rtne,
    needs_int64,
    next_power_of_2,
    num_warps,
    split_float,
)
from tfuse._launch import LaunchPlan, target_programs
from tfuse.kernels import codes
from tfuse.ops._activations import GradSource
from tfuse.ops._checks import affine_pair
from tfuse.ops._norm_act_checks import NormActCall

#: Elements of a looping program's tile, and the largest row (group) one program holds in registers whole.
_TILE = 2048
_MAX_ONE_TILE = 8192
#: Most chunks a group norm row is split into (the normalise kernel merges them in one vector).
_MAX_SPLITS = 256
#: Elements each thread holds of a tile (8 bfloat16: one 128-bit access).
_ELEMENTS_PER_THREAD = 8


@dataclasses.dataclass(frozen=True)
class NormView:
    """x as ``[N, G, A, B]`` rows (kernels/norm_act.py): where the channel is, the extents and strides."""

    ch: int  # codes.NORM_CH_A or codes.NORM_CH_B
    rows: int  # N * G
    groups: int
    a: int
    b: int
    s_n: int
    s_g: int
    s_a: int
    channels: int  # elements of weight and bias

    @property
    def row_length(self) -> int:
        return self.a * self.b


@dataclasses.dataclass(frozen=True)
class NormPlan:
    """The tiling and grids of one view, dtype and device."""

    ba: int
    bb: int
    one_tile: bool
    a_per: int
    splits: int
    s_pad: int
    rows_per_prog: int  # backward: rows of one program (layer norm sums d(weight) over them in registers)
    programs: int  # backward grid axis 0
    warps: int
    index_64: bool

    @property
    def split(self) -> bool:
        return self.splits > 1


def _channels_innermost(x: torch.Tensor) -> bool:
    """channels_last (4-D), channels_last_3d (5-D) or their like: dimension 1 has stride 1, the rest dense."""
    if x.dim() < 3:
        return False
    return x.permute(0, *range(2, x.dim()), 1).is_contiguous()


def norm_view(x: torch.Tensor, call: NormActCall) -> tuple[torch.Tensor, NormView]:
    """x in a layout the kernels read (itself, or a contiguous copy) and its view."""
    if call.normalized_ndim:  # layer norm: rows of D contiguous elements
        x = x.contiguous()
        d = call.channels
        return x, NormView(codes.NORM_CH_B, x.numel() // d, 1, 1, d, d, 0, d, d)
    n, c = x.shape[0], x.shape[1]
    pixels = math.prod(x.shape[2:])
    g = call.groups
    cg = c // g
    if not x.is_contiguous() and _channels_innermost(x):
        return x, NormView(codes.NORM_CH_B, n * g, g, pixels, cg, pixels * c, cg, c, c)
    x = x.contiguous()
    return x, NormView(codes.NORM_CH_A, n * g, g, cg, pixels, c * pixels, cg * pixels, pixels, c)


def in_layout_of(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` (x's shape) if laid out as x, else a copy in x's layout (x is dense, so empty_like keeps it)."""
    return t if t.stride() == x.stride() else torch.empty_like(x, dtype=t.dtype).copy_(t)


_plans: dict[tuple, NormPlan] = {}
_MAX_PLANS = 256


def norm_plan(view: NormView, dtype: torch.dtype, device: torch.device, numel: int) -> NormPlan:
    """Tiles, splits and backward grid for ``view`` (cached: a layer calls with one shape step after step)."""
    target = target_programs(device)
    key = (view, dtype, target, numel)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _new_plan(view, dtype, target, numel)
    return plan


def _new_plan(view: NormView, dtype: torch.dtype, target: int, numel: int) -> NormPlan:
    wide = dtype == torch.float64  # float64 tiles hold twice the registers
    tile, one_tile_max = (_TILE // 2, _MAX_ONE_TILE // 2) if wide else (_TILE, _MAX_ONE_TILE)
    pa, pb = next_power_of_2(view.a), next_power_of_2(view.b)
    one_tile = pa * pb <= one_tile_max
    if one_tile:
        ba, bb = pa, pb
    else:
        bb = min(pb, tile)
        ba = max(1, min(pa, tile // bb))
    splits, a_per = 1, view.a
    if not one_tile and view.rows < target:  # too few rows to fill the device: split them along A
        wanted = min(math.ceil(target / view.rows), math.ceil(view.a / ba), _MAX_SPLITS)
        a_per = math.ceil(math.ceil(view.a / wanted) / ba) * ba
        splits = math.ceil(view.a / a_per)
    warps = num_warps(ba * bb, _ELEMENTS_PER_THREAD)
    layer_norm = view.groups == 1 and view.ch == codes.NORM_CH_B
    if layer_norm and one_tile and ba * bb < NUM_WARPS * 32 * _ELEMENTS_PER_THREAD:
        # A short row (ConvNeXt's 96 to 384 channels) over 4 warps leaves 1-2 elements per thread, 16-bit
        # accesses (sm_90 compile); fewer warps give each thread 4-8 contiguous elements.
        warps = max(1, ba * bb // (32 * _ELEMENTS_PER_THREAD))
    if layer_norm:  # a block of rows per backward program; as many warps resident as with 4-warp programs
        programs = max(1, min(view.rows, target * NUM_WARPS // warps))
        rows_per_prog = math.ceil(view.rows / programs)
        programs = math.ceil(view.rows / rows_per_prog)
    else:
        programs, rows_per_prog = view.rows, 1
    reach = numel + ba * max(view.s_a, 1) + bb
    return NormPlan(
        ba=ba,
        bb=bb,
        one_tile=one_tile,
        a_per=a_per,
        splits=splits,
        s_pad=next_power_of_2(splits),
        rows_per_prog=rows_per_prog,
        programs=programs,
        warps=warps,
        index_64=needs_int64(reach),
    )


def _geometry(view: NormView) -> tuple[int, ...]:
    return (view.groups, view.a, view.b, view.s_n, view.s_g, view.s_a)


class Prepared:
    """What every call with one shape, layout, dtype and set of options launches with, built once.

    A layer calls with the same of these step after step: its view, tiling,
    launch plans (kernel, grid and compile-time switches, with Triton's
    launch prepared) and constant arguments are looked up, not rebuilt; a
    call allocates its outputs and launches.
    """

    __slots__ = ("acc", "backward_plans", "copies", "fwd", "fwd_tail", "geometry", "plan", "stats", "view")

    def __init__(self, x: torch.Tensor, call: NormActCall, affine: bool, has_residual: bool) -> None:
        dense, self.view = norm_view(x, call)
        self.copies = dense is not x  # a layout the kernels do not read: each call copies x to contiguous
        view = self.view
        self.plan = plan = norm_plan(view, x.dtype, x.device, x.numel())
        self.acc = acc_dtype(x.dtype)
        self.geometry = (*_geometry(view), plan.a_per)
        common = dict(BA=plan.ba, BB=plan.bb, INDEX_64=plan.index_64, ACC_FP64=acc_fp64(x.dtype), num_warps=plan.warps)
        grid = (view.rows, plan.splits)
        self.stats = LaunchPlan(kernels._na_stats_kernel, grid, common) if plan.split else None
        switches = dict(
            CH=view.ch,
            AFFINE=affine,
            HAS_RESIDUAL=has_residual,
            ACT=call.act.code,
            SPLIT=plan.split,
            S_PAD=plan.s_pad,
            ONE_TILE=plan.one_tile,
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
        )
        self.fwd = LaunchPlan(kernels._na_fwd_kernel, grid, dict(common, **switches))
        self.fwd_tail = (*self.geometry, *split_float(call.eps), *split_float(call.negative_slope))
        self.backward_plans: dict[tuple, tuple] = {}


_prepared: dict[tuple, Prepared] = {}


def prepared(x: torch.Tensor, call: NormActCall, affine: bool, has_residual: bool) -> Prepared:
    """The :class:`Prepared` of a call (cached by shape, strides, dtype, device and options)."""
    key = (x.shape, x.stride(), x.dtype, x.device, call, affine, has_residual)
    prep = _prepared.get(key)
    if prep is None:
        if len(_prepared) >= _MAX_PLANS:
            _prepared.clear()
        prep = _prepared[key] = Prepared(x, call, affine, has_residual)
    return prep


def clear_plans() -> None:
    """Forgets every cached tiling and launch plan (tests that change the tile limits call it)."""
    _plans.clear()
    _prepared.clear()


def forward(x, weight, bias, residual, call: NormActCall, out_dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """(y, mean, 1/std, x as read, residual as read, prepared): weight and bias dense (or None)."""
    prep = prepared(x, call, weight is not None, residual is not None)
    if prep.copies:
        x = x.contiguous()
    if residual is not None:
        residual = in_layout_of(residual, x)
    device = x.device
    rows = prep.view.rows
    y = torch.empty_like(x, dtype=out_dtype)
    stats = torch.empty((2, rows), dtype=prep.acc, device=device)  # one allocation: mean, 1/std
    mean, rstd = stats[0], stats[1]
    part = mean
    if prep.stats is not None:
        part = torch.empty(rows * prep.plan.splits * 2, dtype=prep.acc, device=device)
        prep.stats((x, part, *prep.geometry), device)
    placeholder = weight if weight is not None else x
    res = residual if residual is not None else x
    bias_arg = bias if bias is not None else placeholder
    prep.fwd((x, res, y, placeholder, bias_arg, part, mean, rstd, *prep.fwd_tail), device)
    return y, mean, rstd, x, residual, prep


def _backward_plans(prep: Prepared, call: NormActCall, x: torch.Tensor, needs: tuple, has_src: bool, affine: bool):  # type: ignore[no-untyped-def]
    """(reduce/dx LaunchPlan, split dx LaunchPlan or None, d(weight) in memory, partial rows), built once."""
    key = (needs, has_src, affine)
    found = prep.backward_plans.get(key)
    if found is not None:
        return found
    view, plan = prep.view, prep.plan
    need_x, need_w, need_b, need_res = needs
    need_wb = (need_w or need_b) and affine
    in_memory = need_wb and view.ch == codes.NORM_CH_B and plan.bb < view.b
    if view.ch == codes.NORM_CH_A:
        part_rows = view.rows // view.groups
    else:
        part_rows = plan.programs // view.groups * plan.splits
    from_output = call.act.grad_source(call.negative_slope) is GradSource.OUTPUT
    common = dict(
        CH=view.ch,
        AFFINE=affine,
        HAS_RESIDUAL=has_src and not from_output,
        FROM_OUTPUT=from_output,
        ACT=call.act.code,
        BA=plan.ba,
        BB=plan.bb,
        INDEX_64=plan.index_64,
        ACC_FP64=acc_fp64(x.dtype),
        EMULATE_BF16_RTNE=emulate_bf16_rtne(),
        num_warps=plan.warps,
    )
    switches = dict(
        SPLIT=plan.split,
        ONE_TILE=plan.one_tile,
        WRITE_DX=need_x and not plan.split,
        WRITE_DRES=need_res,
        WRITE_DWB=need_wb,
        DWB_IN_MEMORY=in_memory,
    )
    reduce = LaunchPlan(kernels._na_bwd_kernel, (plan.programs, plan.splits), dict(common, **switches))
    dx_plan = None
    if plan.split and need_x:
        dx_plan = LaunchPlan(kernels._na_bwd_dx_kernel, (view.rows, plan.splits), dict(common, S_PAD=plan.s_pad))
    found = prep.backward_plans[key] = (reduce, dx_plan, in_memory, part_rows)
    return found


def backward(dy, x, weight, bias, src, mean, rstd, prep: Prepared, call: NormActCall, needs, res_dtype):  # type: ignore[no-untyped-def]
    """(dx, dweight, dbias, dresidual), None where not needed; ``src``: the saved output or residual."""
    need_x, need_w, need_b, need_res = needs
    dy = in_layout_of(dy, x)
    device = x.device
    view, plan, acc = prep.view, prep.plan, prep.acc
    affine = weight is not None
    reduce, dx_plan, in_memory, part_rows = _backward_plans(prep, call, x, needs, src is not None, affine)
    dx = torch.empty_like(x) if need_x else None
    dres = torch.empty_like(x, dtype=res_dtype) if need_res else None
    need_wb = (need_w or need_b) and affine
    if need_wb:
        # One [rows, 2, C] tensor (d(weight) then d(bias) partials in each row): one sum reduces both.
        partials = (torch.zeros if in_memory else torch.empty)((part_rows, 2, view.channels), dtype=acc, device=device)
        dw_part, db_part = partials[:, 0], partials[:, 1]
    else:
        partials = dw_part = db_part = mean
    part = torch.empty(view.rows * plan.splits * 2, dtype=acc, device=device) if plan.split else mean
    placeholder = weight if affine else x
    bias_arg = bias if bias is not None else placeholder
    src_arg = src if src is not None else x
    slope = prep.fwd_tail[-2:]
    reduce(
        (
            dy,
            src_arg,
            x,
            placeholder,
            bias_arg,
            mean,
            rstd,
            part,
            dw_part,
            db_part,
            dx if dx is not None else x,
            dres if dres is not None else x,
            view.rows,
            *prep.geometry,
            plan.rows_per_prog,
            2 * view.channels,  # the partials' row stride
            *slope,
        ),
        device,
    )
    if dx_plan is not None:
        dx_plan((dy, src_arg, x, placeholder, bias_arg, mean, rstd, part, dx, *prep.geometry, *slope), device)
    dweight = dbias = None
    if need_wb:
        sums = partials.sum(0)
        if need_w:
            dweight = sums[0].to(weight.dtype).view(weight.shape)
        if need_b:
            dbias = sums[1].to(bias.dtype).view(bias.shape)
    return dx, dweight, dbias, dres


class NormActFunction(torch.autograd.Function):
    """act(norm(x) * weight + bias + residual) on the Triton kernels, with their backward."""

    @staticmethod
    def forward(ctx, call: NormActCall, out_dtype: torch.dtype, x, weight, bias, residual):  # type: ignore[override]
        had_weight, had_bias = weight is not None, bias is not None
        weight, bias = affine_pair(weight, bias)
        y, mean, rstd, x_read, residual_read, prep = forward(x, weight, bias, residual, call, out_dtype)
        source = call.act.grad_source(call.negative_slope)
        src = y if source is GradSource.OUTPUT else (residual_read if source is GradSource.INPUT else None)
        ctx.call, ctx.prep = call, prep
        ctx.had = (had_weight, had_bias)
        ctx.res_dtype = residual.dtype if residual is not None else None
        ctx.save_for_backward(x_read, weight, bias, src, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, bias, src, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b, need_res = ctx.needs_input_grad[2:6]
        had_weight, had_bias = ctx.had
        needs = (need_x, need_w and had_weight, need_b and had_bias, need_res)
        dx, dweight, dbias, dres = backward(
            dy, x, weight, bias, src, mean, rstd, ctx.prep, ctx.call, needs, ctx.res_dtype
        )
        return None, None, dx, dweight, dbias, dres


def grad_needed(*tensors) -> bool:  # type: ignore[no-untyped-def]
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
