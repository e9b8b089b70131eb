"""``batch_norm_act``: batch norm (+ residual) + activation, fused (kernels/batch_norm.py).

Launches: training forward 2 (the statistics, whose partials the last
program of each column group merges into the table with the
running-statistics update; the normalise + residual + activation pass); eval
forward 1. Training backward 2 (a reducing pass that also writes d(residual)
and whose last programs merge d(weight), d(bias) and the dx coefficients;
the dx pass), 1 when x needs no gradient; eval backward 1. No merge has a
launch of its own: see kernels/batch_norm.py ("last program merges").

Layouts: x is read in place when it is NCHW-contiguous or channels_last (for
1-D/3-D inputs: contiguous, or channels innermost); any other layout is
copied to contiguous first. The residual and dy take x's layout (copied
when theirs differs), so every kernel addresses all full-size tensors alike.

Host cost: everything that depends only on shapes, strides, dtypes and flags
(tiling, grids, compile-time switches, the reduction grid sized from the
compiled kernel's occupancy) is computed once and cached; a call allocates
the outputs and one float32 scratch buffer per pass and launches.

Arrival counters: each merging reduction (the statistics; the backward sums
when weight, bias or x need gradients) counts its programs' arrivals in
int32 counters of its own, one per column group and one per block of chunks
(``groups * (1 + blocks)``), held by its plan: allocated zeroed once, when
the plan is built. Every launch leaves them 0, so nothing clears them
between calls or CUDA graph replays, and a replay allocates nothing.
Launches of one plan must therefore not overlap on the device (as launches
on one stream never do); concurrent streams running the same shapes would
need plans of their own. Plans dropped from the cache give their counters
to later plans (a captured graph may still point at them). The merge costs
no launch and no pass: the partials are read once, as a separate merge
kernel read them, plus each block's partial once more when a group's chunks
are merged in two levels; each program adds one or two atomics.

Statistics are float32 (float64 for float64 inputs). Saved for backward:
x, weight and bias, plus the output y for activations whose derivative
follows from it (relu, sigmoid, tanh, leaky_relu with slope >= 0), else the
residual; the pre-activation is recomputed, never stored. The per-channel
statistics table (training) or the running statistics (eval) go along too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers

import torch
import torch.nn.functional as F

from tfuse import kernels
from tfuse._backend import Backend, log_backend_once, select_backend
from tfuse._kit import (
    acc_dtype,
    acc_fp64,
    emulate_bf16_rtne,
    needs_int64,
    next_power_of_2,
    num_warps,
    split_float,
)
from tfuse._launch import LaunchPlan, resident_programs, target_programs
from tfuse.kernels import codes
from tfuse.ops._activations import Activation, GradSource, check_activation
from tfuse.ops._arrivals import ArrivalCounters
from tfuse.ops._checks import check_float_dtype
from tfuse.ops._library import DTYPES, compiling, dtype_code, op_backend, tfuse_op

#: Tile elements per thread the big passes aim for: the warps of a program are its tile over this.
ELEMENTS_PER_THREAD = 8
#: Elements per step (one [BN, BL] tile) of a program of the reducing passes.
TILE_REDUCE = 1024
#: Elements per step of a program of the normalise and dx passes.
TILE_ELEMENTWISE = 2048
#: Widest column block of a channels_last reduction (channels per program).
MAX_CHANNEL_BLOCK = 64
#: Steps (tiles) one program of the normalise and dx passes walks down its rows, at most.
MAX_STEPS = 8
#: Programs per SM the normalise and dx passes aim for (several waves of resident programs).
ELEMENTWISE_PROGRAMS_PER_SM = 32
#: Cached plans (one per shape, strides, dtypes and flags) kept before the cache starts over.
MAX_PLANS = 1024
#: Elements of the [chunks, channels] tile the merging programs of a reduction merge partials with (a step).
MERGE_TILE = 512
#: Merge steps up to which a reduction merges its chunks in one level (one block); more take two.
ONE_LEVEL_STEPS = 4

_log = logging.getLogger(__name__)


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
    negative_slope: float | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(batch_norm(x) + residual)``: ``F.batch_norm`` fused with a residual add and an activation.

    Arguments as for ``F.batch_norm`` (``x`` of shape ``[N, C, ...]``;
    statistics over every dimension but 1, in float32 with Welford/Chan
    merging; biased variance to normalise, unbiased into ``running_var``,
    updated in place with ``momentum`` when ``training``), plus ``act``
    (relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh, relu6, hardtanh, hardswish, hardsigmoid,
    mish, elu, identity),
    ``negative_slope`` (leaky_relu only, default 0.01) and an optional
    ``residual`` of ``x``'s shape added before the activation. NCHW and
    channels_last inputs are read in place; the output has ``x``'s layout,
    and x's dtype promoted with the residual's, as torch's ``+`` does.

    As in ``F.batch_norm``: ``momentum`` is a number (any value; the modules
    turn ``momentum=None``, a cumulative average, into ``1 / num_batches_tracked``);
    ``eps`` is refused where the installed torch refuses it (2.13: not positive
    in training, negative in eval), with torch's words; eval needs
    the running statistics; weight or bias may be given alone; weight, bias
    and the running statistics share one dtype, x's or float32 (torch takes
    float32 with a 16-bit x only; tfuse with a float64 x too, normalising in
    float64). Double backward (``create_graph=True``) is supported.

    Example:
        >>> import torch
        >>> from tfuse.functional import batch_norm_act
        >>> x, skip = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
        >>> mean, var = torch.zeros(3), torch.ones(3)
        >>> y = batch_norm_act(x, mean, var, training=True, residual=skip)
        >>> y.shape
        torch.Size([4, 3, 5, 5])

    Raises:
        TypeError: a non-tensor or non-floating input, a non-number momentum or eps.
        ValueError: x with fewer than 2 dimensions; one value per channel in
            training; eps out of range; per-channel tensors of the wrong size
            (or x with another channel count than they have); a residual of
            another shape; only one of running_mean and running_var; an
            unknown activation, or a slope with one other than leaky_relu.
        RuntimeError: eval without running statistics, mixed parameter
            dtypes, tensors on different devices.
    """
    key = _call_key(x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope)
    checked = _checked_calls.get(key) if key is not None else None
    if checked is None:
        checked = _check_call(
            x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope
        )
        if key is not None:
            if len(_checked_calls) >= MAX_PLANS:
                _checked_calls.clear()
            _checked_calls[key] = checked
    act, negative_slope, channels = checked
    if compiling():
        return _batch_norm_act_traced(
            x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
        )
    backend = select_backend(x.device, "batch_norm_act", x.numel())
    log_backend_once(_log, "batch_norm_act", backend, x.device)
    if backend is Backend.TORCH:
        return _batch_norm_act_torch(
            x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
        )
    if weight is None and bias is not None:
        weight = torch.ones_like(bias)  # torch normalises with weight 1 when only a bias is given
    elif bias is None and weight is not None:
        bias = torch.zeros_like(weight)
    if weight is not None and not (weight.is_contiguous() and bias.is_contiguous()):
        weight, bias = weight.contiguous(), bias.contiguous()  # the kernels index them densely
    if running_mean is not None and not (running_mean.is_contiguous() and running_var.is_contiguous()):
        # The kernels index them densely and update them in place: run on dense copies, then write them back.
        dense_mean, dense_var = running_mean.contiguous(), running_var.contiguous()
        y = _batch_norm_act_triton(
            x, dense_mean, dense_var, weight, bias, training, momentum, eps, act, negative_slope, residual, channels
        )
        if training:
            running_mean.copy_(dense_mean)
            running_var.copy_(dense_var)
        return y
    return _batch_norm_act_triton(
        x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual, channels
    )


def _batch_norm_act_torch(
    x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
) -> torch.Tensor:
    """The PyTorch path: F.batch_norm, the residual add and the activation (in place on a fresh tensor)."""
    stats = (running_mean, running_var)
    if x.dtype == torch.float64 and any(t is not None and t.dtype == torch.float32 for t in (*stats, weight, bias)):
        # float32 parameters with a float64 x (which torch does not take): in float64, statistics written back.
        weight, bias = (t.double() if t is not None else None for t in (weight, bias))
        running_mean, running_var = (t.double() if t is not None else None for t in stats)
    elif training and running_mean is not None and not (running_mean.is_contiguous() and running_var.is_contiguous()):
        # cuDNN's batch norm updates dense copies of non-contiguous running statistics and drops them
        # (pytorch#33867): run on dense copies here and write them back below, on every device.
        running_mean, running_var = running_mean.contiguous(), running_var.contiguous()
    if weight is None and bias is not None:
        # torch's weight 1, said explicitly: torch 2.11's CUDA backward of a bias-only batch norm raises
        # "tensor does not have a device".
        weight = torch.ones_like(bias)
    y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    if training and stats[0] is not None and stats[0] is not running_mean:
        stats[0].copy_(running_mean)
        stats[1].copy_(running_var)
    if residual is not None:
        y = y + residual
    return act.forward_(y, negative_slope)  # y is a fresh tensor: in place is safe


def _batch_norm_act_triton(
    x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual, channels
) -> torch.Tensor:
    """The Triton path of :func:`batch_norm_act` (arguments checked; per-channel tensors dense)."""
    if _layout(x) is None:
        x = x.contiguous()  # the output and gradients take x's layout, so it must be one the kernels read
    if residual is not None:
        residual = _in_layout_of(residual, x)
    spec = _spec(
        act,
        negative_slope,
        float(eps),
        float(momentum),
        bool(training),
        bool(training) and running_mean is not None,
        channels,
    )
    plan = _plan_of(spec, x, weight, bias, residual, running_mean, running_var) if x.numel() else None
    tensors = (x, weight, bias, residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        args = (x, weight, bias, residual, running_mean, running_var, training, momentum, eps, act, negative_slope)
        return _batch_norm_act_op.apply(*args, spec=spec, plan=plan)[0]
    return _forward(spec, plan, x, weight, bias, residual, running_mean, running_var)[0]


_PER_CHANNEL = ("running_mean", "running_var", "weight", "bias")

#: Calls whose arguments passed the checks, by :func:`_call_key` -> (activation, slope, channels).
_checked_calls: dict[tuple, tuple[Activation, float, int]] = {}


def _tensor_key(t) -> tuple | None:
    """What the checks read of a tensor argument: dtype, shape, device (None for None; a non-tensor raises)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError  # not cacheable: the checks run and say what is wrong
    return (t.dtype, t.shape, t.device)


def _call_key(x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope):
    """Everything the argument checks depend on, or None when an argument is not a tensor (checked every call).

    The lean path: a layer calls with the same shapes, dtypes and flags step
    after step, so the checks run once per such call and a repeat costs this key.
    """
    try:
        tensors = tuple(map(_tensor_key, (x, running_mean, running_var, weight, bias, residual)))
        return (*tensors, bool(training), type(momentum), type(eps), eps, act, negative_slope)
    except TypeError:  # a non-tensor argument, or an unhashable act/slope/eps: no caching
        return None


def _check_call(x, running_mean, running_var, weight, bias, residual, training, momentum, eps, act, negative_slope):
    """All argument checks of :func:`batch_norm_act`; returns (activation, slope, channels)."""
    act, negative_slope = check_activation("batch_norm_act", act, negative_slope, strict=True)
    for name, value in (("momentum", momentum), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            hint = ""
            if name == "momentum" and value is None:
                hint = (
                    " (momentum=None, a cumulative moving average, is the modules' option: "
                    "they pass 1 / num_batches_tracked)"
                )
            raise TypeError(f"tfuse.batch_norm_act: {name} must be a number, got {type(value).__name__}{hint}")
    channels = _check_inputs(x, running_mean, running_var, weight, bias, residual, training, float(eps))
    return act, negative_slope, channels


def _check_inputs(x, running_mean, running_var, weight, bias, residual, training, eps: float) -> int:
    """Checks the tensors and eps as ``F.batch_norm`` does (in its words where it has them); returns C."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tfuse.batch_norm_act: x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("batch_norm_act", "x", x.dtype)
    if x.dim() < 2:
        raise ValueError(
            f"tfuse.batch_norm_act: x must have at least 2 dimensions [N, C, ...], got shape {list(x.shape)}"
        )
    channels = x.shape[1]
    given = []
    for name, tensor in zip(_PER_CHANNEL, (running_mean, running_var, weight, bias)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tfuse.batch_norm_act: {name} must be a torch.Tensor or None, got {type(tensor).__name__}")
        check_float_dtype("batch_norm_act", name, tensor.dtype)
        if tensor.device != x.device:
            raise RuntimeError(f"tfuse.batch_norm_act: {name} is on {tensor.device} but x is on {x.device}")
        given.append((name, tensor))
    if not training:
        for name, tensor in (("running_mean", running_mean), ("running_var", running_var)):
            if tensor is None:
                raise RuntimeError(
                    f"tfuse.batch_norm_act: {name} must be defined in evaluation mode (training=False "
                    "normalises with the running statistics; pass training=True to use the batch's)"
                )
    if (running_mean is None) != (running_var is None):
        raise ValueError(
            "tfuse.batch_norm_act: running_mean and running_var must either both be None or neither be None"
        )
    sizes = {tuple(t.shape) for _, t in given}
    if given and len(sizes) == 1 and len(next(iter(sizes))) == 1 and next(iter(sizes)) != (channels,):
        # The per-channel tensors agree with each other, not with x: a channel mismatch.
        size = next(iter(sizes))[0]
        names = ", ".join(name for name, _ in given)
        first = given[0][0]
        raise ValueError(
            f"tfuse.batch_norm_act: channel mismatch: x of shape {list(x.shape)} has {channels} channels "
            f"(dimension 1), but {names} have {size} elements, as for an input with {size} channels "
            f"({first} must have shape [{channels}], got [{size}])"
        )
    for name, tensor in given:
        if tensor.shape != (channels,):
            raise ValueError(
                f"tfuse.batch_norm_act: {name} must have shape [{channels}], got {list(tensor.shape)} "
                f"(x has {channels} channels; {name} should contain {channels} elements not {tensor.numel()})"
            )
    # torch's rule (one dtype, x's or float32 for a 16-bit x), plus float32 with a float64 x:
    # statistics are kept in float32 by default, and a float64 x is normalised in float64 either way.
    param_dtypes = {t.dtype for _, t in given}
    if len(param_dtypes) > 1 or not param_dtypes <= {x.dtype, torch.float32}:
        listed = ", ".join(f"{name} {t.dtype}" for name, t in given)
        raise RuntimeError(
            f"tfuse.batch_norm_act: mixed dtype: x is {x.dtype} and {listed}; weight, bias, running_mean and "
            f"running_var must share one dtype, x's or float32"
        )
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(
                f"tfuse.batch_norm_act: residual must be a torch.Tensor or None, got {type(residual).__name__}"
            )
        check_float_dtype("batch_norm_act", "residual", residual.dtype)
        if residual.shape != x.shape:
            raise ValueError(
                f"tfuse.batch_norm_act: residual must have x's shape {list(x.shape)}, got {list(residual.shape)}"
            )
        if residual.device != x.device:
            raise RuntimeError(f"tfuse.batch_norm_act: residual is on {residual.device} but x is on {x.device}")
    if training:
        values_per_channel = x.numel() // max(channels, 1)
        if values_per_channel == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
    if eps <= 0.0:
        refusal = _torch_refuses_eps(float(eps), bool(training))
        if refusal is not None:
            raise ValueError(refusal)
    return channels


@functools.lru_cache(maxsize=64)
def _torch_refuses_eps(eps: float, training: bool) -> str | None:
    """What the installed torch's ``F.batch_norm`` says of this ``eps`` (None: it accepts it).

    Its rule and words changed between releases (torch 2.11 refuses eps <= 0 in eval too, "must be positive";
    2.13 allows 0 in eval and says "during training"), so tfuse asks it, once per value, on a tiny CPU tensor.
    """
    try:
        F.batch_norm(torch.zeros(2, 1), torch.zeros(1), torch.ones(1), training=training, eps=eps)
    except ValueError as refusal:
        return str(refusal)
    return None


# Layouts the kernels read in place (see kernels/batch_norm.py).
_NCS = 0  # [N, C, S] contiguous: a row is one sample of C * S values
_NSC = 1  # channels innermost (channels_last, [N, C]): a row is one position of C values
_SEG_LANE, _SEG_ONE, _SEG_PACKED = (codes.SEG_LANE, codes.SEG_ONE, codes.SEG_PACKED)


def _layout(t: torch.Tensor) -> int | None:
    """_NCS, _NSC, or None when ``t``'s layout is neither (sizes of 1 never matter)."""
    return _layout_of(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=1024)
def _layout_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    channels, spatial = shape[1], math.prod(shape[2:])

    def dense(order: list[int]) -> bool:  # the dimensions in ``order``, innermost last, fill memory exactly
        expected = 1
        for dim in reversed(order):
            if shape[dim] != 1 and strides[dim] != expected:
                return False
            expected *= shape[dim]
        return True

    ncs = dense(list(range(len(shape))))
    nsc = dense([0, *range(2, len(shape)), 1])
    if ncs and nsc:  # S == 1 or C == 1: either reads the same memory; channels along columns when S == 1
        return _NSC if spatial == 1 and channels > 1 else _NCS
    return _NCS if ncs else _NSC if nsc else None


def _in_layout_of(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` (of x's shape) if it is laid out as x, else a copy in x's layout (x is dense)."""
    if t.stride() == x.stride() or _layout(t) == _layout(x):
        return t
    return torch.empty_like(x, dtype=t.dtype).copy_(t)


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


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """x as a matrix of ``n_rows`` x ``n_cols`` (channel of a column: col // ss) and the tilings of its passes.

    Reductions: column groups of ``group_width`` columns (``groups`` of them),
    tiles [red_bn, red_bl], alignment ``red_vec``, per-channel merge ``seg``
    (``cb_pad``: channels per program, padded, when packed). Normalise and dx
    passes: tiles [ew_bn, ew_bl], alignment ``ew_vec``, grid ``ew_grid``, each
    program walking ``ew_rows_per_chunk`` rows.
    """

    channels: int
    n_rows: int
    n_cols: int
    ss: int
    group_width: int
    groups: int
    red_bn: int
    red_bl: int
    red_vec: int
    seg: int
    cb_pad: int
    ew_bn: int
    ew_bl: int
    ew_vec: int
    ew_grid: tuple[int, int]
    ew_rows_per_chunk: int
    index_64: bool

    def reduce_meta(self) -> dict:
        s_pad = next_power_of_2(self.ss) if self.seg == _SEG_PACKED else 1
        parts = max(1, 2 * self.cb_pad * s_pad // self.red_bl)  # gathered tiles of at most BL / 2 elements
        return dict(
            SEG=self.seg,
            BN=self.red_bn,
            BL=self.red_bl,
            VEC=self.red_vec,
            PARTS=parts,
            CB_PART=max(1, self.cb_pad // parts),
            S_PAD=s_pad,
            INDEX_64=self.index_64,
            num_warps=num_warps(self.red_bn * self.red_bl, ELEMENTS_PER_THREAD),
        )

    def merge_meta(self) -> dict:
        """The merge tile of a reduction's last programs: MC channels (a column group's) x MK chunks."""
        channels = self.red_bl if self.seg == _SEG_LANE else self.cb_pad if self.seg == _SEG_PACKED else 1
        row_steps = -(-self.n_rows // self.red_bn)  # chunks, at most
        return dict(MC=channels, MK=max(1, min(next_power_of_2(row_steps), MERGE_TILE // channels)))

    def elementwise_meta(self) -> dict:
        return dict(
            BN=self.ew_bn,
            BL=self.ew_bl,
            VEC=self.ew_vec,
            INDEX_64=self.index_64,
            num_warps=num_warps(self.ew_bn * self.ew_bl, ELEMENTS_PER_THREAD),
        )

    def chunks(self, resident: int) -> tuple[int, int]:
        """(chunks, rows per chunk) of a reduction with ``resident`` programs on the device at once."""
        row_steps = -(-self.n_rows // self.red_bn)
        chunks = min(row_steps, max(1, resident // self.groups))
        rows_per_chunk = -(-row_steps // chunks) * self.red_bn
        return -(-self.n_rows // rows_per_chunk), rows_per_chunk


def _power_of_2_factor(n: int, cap: int) -> int:
    """The largest power of two dividing ``n``, at most ``cap``."""
    return cap if n == 0 else min(n & -n, cap)


def _block(n: int, cap: int) -> int:
    """A power-of-two block for ``n`` columns: the widest (up to ``cap``) wasting at most 1/8 in padding,
    else the one (of at least 16) wasting least."""
    best, best_waste = 1, 1.0
    block = min(cap, next_power_of_2(n))
    smallest = min(block, 16)  # narrower blocks cost more in per-program work than padding does
    while block >= smallest:
        padded = -(-n // block) * block
        waste = (padded - n) / padded
        if waste <= 0.125:
            return block
        if waste < best_waste:
            best, best_waste = block, waste
        block //= 2
    return best


def _ncs_reduction(
    channels: int, spatial: int, n_cols: int, vec_cap: int, itemsize: int
) -> tuple[int, int, int, int, int]:
    """(group width, block, alignment, seg, cb_pad) of an NCHW reduction.

    Either ``cb`` whole channels per program, their cb * S values contiguous
    in a row and read as one window of BL lanes (S <= BL), or one channel per
    program read in pieces of BL. Candidates are ranked by the vector width
    they allow, then by the share of lanes doing work, then by width.
    """
    best = None
    block = 16
    while block <= TILE_REDUCE:
        options = []
        if spatial <= block:
            step = vec_cap // math.gcd(spatial, vec_cap)  # cb * S must stay a multiple of the alignment
            cb = min(channels, block // spatial // step * step) or min(channels, block // spatial)
            width = cb * spatial
            options.append((width, width / block))
        elif block * itemsize >= 128:  # a piece of a row is at least a cache line
            pieces = -(-spatial // block)
            options.append((spatial, spatial / (pieces * block)))
        for width, used in options:
            vec = _power_of_2_factor(math.gcd(n_cols, width), vec_cap)
            key = (vec, round(used * 32), block)
            if best is None or key > best[0]:
                best = (key, width, block, vec)
        block *= 2
    _, width, block, vec = best
    cb = width // spatial
    if width == spatial:
        return width, block, vec, _SEG_ONE, 1
    return width, block, vec, _SEG_PACKED, next_power_of_2(cb)


def _elementwise_target(device: torch.device) -> int:
    """Programs the normalise and dx passes aim for (``target_programs`` is 4 per SM on a GPU)."""
    return ELEMENTWISE_PROGRAMS_PER_SM * target_programs(device) // 4


def _geometry_of(x: torch.Tensor) -> _Geometry:
    return _geometry(tuple(x.shape), _layout(x), x.element_size(), _elementwise_target(x.device))


@functools.lru_cache(maxsize=512)
def _geometry(shape: tuple[int, ...], layout: int, itemsize: int, elementwise_target: int) -> _Geometry:
    channels, spatial = shape[1], math.prod(shape[2:])
    if layout == _NSC:
        n_rows, n_cols, ss = shape[0] * spatial, channels, 1
    else:
        n_rows, n_cols, ss = shape[0], channels * spatial, spatial
    vec_cap = max(1, 16 // itemsize)
    row_vec = _power_of_2_factor(n_cols, vec_cap)  # what every row start allows
    if layout == _NSC:
        red_bl = _block(channels, MAX_CHANNEL_BLOCK)
        group_width, red_vec, seg, cb_pad = red_bl, min(row_vec, red_bl), _SEG_LANE, 1
    else:
        group_width, red_bl, red_vec, seg, cb_pad = _ncs_reduction(channels, spatial, n_cols, row_vec, itemsize)
    red_bn = max(1, TILE_REDUCE // red_bl)
    ew_bl = _block(n_cols, TILE_ELEMENTWISE)
    ew_bn = max(1, TILE_ELEMENTWISE // ew_bl)
    col_tiles = -(-n_cols // ew_bl)
    row_steps = -(-n_rows // ew_bn)
    steps = max(1, min(MAX_STEPS, col_tiles * row_steps // elementwise_target))
    ew_rows_per_chunk = steps * ew_bn
    padded_rows = n_rows + max(red_bn, ew_rows_per_chunk)
    largest = padded_rows * n_cols + max(red_bl, ew_bl)
    return _Geometry(
        channels=channels,
        n_rows=n_rows,
        n_cols=n_cols,
        ss=ss,
        group_width=group_width,
        groups=-(-n_cols // group_width),
        red_bn=red_bn,
        red_bl=red_bl,
        red_vec=red_vec,
        seg=seg,
        cb_pad=cb_pad,
        ew_bn=ew_bn,
        ew_bl=ew_bl,
        ew_vec=min(row_vec, ew_bl),
        ew_grid=(col_tiles, -(-n_rows // ew_rows_per_chunk)),
        ew_rows_per_chunk=ew_rows_per_chunk,
        index_64=needs_int64(largest),
    )


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


def _chunks_per_block(chunks: int, per_step: int) -> int:
    """Chunks per block of a reduction's two-level merge (kernels/batch_norm.py): the fewest merge steps of
    ``per_step`` items, over the block merge and the merge of the blocks. One block (the chunks merged in one
    level, as a separate merge kernel did) up to :data:`ONE_LEVEL_STEPS` steps."""
    if chunks <= ONE_LEVEL_STEPS * per_step:
        return chunks
    best = None
    for block in range(per_step, chunks + per_step, per_step):
        block = min(block, chunks)
        blocks = -(-chunks // block)
        steps = -(-block // per_step) + -(-blocks // per_step)
        if best is None or steps < best[0]:
            best = (steps, block)
    return best[1]


def _merge_layout(geometry, chunks: int) -> tuple[int, int, int]:
    """(chunks per block, blocks, counters) of a merging reduction of ``chunks`` chunks per column group."""
    per_block = _chunks_per_block(chunks, geometry.merge_meta()["MK"])
    blocks = -(-chunks // per_block)
    return per_block, blocks, geometry.groups * (1 + blocks)


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


def _forward(spec: _BatchNormSpec, plan: _ForwardPlan | None, x, weight, bias, residual, running_mean, running_var):
    """Runs the forward kernels of ``plan`` (:func:`_plan_of`; None for an empty x); returns (y, stats):
    stats is the [4, C] table + partials (None in eval)."""
    y = torch.empty_like(x, dtype=_out_dtype(x, residual))  # x is dense, so y gets exactly its layout
    if x.numel() == 0:
        return y, None
    device = x.device
    res = residual if residual is not None else x
    normalise = plan.normalise
    if spec.use_batch_stats:
        buf = torch.empty(plan.buf_size, dtype=plan.acc_dtype, device=device)
        update = spec.update_running
        plan.stats(
            (
                x,
                buf,
                running_mean if update else buf,
                running_var if update else buf,
                weight if weight is not None else buf,
                bias if bias is not None else buf,
                plan.counters.ready(),
                *plan.stats.ints,
                *spec.eps_split,
                *spec.momentum_split,
            ),
            device,
        )
        normalise(
            (x, res, y, buf, buf, buf, buf, *normalise.ints, *spec.eps_split, *spec.slope_split),
            device,
        )
        return y, buf
    normalise(
        (
            x,
            res,
            y,
            running_mean,
            running_var,
            weight if weight is not None else running_mean,
            bias if bias is not None else running_mean,
            *normalise.ints,
            *spec.eps_split,
            *spec.slope_split,
        ),
        device,
    )
    return y, None


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


def _backward_kernels(spec, plan, dy, x, weight, bias, src, residual, stats, running, needs, residual_dtype) -> tuple:
    """The Triton backward: (dx, dweight, dbias, dresidual), None where not needed.

    ``plan``: the forward's plan; ``src``: the saved output (activations whose
    derivative follows from it) or the residual; ``stats``: the forward's
    statistics table in training, None in eval (``running`` holds the running
    statistics then).
    """
    need_x, need_weight, need_bias, need_res = needs
    dx = torch.empty_like(x) if need_x else None
    dres = torch.empty_like(x, dtype=residual_dtype) if need_res else None
    dweight = torch.empty_like(weight) if need_weight else None
    dbias = torch.empty_like(bias) if need_bias else None
    if x.numel() == 0:
        return dx, dweight.zero_() if need_weight else None, dbias.zero_() if need_bias else None, dres
    if dy.stride() != x.stride():
        dy = _in_layout_of(dy, x)
    device = x.device
    bwd_key = (needs, dy.dtype)
    bwd = plan.backward.get(bwd_key)
    if bwd is None:
        table = stats if spec.use_batch_stats else running[0]
        bwd = plan.backward[bwd_key] = _backward_plan(
            spec, plan.geometry, x, dy, src, residual, table, weight, bias, needs, residual_dtype
        )
    buf = torch.empty(bwd.buf_size, dtype=bwd.acc_dtype, device=device)
    placeholder = buf
    src_arg = src if src is not None else placeholder
    if spec.use_batch_stats:
        table = var = stats
    else:
        table, var = running
    bwd.reduce(
        (
            dy,
            src_arg,
            x,
            table,
            var,
            weight if weight is not None else table,
            bias if bias is not None else table,
            buf,
            dx if dx is not None else placeholder,
            dres if dres is not None else placeholder,
            dweight if need_weight else placeholder,
            dbias if need_bias else placeholder,
            bwd.counters.ready() if bwd.counters is not None else _counter_stand_in(device),
            *bwd.reduce.ints,
            *spec.eps_split,
            *spec.slope_split,
        ),
        device,
    )
    if bwd.dx is not None:
        bwd.dx(
            (
                dy,
                dres if bwd.from_dz else src_arg,
                x,
                buf,
                dx,
                placeholder,
                *bwd.dx.ints,
                *spec.slope_split,
            ),
            device,
        )
    return dx, dweight, dbias, dres


def _backward_differentiable(spec, dy, x, weight, bias, src, running, residual_dtype, needs) -> tuple:
    """The backward in differentiable torch ops, for ``create_graph=True`` (double backward).

    The same maths as the kernels, in float32 (float64 for float64): dz =
    dy * act'(.) from the saved output or the recomputed pre-activation, then
    batch norm's backward with the statistics recomputed from x (or the
    running ones in eval). A saved output leads back to this op's Function,
    so every dependency is in the graph.
    """
    need_x, need_weight, need_bias, need_res = needs
    acc = acc_dtype(dy.dtype)
    dims = [0, *range(2, x.dim())]
    view = (1, -1) + (1,) * (x.dim() - 2)
    xa = x.to(acc)
    if spec.use_batch_stats:
        mean = xa.mean(dims, keepdim=True)
        var = (xa - mean).square().mean(dims, keepdim=True)
    else:
        mean, var = (t.to(acc).view(view) for t in running)
    invstd = torch.rsqrt(var + spec.eps)
    xhat = (xa - mean) * invstd
    g = dy.to(acc)
    source = spec.act.grad_source(spec.negative_slope)
    if source is GradSource.INPUT:
        saved = xhat if weight is None else xhat * weight.to(acc).view(view) + bias.to(acc).view(view)
        if src is not None:
            saved = saved + src.to(acc)
    else:
        saved = src.to(acc) if source is GradSource.OUTPUT else None
    dz = spec.act.backward(g, saved, spec.negative_slope)
    dres = dz.to(residual_dtype) if need_res else None
    dbias = dz.sum(dims).to(bias.dtype) if need_bias else None
    dweight = (dz * xhat).sum(dims).to(weight.dtype) if need_weight else None
    dx = None
    if need_x:
        dxhat = dz if weight is None else dz * weight.to(acc).view(view)
        if spec.use_batch_stats:
            dxhat = dxhat - dxhat.mean(dims, keepdim=True) - xhat * (dxhat * xhat).mean(dims, keepdim=True)
        dx = (dxhat * invstd).to(x.dtype)
    return dx, dweight, dbias, dres


# ---------------------------------------------------------------------------- the torch.library ops


def _batch_norm_act_traced(
    x, running_mean, running_var, weight, bias, training, momentum, eps, act, negative_slope, residual
) -> torch.Tensor:
    """What :func:`batch_norm_act` is under ``torch.compile``: the registered op, which returns the
    updated running statistics (an op with a derivative may not mutate its inputs); they are copied
    into the buffers here, which Inductor turns into one in-place write."""
    y, _, new_mean, new_var = torch.ops.tfuse.batch_norm_act(
        x,
        weight,
        bias,
        residual,
        running_mean,
        running_var,
        bool(training),
        float(momentum),
        float(eps),
        int(act),
        float(negative_slope),
    )
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
    return y


def _batch_norm_act_setup(ctx, inputs, output, spec=None, plan=None) -> None:  # type: ignore[no-untyped-def]
    """Keeps what backward reads: x, the affine parameters, the output (activations whose derivative
    follows from it) or the residual, the forward's statistics table (training) or the running
    statistics (eval). ``spec``, ``plan``: the eager Triton caller's, whose backward reuses the plan."""
    x, weight, bias, residual, running_mean, running_var, training, _, eps, act, negative_slope = inputs
    y = output[0]
    stats = output[1] if len(output) > 1 else None
    ctx.set_materialize_grads(False)  # the statistics outputs get no gradient: no zero tensors for them
    ctx.mark_non_differentiable(*output[1:])
    ctx.eager = spec is not None
    if spec is None:
        spec = _spec(Activation(act), negative_slope, eps, 0.0, training, False, int(x.shape[1]))
    ctx.spec, ctx.plan = spec, plan
    ctx.has_residual = residual is not None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    src = y if spec.from_output else residual
    running = (running_mean, running_var) if not spec.use_batch_stats else ()
    if ctx.eager:
        # The eager statistics buffer ([4, C] table + the forward's partials) is this op's intermediate:
        # kept on ctx, not among the saved tensors (which hold only x-sized and per-channel tensors).
        ctx.stats = stats
        ctx.save_for_backward(x, weight, bias, src, *running)
    else:
        ctx.save_for_backward(x, weight, bias, src, stats, *running)


def _batch_norm_act_backward(ctx, dy, *_):  # type: ignore[no-untyped-def]
    """(dx, dweight, dbias, dresidual): differentiable torch ops under ``create_graph=True``; the eager
    caller's plan straight from Python; the backward op when traced (or for the registered op)."""
    if dy is None:  # no gradient reached y (grads are not materialised): none for the inputs either
        return (None,) * 11
    if ctx.eager:
        x, weight, bias, src, *running = ctx.saved_tensors
        stats = ctx.stats
    else:
        x, weight, bias, src, stats, *running = ctx.saved_tensors
    spec = ctx.spec
    needs = tuple(ctx.needs_input_grad[:4])
    if torch.is_grad_enabled():  # create_graph=True: gradients that can be differentiated again
        filled = _affine(weight, bias)
        grads = _backward_differentiable(spec, dy, x, *filled, src, tuple(running), ctx.residual_dtype, needs)
    elif ctx.eager and not compiling():
        residual = src if (ctx.has_residual and not spec.from_output) else None
        grads = _backward_kernels(
            spec, ctx.plan, dy, x, weight, bias, src, residual, stats, running, needs, ctx.residual_dtype
        )
    else:  # the op's gradients are empty tensors where not needed
        grads = _batch_norm_act_backward_op.call(
            dy,
            x,
            weight,
            bias,
            src,
            stats if stats is not None else x.new_empty(0, dtype=torch.float32),
            running[0] if running else None,
            running[1] if running else None,
            spec.use_batch_stats,
            spec.eps,
            int(spec.act),
            spec.negative_slope,
            -1 if ctx.residual_dtype is None else dtype_code(ctx.residual_dtype),
            list(needs),
        )
        grads = tuple(g if need else None for g, need in zip(grads, needs))
    return (*grads, None, None, None, None, None, None, None)


@tfuse_op("tfuse::batch_norm_act", setup_context=_batch_norm_act_setup, backward=_batch_norm_act_backward)
def _batch_norm_act_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    act: int,
    negative_slope: float,
    *,
    spec: _BatchNormSpec | None = None,
    plan: _ForwardPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.tfuse.batch_norm_act``: :func:`batch_norm_act` as a functional op (arguments checked
    by the caller).

    Returns ``(y, stats, new_running_mean, new_running_var)``: ``stats`` is
    what backward reads on the Triton path in training (the statistics
    table; empty otherwise); the running statistics updated with
    ``momentum`` in training with running statistics (empty otherwise),
    new tensors, for the caller to copy into its buffers.

    The eager Triton path passes its ``spec`` and ``plan`` (inputs already dense, in a layout the kernels
    read): the running statistics are then updated in place, as ``F.batch_norm`` does, and the outputs
    are ``(y, stats)`` in training, ``(y,)`` in eval.
    """
    if spec is not None:
        y, stats = _forward(spec, plan, x, weight, bias, residual, running_mean, running_var)
        return (y,) if stats is None else (y, stats)  # type: ignore[return-value]
    activation = Activation(act)
    backend = op_backend(x.device, "batch_norm_act", x)
    update = training and running_mean is not None
    nothing = x.new_empty(0, dtype=torch.float32)
    new_mean = running_mean.clone(memory_format=torch.contiguous_format) if update else nothing.clone()
    new_var = running_var.clone(memory_format=torch.contiguous_format) if update else nothing.clone()
    mean, var = (new_mean, new_var) if update else (running_mean, running_var)
    if backend is Backend.TORCH:
        if not training:
            y = _batch_norm_act_torch(
                x, mean, var, weight, bias, False, momentum, eps, activation, negative_slope, residual
            )
            return y, nothing, new_mean, new_var
        # Nothing mutated inside the op: F.batch_norm with batch statistics, the running ones computed from
        # the same statistics (updating a clone in place inside the op broke Inductor's functionalisation
        # on CUDA with torch 2.11: "copy_ ... clone" in the joint graph).
        y = _batch_norm_act_torch(
            x, None, None, weight, bias, True, momentum, eps, activation, negative_slope, residual
        )
        table, batch_mean, batch_var = _stats_table_torch(x, weight, bias, eps, residual)
        if update:
            count = x.numel() // x.shape[1]
            unbiased = batch_var * (count / (count - 1))
            new_mean = (running_mean.to(batch_mean.dtype) * (1.0 - momentum) + batch_mean * momentum).to(new_mean.dtype)
            new_var = (running_var.to(unbiased.dtype) * (1.0 - momentum) + unbiased * momentum).to(new_var.dtype)
        return y, table, new_mean, new_var
    weight, bias = _affine(weight, bias)
    if mean is not None and not (mean.is_contiguous() and var.is_contiguous()):
        mean, var = mean.contiguous(), var.contiguous()  # read only (eval): dense copies
    if _layout(x) is None:
        x = x.contiguous()
    if residual is not None:
        residual = _in_layout_of(residual, x)
    spec = _spec(activation, negative_slope, eps, momentum, training, update, int(x.shape[1]))
    plan = _plan_of(spec, x, weight, bias, residual, mean, var) if x.numel() else None
    y, stats = _forward(spec, plan, x, weight, bias, residual, mean, var)
    if stats is None:
        return y, nothing, new_mean, new_var
    return y, stats[: 4 * x.shape[1]], new_mean, new_var  # the table; the partials after it are the forward's own


def _stats_table_torch(x, weight, bias, eps: float, residual) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics table the Triton forward hands its backward, [mean, 1/std, weight/std, bias] per
    channel (flattened), in torch ops (the PyTorch path's op output has the Triton path's shape), with
    the batch mean and (biased) variance it was made of."""
    acc = acc_dtype(_out_dtype(x, residual))
    dims = [0, *range(2, x.dim())]
    xa = x.to(acc)
    var, mean = torch.var_mean(xa, dims, correction=0)
    invstd = torch.rsqrt(var + eps)
    scale = invstd if weight is None else weight.to(acc) * invstd
    shift = torch.zeros_like(mean) if bias is None else bias.to(acc)
    return torch.stack([mean, invstd, scale, shift]).flatten(), mean, var


def _affine(weight: torch.Tensor | None, bias: torch.Tensor | None) -> tuple:
    """Weight and bias as the kernels take them: both or neither, dense (one alone: torch's 1 or 0 for the other)."""
    if weight is None and bias is not None:
        weight = torch.ones_like(bias)
    elif bias is None and weight is not None:
        bias = torch.zeros_like(weight)
    if weight is not None and not (weight.is_contiguous() and bias.is_contiguous()):
        weight, bias = weight.contiguous(), bias.contiguous()
    return weight, bias


@tfuse_op("tfuse::batch_norm_act_backward")
def _batch_norm_act_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    src: torch.Tensor | None,
    stats: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    eps: float,
    act: int,
    negative_slope: float,
    residual_dtype: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.tfuse.batch_norm_act_backward``: ``(dx, dweight, dbias, dresidual)`` of
    ``torch.ops.tfuse.batch_norm_act``, empty where ``needs`` (x, weight, bias, residual) says no.

    ``src``: the forward's output for activations whose derivative follows from
    it (relu, leaky_relu >= 0, sigmoid, tanh, identity), else the residual;
    ``stats``: the forward's second output; ``residual_dtype``: a code of
    :data:`tfuse.ops._library.DTYPES`, or -1 without a residual.
    """
    activation = Activation(act)
    backend = op_backend(x.device, "batch_norm_act", x)
    has_residual = residual_dtype >= 0
    res_dtype = DTYPES[residual_dtype] if has_residual else None
    filled_weight, filled_bias = _affine(weight, bias)
    running = (running_mean, running_var) if not training else ()
    spec = _spec(activation, negative_slope, eps, 0.0, training, False, int(x.shape[1]))
    needs = tuple(needs)
    if backend is Backend.TORCH:
        grads = _backward_differentiable(spec, dy, x, filled_weight, filled_bias, src, running, res_dtype, needs)
    else:
        if _layout(x) is None:
            x = x.contiguous()
        if src is not None:
            src = _in_layout_of(src, x)
        residual = src if has_residual and not spec.from_output else None
        stand_in = None if not has_residual else (residual if residual is not None else x.new_empty(0, dtype=res_dtype))
        if running and not (running_mean.is_contiguous() and running_var.is_contiguous()):
            running = (running_mean.contiguous(), running_var.contiguous())
        plan = _plan_of(spec, x, filled_weight, filled_bias, stand_in, *(running or (None, None)))
        grads = _backward_kernels(
            spec,
            plan,
            dy,
            x,
            filled_weight,
            filled_bias,
            src,
            residual,
            stats if training else None,
            running,
            needs,
            res_dtype,
        )
    return tuple(g if g is not None else x.new_empty(0) for g in grads)  # type: ignore[return-value]
