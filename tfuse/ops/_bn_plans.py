"""Launch plans of ``batch_norm_act``: what a call launches, worked out once per shapes, strides, dtypes and flags.

:func:`_spec` interns a call's flags and scalars (:class:`_BatchNormSpec`);
:func:`_plan_of` returns the cached :class:`_ForwardPlan` for a call, which
holds its passes' prepared launches (:class:`_Launch`), the size of their
scratch buffer, the arrival counters of its merging reduction (see
tfuse/ops/batch_norm.py, "Arrival counters") and the backward plans its calls
have needed (:func:`_backward_plan`). The caches and :data:`MAX_PLANS` are
read here: patch them here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tfuse import kernels
from tfuse._kit import acc_dtype, acc_fp64, emulate_bf16_rtne, split_float
from tfuse._launch import LaunchPlan, resident_programs, target_programs
from tfuse.ops._activations import Activation, GradSource
from tfuse.ops._arrivals import ArrivalCounters
from tfuse.ops._bn_geometry import _Geometry, _geometry_of, _merge_layout

#: Cached plans (one per shape, strides, dtypes and flags) kept before the cache starts over.
MAX_PLANS = 1024


@functools.lru_cache(maxsize=256)
def _spec(act, negative_slope, eps, momentum, use_batch_stats, update_running, channels) -> _BatchNormSpec:
    return _BatchNormSpec(act, negative_slope, eps, momentum, use_batch_stats, update_running, channels)


@dataclasses.dataclass(frozen=True, eq=False)  # interned by _spec: compared and hashed by identity
class _BatchNormSpec:
    act: Activation
    negative_slope: float
    eps: float
    momentum: float
    use_batch_stats: bool
    update_running: bool
    channels: int

    @property
    def from_output(self) -> bool:
        """Backward needs no pre-activation: act' follows from the output y, or needs nothing (identity)."""
        return self.act.grad_source(self.negative_slope) is not GradSource.INPUT

    @functools.cached_property
    def plan_key(self) -> tuple:
        """What the launch plans depend on: the kernels' flags, not eps, momentum or the slope's value (runtime
        arguments), so a layer whose momentum changes every step (momentum=None) keeps its plans."""
        return (self.act, self.from_output, self.use_batch_stats, self.update_running)

    @functools.cached_property
    def eps_split(self) -> tuple[float, float]:
        """``split_float(eps)``, the kernels' two-float form, computed once per spec."""
        return split_float(self.eps)

    @functools.cached_property
    def momentum_split(self) -> tuple[float, float]:
        return split_float(self.momentum)

    @functools.cached_property
    def slope_split(self) -> tuple[float, float]:
        return split_float(self.negative_slope)


@dataclasses.dataclass
class _Launch:
    """One launch of a plan: grid, the integer arguments after the tensors, and the meta-parameters.

    Plans are keyed on everything that decides the kernel's specialisation, so
    each _Launch repeats one compiled kernel: :func:`tfuse._launch.launch`
    prepares it at the first call and relaunches it without Triton's per-call binding.
    """

    kernel: object
    grid: tuple[int, ...]
    ints: tuple
    meta: dict
    plan: LaunchPlan | None = None

    def __call__(self, args: tuple, device: torch.device) -> None:
        if self.plan is None:
            self.plan = LaunchPlan(self.kernel, self.grid, self.meta)
        self.plan(args, device)


#: (device, size) -> counters of plans dropped from the cache, for new plans to take over. Never freed: a
#: captured CUDA graph may still launch with them; every launch leaves them 0, so sharing them is safe.
_spare_counters: dict = {}


def _counters(size: int, device: torch.device) -> ArrivalCounters:
    spare = _spare_counters.get((device, size))
    return spare.pop() if spare else ArrivalCounters(size, device)


@dataclasses.dataclass
class _ForwardPlan:
    geometry: _Geometry
    acc_dtype: torch.dtype
    buf_size: int
    stats: _Launch | None
    normalise: _Launch
    counters: ArrivalCounters | None  # the statistics' arrival counters (training)
    backward: dict = dataclasses.field(default_factory=dict)  # (needs_input_grad, dy dtype) -> _BackwardPlan


@dataclasses.dataclass
class _BackwardPlan:
    acc_dtype: torch.dtype
    buf_size: int
    reduce: _Launch
    dx: _Launch | None
    from_dz: bool
    counters: ArrivalCounters | None  # the reduction's arrival counters (when it merges)


#: (shapes, strides, dtypes, device, flags) -> _ForwardPlan; each forward plan holds its backward plans.
_forward_plans: dict = {}


def _drop_plans() -> None:
    """Empties the plan cache; the plans' counters go to :data:`_spare_counters`."""
    for plan in _forward_plans.values():
        for counters in (plan.counters, *(backward.counters for backward in plan.backward.values())):
            if counters is not None:
                tensor = counters.tensor
                _spare_counters.setdefault((tensor.device, tensor.numel()), []).append(counters)
    _forward_plans.clear()


#: An int32 tensor per device standing in for arrival counters where a kernel is compiled to ask its occupancy.
_counter_stand_ins: dict = {}


def _counter_stand_in(device: torch.device) -> torch.Tensor:
    stand_in = _counter_stand_ins.get(device)
    if stand_in is None:
        stand_in = _counter_stand_ins[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return stand_in


def _resident(kernel, args: tuple, meta: dict, device: torch.device) -> int:
    """Programs of a reduction grid: as many as the device runs at once (from the compiled kernel on a GPU)."""
    return resident_programs(kernel, args, meta, device)


def _out_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The result's dtype: x's, promoted with the residual's as torch's ``batch_norm(x) + residual``."""
    return x.dtype if residual is None or residual.dtype == x.dtype else torch.promote_types(x.dtype, residual.dtype)


def _forward_plan(spec: _BatchNormSpec, x, residual, weight, running_mean, running_var) -> _ForwardPlan:
    geometry = _geometry_of(x)
    out_dtype = _out_dtype(x, residual)
    acc = acc_dtype(out_dtype)
    affine = weight is not None
    normalise = _Launch(
        kernels._bn_act_fwd_kernel,
        geometry.ew_grid,
        (geometry.n_rows, geometry.n_cols, geometry.ss, geometry.ew_rows_per_chunk),
        dict(
            HAS_RESIDUAL=residual is not None,
            FROM_RUNNING=not spec.use_batch_stats,
            AFFINE=affine,
            ACT=spec.act.code,
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            ACC_FP64=acc_fp64(acc),
            **geometry.elementwise_meta(),
        ),
    )
    if not spec.use_batch_stats:
        return _ForwardPlan(geometry, acc, 0, None, normalise, None)
    stats_meta = dict(
        UPDATE_RUNNING=spec.update_running,
        AFFINE=affine,
        ACC_FP64=acc_fp64(acc),
        **geometry.reduce_meta(),
        **geometry.merge_meta(),
    )
    placeholder = torch.empty(16, dtype=acc, device=x.device)
    resident = _resident(
        kernels._bn_stats_partial_kernel,
        (
            x,
            placeholder,
            running_mean if spec.update_running else placeholder,
            running_var if spec.update_running else placeholder,
            weight if affine else placeholder,
            weight if affine else placeholder,  # bias: weight's dtype, as the checks ensure
            _counter_stand_in(x.device),
            geometry.n_rows,
            geometry.n_cols,
            geometry.ss,
            geometry.group_width,
            1,
            1,
            *spec.eps_split,
            *spec.momentum_split,
        ),
        stats_meta,
        x.device,
    )
    chunks, rows_per_chunk = geometry.chunks(resident)
    per_block, blocks, n_counters = _merge_layout(geometry, chunks)
    stats = _Launch(
        kernels._bn_stats_partial_kernel,
        (geometry.groups, chunks),
        (geometry.n_rows, geometry.n_cols, geometry.ss, geometry.group_width, rows_per_chunk, per_block),
        stats_meta,
    )
    buf_size = (4 + 2 * chunks + 2 * blocks) * geometry.channels
    return _ForwardPlan(geometry, acc, buf_size, stats, normalise, _counters(n_counters, x.device))


def _plan_of(spec: _BatchNormSpec, x, weight, bias, residual, running_mean, running_var) -> _ForwardPlan:
    """The cached plan for these shapes, strides, dtypes and flags (everything a kernel specialises on)."""
    device = x.device
    key = (
        x.shape,
        x.stride(),
        x.dtype,
        device,
        target_programs(device),
        spec.plan_key,
        residual is not None and residual.dtype,
        weight is not None and (weight.dtype, bias.dtype),
        running_mean is not None and (running_mean.dtype, running_var.dtype),
    )
    plan = _forward_plans.get(key)
    if plan is None:
        if len(_forward_plans) >= MAX_PLANS:  # many shapes (varying batch or image sizes): start over
            _drop_plans()
        plan = _forward_plans[key] = _forward_plan(spec, x, residual, weight, running_mean, running_var)
    return plan


def _backward_plan(spec, geometry, x, dy, src, residual, stats_table, weight, bias, needs, dres_dtype) -> _BackwardPlan:
    need_x, need_weight, need_bias, need_res = needs
    acc = acc_dtype(dy.dtype)
    eval_mode = not spec.use_batch_stats
    affine = weight is not None
    flags = dict(
        HAS_RESIDUAL=residual is not None,
        FROM_OUTPUT=spec.from_output,
        ACT=spec.act.code,
        EMULATE_BF16_RTNE=emulate_bf16_rtne(),
        ACC_FP64=acc_fp64(acc),
    )
    needs_pass_2 = not eval_mode and need_x
    merge = need_weight or need_bias or needs_pass_2
    reduce_meta = dict(
        FROM_RUNNING=eval_mode,
        AFFINE=affine,
        WRITE_DX=eval_mode and need_x,
        WRITE_DRES=need_res,
        MERGE=merge,
        WRITE_DWEIGHT=need_weight,
        WRITE_DBIAS=need_bias,
        WRITE_COEF=needs_pass_2,
        **flags,
        **geometry.reduce_meta(),
        **geometry.merge_meta(),
    )
    placeholder = torch.empty(16, dtype=acc, device=x.device)
    dx_like = x if need_x else placeholder
    dres_like = torch.empty(16, dtype=dres_dtype, device=x.device) if need_res else placeholder
    resident = _resident(
        kernels._bn_act_bwd_reduce_kernel,
        (
            dy,
            src if src is not None else x,
            x,
            stats_table,
            stats_table,
            weight if affine else stats_table,
            bias if affine else stats_table,
            placeholder,
            dx_like,
            dres_like,
            weight if need_weight else placeholder,
            bias if need_bias else placeholder,
            _counter_stand_in(x.device),
            geometry.n_rows,
            geometry.n_cols,
            geometry.ss,
            geometry.group_width,
            1,
            1,
            *spec.eps_split,
            *spec.slope_split,
        ),
        reduce_meta,
        x.device,
    )
    chunks, rows_per_chunk = geometry.chunks(resident)
    per_block, blocks, n_counters = _merge_layout(geometry, chunks)
    reduce = _Launch(
        kernels._bn_act_bwd_reduce_kernel,
        (geometry.groups, chunks),
        (geometry.n_rows, geometry.n_cols, geometry.ss, geometry.group_width, rows_per_chunk, per_block),
        reduce_meta,
    )
    # The dx pass reads dy' back from d(residual) (one tensor instead of dy and
    # y or the residual) when the first pass wrote it at x's precision or better.
    from_dz = need_res and (dres_dtype == x.dtype or torch.finfo(dres_dtype).bits >= 32)
    dx = None
    if needs_pass_2:
        dx = _Launch(
            kernels._bn_act_bwd_dx_kernel,
            geometry.ew_grid,
            (geometry.n_rows, geometry.n_cols, geometry.ss, geometry.ew_rows_per_chunk),
            dict(WRITE_DX=True, WRITE_DRES=False, FROM_DZ=from_dz, **flags, **geometry.elementwise_meta()),
        )
    buf_size = (5 + 2 * chunks + 2 * blocks) * geometry.channels
    return _BackwardPlan(acc, buf_size, reduce, dx, from_dz, _counters(n_counters, x.device) if merge else None)
