"""``tfuse.add_act``: act(x + others...) in one launch forward, at most two backward.

What backward keeps (saved tensors), by activation:

* identity: nothing.
* relu, sigmoid, tanh, leaky_relu with negative_slope >= 0: the output y
  (their derivative follows from y), which the next layer usually keeps anyway.
* the others (gelu, gelu_tanh, silu, hardswish, mish, relu6, hardtanh,
  hardsigmoid, elu, leaky_relu with negative_slope < 0): the inputs x and
  others, and backward recomputes z = x + others; forward writes only y, and
  no pre-activation tensor is ever stored (see Activation.grad_source for why
  relu6, hardtanh, hardsigmoid and elu read z rather than y).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import torch

from tfuse import kernels
from tfuse._backend import Backend, interpreter_active, log_backend_once, select_backend
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
from tfuse._launch import gpu_sm_count, launch, target_programs
from tfuse.kernels import codes
from tfuse.ops._activations import Activation, GradSource, check_activation, math_mode
from tfuse.ops._checks import broadcast_shape, check_tensor_args, is_cpu_scalar, is_dense, promote_float_dtypes
from tfuse.ops._library import DTYPES, compiling, dtype_code, op_backend, tfuse_op
from tfuse.ops._tiles import (
    COL,
    COL_ALIGN,
    ELEMENTS_PER_THREAD,
    LINEAR,
    ROW,
    SCALAR,
    STRIDED,
    TILE_ELEMENTS,
    TilePlan,
    empty_broadcast_output,
    plan_layouts,
    plan_tiles,
    reduced_grad_strides,
    tile_meta,
)
from tfuse.ops.add import add_forward

_log = logging.getLogger(__name__)

#: Most tensors added to x before the activation.
MAX_OTHERS = 3
#: Stage-2 reduction tile: partial rows x gradient elements per step (elements
#: shrink to _SUM_MIN_ELEMENTS when that gives the launch more programs).
_SUM_BLOCK_PARTIALS = 16
_SUM_BLOCK_ELEMENTS = 128
_SUM_MIN_ELEMENTS = 32
#: Gradient mode of kernels/add_act.py for a per-channel bias (see its docstring).
CHAN = codes.CHAN
#: Backward programs per SM on a GPU, by num_warps. Each program loops over its
#: rows with one tile of loads in flight: 4 programs of 4 warps per SM (the
#: reduction target of tfuse._launch) measured 76-84% of copy bandwidth on an
#: H100 (gelu, silu bf16 16384^2), 8 per SM 86-95%. 7 is what a 4-warp program
#: of up to 73 registers (the kernel takes 45-72) keeps resident on every SM,
#: so all of them run in one wave, without a tail; the 8-warp per-channel
#: kernel (about 75 registers) keeps 3.
_GPU_BWD_PROGRAMS_PER_SM = {4: 7, 8: 3}
#: Widest column block of the backward (lanes); 8 warps above TILE_ELEMENTS.
_MAX_BWD_BLOCK_COLS = 2 * TILE_ELEMENTS


def add_act(
    x: torch.Tensor,
    *others: torch.Tensor,
    act: str = "relu",
    negative_slope: float | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """``act(x + others...)`` in one kernel launch, with a fused backward.

    ``others`` are 0 to 3 tensors that broadcast to ``x``'s shape: a bias over
    the last dimension, a per-channel ``[C, 1, 1]`` bias, a same-shape
    residual. Activations: relu, leaky_relu (``negative_slope``, default
    0.01; an error with any other activation, where it would have no effect),
    gelu (erf form), gelu_tanh, silu, sigmoid, tanh, relu6, hardtanh (-1 to
    1), hardswish, hardsigmoid, mish, elu (alpha 1), identity; values and
    gradients match torch.nn.functional, NaN and infinities included (see
    kernels/activations.py for the few inputs where torch's own float32
    formulas overflow). Computation is float32 (float64 for float64) with one
    rounding to the result dtype, which follows torch's promotion of
    ``x + others``.

    Backward computes the gradient of every input that requires one in one
    launch, plus one small launch that finishes the float32 reductions of
    broadcast inputs (bias gradients). What it saves: see the module docstring
    (the output for relu/leaky_relu/sigmoid/tanh, the inputs for
    gelu/gelu_tanh/silu, nothing for identity). Double backward
    (``create_graph=True``, e.g. a gradient penalty) is supported on both
    backends: that backward is computed with differentiable torch ops.

    With ``inplace=True`` the result is written into ``x`` (as
    ``F.relu(x, inplace=True)``), which saves allocating the output. It needs
    an activation whose gradient follows from its output (relu, sigmoid, tanh,
    leaky_relu with negative_slope >= 0) or identity, ``x`` in the result
    dtype, dense, and sharing no memory with ``others``.

    Example:
        >>> import torch, tfuse
        >>> x, bias = torch.randn(8, 32), torch.randn(32)
        >>> y = tfuse.add_act(x, bias, act="gelu")
        >>> torch.allclose(y, torch.nn.functional.gelu(x + bias), atol=1e-6)
        True

    Raises:
        TypeError: a non-tensor, non-floating or sparse input; more than 3
            others; a non-string ``act`` or non-number ``negative_slope``.
        ValueError: an unknown activation name; ``negative_slope`` with an
            activation other than leaky_relu; ``inplace=True`` with an
            activation that needs its input, or with an ``x`` that cannot hold
            the result.
        RuntimeError: inputs on different devices, or others that do not
            broadcast to ``x``'s shape.
    """
    act, negative_slope = check_activation("add_act", act, negative_slope, strict=True)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tfuse.add_act: x must be a torch.Tensor, got {type(x).__name__}")
    if len(others) > MAX_OTHERS:
        raise TypeError(f"tfuse.add_act takes x and 0 to {MAX_OTHERS} other tensors, got {len(others)} others")
    tensors = (x, *others)
    device = check_tensor_args("add_act", tensors, 1, MAX_OTHERS + 1)
    if device.type != "cpu" and any(is_cpu_scalar(t) for t in tensors):
        tensors = tuple(t.to(device) if is_cpu_scalar(t) else t for t in tensors)
    shape = broadcast_shape("add_act", [t.shape for t in tensors])
    if shape != x.shape:
        culprit = next(
            i
            for i, t in enumerate(tensors)
            if len(t.shape) > x.dim() or broadcast_shape("add_act", [x.shape, t.shape]) != x.shape
        )
        raise RuntimeError(
            f"tfuse.add_act: argument {culprit} of shape {list(tensors[culprit].shape)} does not broadcast "
            f"to x's shape {list(x.shape)} (the output has x's shape)"
        )
    dtype = promote_float_dtypes(tensors)
    if inplace:
        _check_inplace(act, negative_slope, tensors, dtype)
    if compiling():
        return _add_act_traced(tensors, act, negative_slope, inplace)
    backend = select_backend(device, "add_act", x.numel())
    log_backend_once(_log, "add_act", backend, device)
    spec = _ActSpec(act, negative_slope, backend, inplace)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _add_act_op.apply(list(tensors), spec.act, spec.negative_slope, spec=spec, dtype=dtype)
    return add_act_forward(tensors, dtype, spec)


def linear_epilogue(
    product: torch.Tensor, bias: torch.Tensor | None, act: Activation, negative_slope: float, inplace: bool
) -> torch.Tensor:
    """``act(product + bias)`` for layers whose arguments are valid by construction.

    FusedLinear calls this with its own matmul output and bias parameter
    (already checked activation, bias of the right shape and dtype): it skips
    the argument checks of :func:`add_act`, which would cost a good part of a
    small layer's time, and keeps only the backend choice.
    """
    tensors = (product,) if bias is None else (product, bias)
    if compiling():
        return _add_act_traced(tensors, act, negative_slope, inplace)
    backend = select_backend(product.device, "add_act", product.numel())
    log_backend_once(_log, "add_act", backend, product.device)
    spec = _ActSpec(act, negative_slope, backend, inplace)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _add_act_op.apply(list(tensors), act, negative_slope, spec=spec, dtype=product.dtype)
    return add_act_forward(tensors, product.dtype, spec)


def _check_inplace(act: Activation, negative_slope: float, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    x = tensors[0]
    if act.grad_source(negative_slope) is GradSource.INPUT:
        raise ValueError(
            f"tfuse.add_act: inplace=True needs an activation whose gradient follows from its output "
            f"(relu, sigmoid, tanh, leaky_relu with negative_slope >= 0, identity); {act.label} "
            f"(negative_slope={negative_slope}) needs its input, which inplace would overwrite"
        )
    if x.dtype != dtype:
        raise ValueError(f"tfuse.add_act: inplace=True writes into x of dtype {x.dtype}, but the result is {dtype}")
    if not is_dense(x):
        raise ValueError(
            f"tfuse.add_act: inplace=True needs a dense x (no overlapping or skipped elements); "
            f"x has shape {list(x.shape)} and strides {list(x.stride())}"
        )
    if compiling():
        return  # traced: the op computes out of place and copies into x, so shared memory is harmless
    storage = x.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in tensors[1:]):
        raise ValueError("tfuse.add_act: inplace=True needs others that share no memory with x")


@dataclasses.dataclass(frozen=True)
class _ActSpec:
    act: Activation
    negative_slope: float
    backend: Backend | None  # None: not chosen by the caller (the registered op chooses where it runs)
    inplace: bool = False


def add_act_forward(tensors: Sequence[torch.Tensor], dtype: torch.dtype, spec: _ActSpec) -> torch.Tensor:
    """``act(sum(tensors))``, shaped and laid out like ``tensors[0]`` (written into it with inplace)."""
    if spec.backend is Backend.TORCH:
        x = tensors[0]
        if spec.inplace and x.dtype == acc_dtype(dtype):
            for other in tensors[1:]:
                x.add_(other)  # already the accumulation dtype: sum and act straight in x
            result = spec.act.forward_(x, spec.negative_slope)
            return result if result is x else x.copy_(result)
        result = _add_act_torch(tensors, dtype, spec)
        return x.copy_(result) if spec.inplace else result
    out = tensors[0] if spec.inplace else empty_broadcast_output(tensors, tensors[0].shape, dtype)
    if out.numel() == 0:
        return out
    plan = plan_tiles(out, tensors, max_col_rank=None)
    launch(
        kernels._add_act_fwd_kernel,
        plan.grid,
        (
            out,
            tuple(tensors),
            plan.in_strides,
            plan.outer_sizes,
            plan.col_divs,
            plan.n_rows,
            plan.n_cols,
            *split_float(spec.negative_slope),
        ),
        dict(
            N_INPUTS=len(tensors),
            ACT=spec.act.code,
            MATH=math_mode(out.dtype, interpreter_active()),
            **tile_meta(plan, out),
        ),
        out.device,
    )
    return out


def _add_act_torch(tensors: Sequence[torch.Tensor], dtype: torch.dtype, spec: _ActSpec) -> torch.Tensor:
    """The PyTorch path: z summed in float32 (float64) into a fresh tensor, act in place, one rounding."""
    z = _sum_torch(tensors, acc_dtype(dtype), fresh=True)
    y = spec.act.forward_(z, spec.negative_slope)
    return y if y.dtype == dtype else y.to(dtype)


def _sum_torch(tensors: Sequence[torch.Tensor], acc: torch.dtype, fresh: bool = False) -> torch.Tensor:
    """z = sum(tensors) in the accumulator dtype ``acc``, laid out like the first tensor (PyTorch path).

    With ``fresh`` the result never aliases an input, so it may be modified in place.
    """
    if len(tensors) == 1:
        return tensors[0].to(acc, copy=fresh)
    return add_forward(tensors, tensors[0].shape, acc, Backend.TORCH)


def _backward_torch(ctx, grad_out: torch.Tensor, saved: Sequence[torch.Tensor], needed: Sequence[bool]) -> list:
    """The PyTorch path's backward, and every backward under ``create_graph=True``.

    Under ``create_graph`` (grad mode on in backward) every step is a
    differentiable torch op (torch's activation backward kernels have
    derivatives of their own, and a saved output leads back to this
    Function), so the gradients can be differentiated again.
    """
    spec = ctx.spec
    acc = acc_dtype(grad_out.dtype, *(d for _, d in ctx.input_meta))
    dy = grad_out.to(acc)
    if ctx.grad_source is GradSource.NONE:
        source = None
    elif ctx.grad_source is GradSource.OUTPUT:
        source = saved[0].to(acc)
    elif torch.is_grad_enabled():
        source = saved[0].to(acc)
        for tensor in saved[1:]:
            source = source + tensor.to(acc)
    else:
        source = _sum_torch(saved, acc)
    dz = spec.act.backward(dy, source, spec.negative_slope)
    grads = []
    for (shape, dtype), need in zip(ctx.input_meta, needed):
        if not need:
            grads.append(None)
            continue
        grad = dz if shape == dz.shape else dz.sum_to_size(shape)
        grads.append(grad.to(dtype))
    return grads


def _backward_triton(ctx, grad_out: torch.Tensor, saved: Sequence[torch.Tensor], needed: Sequence[bool]) -> list:
    spec = ctx.spec
    out_shape, out_strides = ctx.out_layout
    device = grad_out.device
    if math.prod(out_shape) == 0:
        return [
            torch.zeros(shape, dtype=dtype, device=device) if need else None
            for (shape, dtype), need in zip(ctx.input_meta, needed)
        ]

    sources = () if ctx.grad_source is GradSource.NONE else tuple(saved)
    bwd = _backward_plan(
        tuple(out_shape),
        tuple(out_strides),
        tuple(ctx.input_meta),
        tuple(bool(n) for n in needed),
        (tuple(grad_out.shape), grad_out.stride(), grad_out.dtype),
        tuple((tuple(t.shape), t.stride()) for t in sources),
        spec.act.code,
        ctx.grad_source is GradSource.OUTPUT,
        gpu_sm_count(device),
        target_programs(device),
        interpreter_active(),
    )
    grads = [torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype, _ in bwd.slots]
    partials = [
        grad if n_partials is None else torch.empty(n_partials * grad.numel(), dtype=bwd.acc_dtype, device=device)
        for grad, n_partials in zip(grads, bwd.n_partials)
    ]
    launch(
        kernels._add_act_bwd_kernel,
        bwd.grid,
        (
            grad_out,
            bwd.dy_strides,
            sources,
            bwd.src_strides,
            tuple(partials),
            *bwd.static_args,
            *split_float(spec.negative_slope),
        ),
        bwd.meta,
        device,
    )
    if bwd.reduced:
        launch(
            kernels._sum_partials_kernel,
            bwd.sum_grid,
            (
                tuple(partials[i] for i in bwd.reduced),
                tuple(grads[i] for i in bwd.reduced),
                tuple(bwd.n_partials[i] for i in bwd.reduced),
                tuple(grads[i].numel() for i in bwd.reduced),
            ),
            bwd.sum_meta,
            device,
        )

    result: list[torch.Tensor | None] = [None] * len(ctx.input_meta)
    for grad, (_, _, _, indices) in zip(grads, bwd.slots):
        for index in indices:
            result[index] = grad
    return result


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    """Everything the backward launches need that depends on layouts only (cached per layout).

    slots: per gradient buffer (shape, strides, dtype, input indices it serves).
    n_partials: per slot, the partial rows of its float32 reduction (None for LINEAR).
    reduced: indices of the slots that need the second stage.
    static_args: the backward kernel's arguments after grad_ptrs, up to negative_slope.
    """

    slots: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, tuple[int, ...]], ...]
    n_partials: tuple[int | None, ...]
    reduced: tuple[int, ...]
    acc_dtype: torch.dtype
    dy_strides: tuple[int, ...]
    src_strides: tuple[tuple[int, ...], ...]
    static_args: tuple
    grid: tuple[int, int]
    meta: dict
    sum_grid: tuple[int]
    sum_meta: dict


@functools.lru_cache(maxsize=1024)
def _backward_plan(
    out_shape: tuple[int, ...],
    out_strides: tuple[int, ...],
    input_meta: tuple[tuple[torch.Size, torch.dtype], ...],
    needed: tuple[bool, ...],
    dy_layout: tuple[tuple[int, ...], tuple[int, ...], torch.dtype],
    src_layouts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
    act_code: int,
    from_output: bool,
    sms: int | None,
    programs: int,
    interpreted: bool,
) -> _BackwardPlan:
    # One gradient buffer per slot (grad_slots: full-size inputs of one dtype share one).
    slots = []
    for indices in grad_slots(out_shape, input_meta, needed):
        shape, dtype = input_meta[indices[0]]
        if tuple(shape) == out_shape:
            slots.append((out_shape, out_strides, dtype, indices))
        else:
            slots.append((tuple(shape), reduced_grad_strides(shape, out_shape, out_strides), dtype, indices))

    n_src = len(src_layouts)
    layouts = [dy_layout[:2], *src_layouts, *((shape, strides) for shape, strides, _, _ in slots)]
    plan = plan_layouts(out_shape, out_strides, layouts, max_col_rank=None)
    grad_modes = _grad_modes(plan, n_src)
    if grad_modes is None:  # a reduction the wide columns cannot serve: one column dimension
        plan = plan_layouts(out_shape, out_strides, layouts, max_col_rank=1)
        grad_modes = plan.modes[1 + n_src :]
    grad_strides = plan.merged_strides[1 + n_src :]
    block_rows, block_cols, block_width = _backward_blocks(plan, CHAN in grad_modes)

    n_col_blocks = -(-plan.n_cols // block_width)
    row_chunks = -(-plan.n_rows // block_rows)
    warps = num_warps(block_rows * block_cols, ELEMENTS_PER_THREAD)
    if sms is not None:
        # All programs resident at once (one wave, no tail): see _GPU_BWD_PROGRAMS_PER_SM.
        programs = sms * _GPU_BWD_PROGRAMS_PER_SM[warps]
    groups = min(row_chunks, max(1, programs // n_col_blocks))
    rows_per_group = -(-row_chunks // groups) * block_rows
    groups = -(-plan.n_rows // rows_per_group)

    acc = acc_dtype(dy_layout[2], *(dtype for _, _, dtype, _ in slots))
    n_partials, red_strides, numels, n_bcasts = [], [], [], []
    largest_partial = 0
    for (shape, _, _, _), mode, strides in zip(slots, grad_modes, grad_strides):
        red, n_bcast = _broadcast_row_strides(plan, strides)
        numel = math.prod(shape)
        if mode == LINEAR:
            count = None
        elif mode in (COL, CHAN):
            count = groups
        elif mode == SCALAR:
            count = groups * n_col_blocks
        elif mode == ROW:
            count = n_col_blocks * n_bcast
        else:  # STRIDED: dz itself, per broadcast coordinate
            count = n_bcast
        if count is not None:
            largest_partial = max(largest_partial, count * numel)
        n_partials.append(count)
        red_strides.append(red)
        numels.append(numel)
        n_bcasts.append(n_bcast)

    meta = dict(
        DY_MODE=plan.modes[0],
        N_SRC=n_src,
        SRC_MODES=plan.modes[1 : 1 + n_src],
        FROM_OUTPUT=from_output,
        N_GRADS=len(slots),
        GRAD_MODES=grad_modes,
        OUTER_RANK=len(plan.outer_sizes),
        COL_RANK=plan.col_rank,
        ACT=act_code,
        MATH=math_mode(acc, interpreted),
        INDEX_64=plan.index_64 or needs_int64(largest_partial),
        ACC_FP64=acc_fp64(acc),
        EMULATE_BF16_RTNE=emulate_bf16_rtne(),
        ONE_ROW=plan.n_rows == 1,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        PIXELS_POW2=next_power_of_2(plan.col_sizes[-1]) if CHAN in grad_modes else 1,
        num_warps=warps,
    )
    reduced = tuple(i for i, count in enumerate(n_partials) if count is not None)
    largest = max((numels[i] for i in reduced), default=1)
    sum_elements = _SUM_BLOCK_ELEMENTS
    while sum_elements > _SUM_MIN_ELEMENTS and -(-largest // sum_elements) < programs:
        sum_elements //= 2
    return _BackwardPlan(
        slots=tuple((shape, strides, dtype, tuple(indices)) for shape, strides, dtype, indices in slots),
        n_partials=tuple(n_partials),
        reduced=reduced,
        acc_dtype=acc,
        dy_strides=plan.in_strides[0],
        src_strides=plan.in_strides[1 : 1 + n_src],
        static_args=(
            grad_strides,
            tuple(red_strides),
            tuple(numels),
            tuple(n_bcasts),
            plan.outer_sizes,
            plan.col_divs,
            plan.n_rows,
            plan.n_cols,
            rows_per_group,
            block_width,
        ),
        grid=(n_col_blocks, groups),
        meta=meta,
        sum_grid=(-(-largest // sum_elements),),
        sum_meta=dict(
            N=len(reduced),
            INDEX_64=needs_int64(largest_partial),
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            BLOCK_PARTIALS=_SUM_BLOCK_PARTIALS,
            BLOCK_ELEMENTS=sum_elements,
            num_warps=NUM_WARPS,
        ),
    )


def _grad_modes(plan: TilePlan, n_src: int) -> tuple[int, ...] | None:
    """The gradient slots' modes for the backward kernel, or None if a reduction does not fit ``plan``.

    With one column dimension every mode works. With wide columns a reduced
    gradient must not fold distinct columns onto one element, except a
    per-channel gradient of two column dimensions (channel, pixel) whose
    pixel stride is 0 (mode CHAN: whole channels per column block).
    """
    modes = plan.modes[1 + n_src :]
    if plan.col_rank == 1:
        return modes
    outer_rank = len(plan.outer_sizes)
    result = []
    for mode, strides in zip(modes, plan.merged_strides[1 + n_src :]):
        col_strides = strides[outer_rank:]
        if mode in (COL, STRIDED) and 0 in col_strides:
            if mode == COL and plan.col_rank == 2 and col_strides[0] != 0 and plan.col_sizes[1] <= _MAX_BWD_BLOCK_COLS:
                mode = CHAN
            else:
                return None
        result.append(mode)
    return tuple(result)


def _backward_blocks(plan: TilePlan, per_channel: bool) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, block_width) of the backward.

    A per-channel (CHAN) gradient needs column blocks of whole channels: the
    most channels whose pixels fit BLOCK_COLS lanes and keep block starts
    16-element aligned, on 2048 or 4096 lanes, whichever wastes fewer.
    """
    if not per_channel or plan.n_cols <= plan.block_cols:
        return plan.block_rows, plan.block_cols, plan.block_cols
    pixels = plan.col_sizes[1]
    step = COL_ALIGN // math.gcd(pixels, COL_ALIGN)  # channels per aligned block start
    best = None
    for lanes in (TILE_ELEMENTS, _MAX_BWD_BLOCK_COLS):
        channels = (lanes // pixels) // step * step or lanes // pixels
        if channels and (best is None or channels * pixels / lanes > best[1] * 1.1):
            best = (lanes, channels * pixels / lanes, channels * pixels)
    assert best is not None
    return 1, best[0], best[2]


def _empty_grad(shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A gradient buffer; every element is written by the backward kernels."""
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype, device=device)


def _broadcast_row_strides(plan: TilePlan, strides: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Strides over the merged outer dims that index the broadcast coordinates of an operand.

    Outer dims where the operand's stride is 0 get contiguous strides (innermost
    first); the others 0. Returns those strides (plus a trailing 0 for the
    column dim) and the number of broadcast coordinates.
    """
    red = [0] * (len(plan.outer_sizes) + 1)
    running = 1
    for dim in range(len(plan.outer_sizes) - 1, -1, -1):
        if strides[dim] == 0:
            red[dim] = running
            running *= plan.outer_sizes[dim]
    return tuple(red), running


# ---------------------------------------------------------------------------- the torch.library ops


def _add_act_traced(tensors: Sequence[torch.Tensor], act: Activation, negative_slope: float, inplace: bool):
    """What :func:`add_act` is under ``torch.compile``: the registered op (``inplace``: copied into x,
    which functionalization turns back into one buffer)."""
    y = torch.ops.tfuse.add_act(list(tensors), int(act), float(negative_slope))
    return tensors[0].copy_(y) if inplace else y


@dataclasses.dataclass
class _BackwardArgs:
    """What the backward functions read (the fields :func:`_add_act_setup` puts on an autograd ctx)."""

    spec: _ActSpec
    input_meta: list[tuple[torch.Size, torch.dtype]]
    out_layout: tuple[torch.Size, tuple[int, ...]]
    grad_source: GradSource


def grad_slots(
    out_shape: Sequence[int], input_meta: Sequence[tuple[Sequence[int], torch.dtype]], needed: Sequence[bool]
) -> list[list[int]]:
    """The inputs each gradient buffer of the backward serves: full-size inputs of one dtype share one
    buffer (their gradients are equal), every broadcast input gets its own."""
    slots: list[list[int]] = []
    full_size: dict[torch.dtype, int] = {}
    for index, ((shape, dtype), need) in enumerate(zip(input_meta, needed)):
        if not need:
            continue
        if tuple(shape) == tuple(out_shape):
            if dtype not in full_size:
                full_size[dtype] = len(slots)
                slots.append([])
            slots[full_size[dtype]].append(index)
        else:
            slots.append([index])
    return slots


@tfuse_op("tfuse::add_act_backward")
def _add_act_backward_op(
    grad_out: torch.Tensor,
    saved: list[torch.Tensor],
    act: int,
    negative_slope: float,
    out_shape: list[int],
    out_strides: list[int],
    input_shapes: list[int],
    input_ranks: list[int],
    input_dtypes: list[int],
    needed: list[bool],
) -> list[torch.Tensor]:
    """``torch.ops.tfuse.add_act_backward``: the gradients of :func:`add_act`'s inputs, one tensor per
    gradient buffer (see :func:`grad_slots`: inputs of the output's shape and one dtype share one).

    ``saved``: what the forward kept (nothing, the output, or the inputs; see
    the module docstring); ``input_shapes``: the inputs' shapes one after the
    other, ``input_ranks`` their lengths; ``input_dtypes``: codes of
    :data:`tfuse.ops._library.DTYPES`.
    """
    meta, offset = [], 0
    for rank, code in zip(input_ranks, input_dtypes):
        meta.append((torch.Size(input_shapes[offset : offset + rank]), DTYPES[code]))
        offset += rank
    activation = Activation(act)
    backend = op_backend(grad_out.device, "add_act", grad_out)
    args = _BackwardArgs(
        _ActSpec(activation, negative_slope, backend),
        meta,
        (torch.Size(out_shape), tuple(out_strides)),
        activation.grad_source(negative_slope),
    )
    if backend is Backend.TRITON:
        grads = _backward_triton(args, grad_out, saved, needed)
    else:
        grads = _backward_torch(args, grad_out, saved, needed)
    result = []
    for indices in grad_slots(out_shape, meta, needed):
        grad = grads[indices[0]]
        if any(grad.untyped_storage() is t.untyped_storage() for t in (grad_out, *saved)):
            grad = grad.clone()  # an op's outputs never alias its inputs
        result.append(grad)
    return result


def _add_act_setup(ctx, inputs, output, spec: _ActSpec | None = None, dtype: torch.dtype | None = None) -> None:  # type: ignore[no-untyped-def]
    """What backward reads: the activation, the inputs' shapes and dtypes, the output's layout, and the
    tensors the activation's derivative follows from (nothing, the output, or the inputs).

    ``spec``: the eager caller's (its backend, and ``inplace``, which marks x dirty); None for the
    registered op, whose backward goes through ``torch.ops.tfuse.add_act_backward``.
    """
    tensors, act, negative_slope = inputs
    if spec is None:
        spec = _ActSpec(Activation(act), negative_slope, None)
    elif spec.inplace:
        ctx.mark_dirty(output)
    ctx.spec = spec
    ctx.grad_source = spec.act.grad_source(spec.negative_slope)
    ctx.input_meta = [(t.shape, t.dtype) for t in tensors]
    ctx.out_layout = (output.shape, output.stride())
    if ctx.grad_source is GradSource.OUTPUT:
        ctx.save_for_backward(output)
    elif ctx.grad_source is GradSource.INPUT:
        ctx.save_for_backward(*tensors)


def _add_act_backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    """The gradients of add_act's inputs: differentiable torch ops under ``create_graph=True``; the
    eager caller's backend straight from Python; the backward op when traced (or for the registered op)."""
    needed = list(ctx.needs_input_grad[0])
    saved = ctx.saved_tensors
    spec = ctx.spec
    if torch.is_grad_enabled():  # create_graph=True: differentiable torch ops (see _backward_torch)
        return _backward_torch(ctx, grad_out, saved, needed), None, None
    if spec.backend is not None and not compiling():
        backward = _backward_triton if spec.backend is Backend.TRITON else _backward_torch
        return backward(ctx, grad_out, saved, needed), None, None
    out_shape, out_strides = ctx.out_layout
    slots = _add_act_backward_op.call(
        grad_out,
        list(saved),
        int(spec.act),
        spec.negative_slope,
        list(out_shape),
        list(out_strides),
        [size for shape, _ in ctx.input_meta for size in shape],
        [len(shape) for shape, _ in ctx.input_meta],
        [dtype_code(dtype) for _, dtype in ctx.input_meta],
        needed,
    )
    grads: list[torch.Tensor | None] = [None] * len(ctx.input_meta)
    for grad, indices in zip(slots, grad_slots(out_shape, ctx.input_meta, needed)):
        for index in indices:
            grads[index] = grad
    return grads, None, None


@tfuse_op("tfuse::add_act", setup_context=_add_act_setup, backward=_add_act_backward)
def _add_act_op(
    tensors: list[torch.Tensor],
    act: int,
    negative_slope: float,
    *,
    spec: _ActSpec | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch.ops.tfuse.add_act``: ``act(sum(tensors))`` (:func:`add_act`; arguments checked by the caller).

    The eager caller passes its ``spec`` (activation, backend, inplace) and the result ``dtype``.
    """
    if spec is None:
        backend = op_backend(tensors[0].device, "add_act", tensors[0])
        spec = _ActSpec(Activation(act), negative_slope, backend)
    return add_act_forward(tensors, promote_float_dtypes(tensors) if dtype is None else dtype, spec)
