"""``clip_grad_norm_`` over flat gradient buffers: one two-stage reduction, one scaling pass.

Host cost is what limits a clip over a real model (the kernels stream a
ResNet-50's 100 MB of gradients in well under a millisecond), so everything
that does not change from one step to the next is worked out once and cached:

* a *plan* per parameter list (keyed by the parameters' identities, checked
  through weak references, and by the layout version of every FlatParams
  involved): which parameters have a gradient slot in which flat buffer, at
  which offsets (read from the FlatParams' stated layout,
  :meth:`~tfuse.flat.FlatParams.range_of`), and which do not. The FlatParams
  are the ones handed in (a FlatParams, or a tfuse optimizer's
  ``flat_params``); plain parameters lead to theirs through
  :func:`~tfuse.flat.flat_params_of` once, when the plan is made;
* per flat buffer of a plan, *block tables* keyed by which slots hold a
  gradient this call: device tensors that the kernels read, so a call that
  reuses one copies nothing from the host.

A call then only reads every ``param.grad`` once, checks that it is the
parameter's view of the flat buffer (identity, with a fallback to a memory
check), and launches three kernels per device. A gradient that is not in its
slot (set by hand, ``create_graph=True``, a parameter without a slot or not
in a FlatParams) is handled with torch's foreach ops, as torch does.
"""

from __future__ import annotations

import collections
import functools
import math
import numbers
import operator
import types
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from tfuse import kernels
from tfuse._backend import Backend, select_backend
from tfuse._kit import acc_dtype, emulate_bf16_rtne, num_warps, split_float
from tfuse._launch import launch
from tfuse.flat import FlatParams
from tfuse.kernels import codes
from tfuse.optim._clip_plan import BLOCK, _Plan, _plan_for, _Segment, _Table

NUM_WARPS = num_warps(BLOCK, 16)  # 16 elements (four 128-bit vectors of float32) per thread: 8 warps
FINAL_BLOCK = 4096  # partials per iteration of the final kernel (GPT-2 small has ~30k partials)
FINAL_NUM_WARPS = num_warps(FINAL_BLOCK, 16)
_GRAD = operator.attrgetter("grad")
_NORM_KINDS = {2.0: codes.NORM_2, 1.0: codes.NORM_1, math.inf: codes.NORM_INF}


def clip_grad_norm_(
    parameters: torch.optim.Optimizer | FlatParams | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clips gradients by their total norm, like ``torch.nn.utils.clip_grad_norm_``.

    Same arguments, semantics and return value as torch's: the norm of all
    gradients that are not None taken together (a parameter listed twice
    counts twice, as in torch), each gradient multiplied in place by
    ``min(max_norm / (norm + 1e-6), 1)`` on the device without a host sync
    (a NaN norm makes the gradients NaN), the total norm returned on the
    first gradient's device in the gradients' promoted dtype (``tensor(0.)``
    on the CPU when there is no gradient). Empty gradients add nothing to
    the norm, also the infinity norm (where torch's foreach path raises).

    Gradients that are their parameter's view of a
    :class:`~tfuse.flat.FlatParams` gradient buffer are reduced by one
    kernel per buffer plus one final kernel per device, and scaled by one
    kernel per buffer, reading and writing only the slots that hold
    gradients (never padding, nor the stale slots of parameters whose grad
    is None). Norms accumulate in float32 (float64 when a float64 gradient
    takes part) and are rounded once to the result dtype; the scaling
    coefficient comes from that rounded norm, as in torch. Any other
    gradient, and every gradient on the PyTorch backend, goes through
    torch's foreach ops. The work that does not change between steps
    (which parameters live where, the kernels' block tables) is cached, see
    the module docstring.

    Gradients sharded by a :class:`~tfuse.distributed.ShardedOptimizer`
    (each rank holds its shard of the average) are clipped by that
    optimizer's :meth:`~tfuse.distributed.ShardedOptimizer.clip_grad_norm_`
    (the norm of all shards); ``parameters`` must then be exactly its
    parameters (ValueError otherwise).

    Args:
        parameters: an optimizer (its parameters), a FlatParams, a tensor,
            or an iterable of tensors.
        max_norm: the largest total norm allowed.
        norm_type: p > 0 of the p-norm, or ``inf`` / ``"inf"``.
        error_if_nonfinite: raise if the total norm is NaN or infinite
            (this reads the norm on the host, as torch does).
        foreach: for gradients handled with torch ops, as in torch: None
            uses the foreach ops where the device supports them, True
            requires them, False loops over tensors.

    Example:
        >>> import torch
        >>> from tfuse.flat import FlatParams
        >>> from tfuse.optim import clip_grad_norm_
        >>> model = torch.nn.Linear(4, 3)
        >>> flat = FlatParams(model.parameters())
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> norm = clip_grad_norm_(flat, max_norm=1.0)
        >>> bool(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in flat])) <= 1.0 + 1e-5)
        True
    """
    homes: tuple[FlatParams, ...] | None = None  # the FlatParams the parameters may live in, when known
    if isinstance(parameters, torch.optim.Optimizer):
        params = [param for group in parameters.param_groups for param in group["params"]]
        homes = getattr(parameters, "flat_params", None)
    elif isinstance(parameters, FlatParams):
        params = parameters.params
        homes = (parameters,)
    elif isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if is_generator and not params:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    p = _check_norm_type(norm_type)
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"clip_grad_norm_: max_norm must be a number, got {type(max_norm).__name__}")
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"clip_grad_norm_: foreach must be None or a bool, got {type(foreach).__name__}")
    max_norm = float(max_norm)

    grads = list(map(_GRAD, params))
    plan = _plan_for(params, grads, homes)
    sharder = _sharder_of(plan)
    if sharder is not None:
        return _clip_sharded(sharder, params, max_norm, p, error_if_nonfinite)
    loose: list[torch.Tensor] = [grads[i] for i in plan.other_index if grads[i] is not None]
    flags = plan.slot_flags(grads, loose)
    first = next((g for g in grads if g is not None), None)
    if first is None:
        return torch.tensor(0.0)

    # The flat segments that hold at least one gradient, by device; the PyTorch backend takes
    # their gradients through the foreach path instead.
    on_device: dict[torch.device, list[tuple[_Segment, _Table]]] = {}
    dtypes = {g.dtype for g in loose}
    backends: dict[torch.device, Backend] = {}
    for segment in plan.segments:
        active = flags[segment.first : segment.stop]
        if not any(active):
            continue
        dtypes.add(segment.dtype)
        backend = backends.get(segment.device)
        if backend is None:
            backend = backends[segment.device] = select_backend(segment.device, "clip_grad_norm_")
        if backend is Backend.TRITON:
            on_device.setdefault(segment.device, []).append((segment, segment.table(active)))
        else:
            loose.extend(segment.grads(grads, active, plan.slot_index))
    result_dtype = functools.reduce(torch.promote_types, dtypes)
    alone = len(on_device) == 1 and not loose  # the kernels' norm is the total: store it in the result dtype

    parts = [_flat_norm(device, work, p, result_dtype if alone else None) for device, work in on_device.items()]
    if loose:
        # An empty gradient adds nothing to the norm; torch's foreach max-norm rejects it, so leave it out.
        parts.extend(_foreach_norms([g for g in loose if g.numel()] if math.isinf(p) else loose, p, foreach))
    if not parts:  # only empty gradients, all on the PyTorch path
        parts.append(torch.zeros((), dtype=result_dtype, device=first.device))
    if len(parts) == 1 and alone:
        total = parts[0]
    else:
        with torch.no_grad():
            total = torch.linalg.vector_norm(torch.stack([n.to(first.device) for n in parts]), p).to(result_dtype)

    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    max_hi, max_lo = split_float(max_norm)
    for device, work in on_device.items():
        norm = total if total.device == device else total.to(device)
        for segment, table in work:
            if not table.n_blocks:
                continue
            launch(
                kernels._clip_segments_kernel,
                (table.n_blocks,),
                (segment.buffer(), table.blocks, norm, max_hi, max_lo),
                dict(
                    ALIGN=segment.align,
                    HAS_TAIL=table.has_tail,
                    EMULATE_BF16_RTNE=emulate_bf16_rtne(),
                    BLOCK=BLOCK,
                    num_warps=NUM_WARPS,
                ),
                device,
            )
    if loose:
        _foreach_scale(loose, max_norm, total, foreach)
    return total


def _sharder_of(plan: _Plan) -> Any:
    """The live ShardedOptimizer that shards the FlatParams of any of the plan's gradients, if any."""
    for segment in plan.segments:
        owner = segment.owner()
        sharder = owner.sharded_by if owner is not None else None
        if sharder is not None:
            return sharder
    return None


def _clip_sharded(sharder: Any, params: list[torch.Tensor], max_norm: float, p: float, error_if_nonfinite: bool):
    """Sharded gradients: a per-rank norm would be one shard's; the ShardedOptimizer takes the norm of all shards."""
    mine = [param for group in sharder.param_groups for param in group["params"]]
    if len(params) != len(mine) or {id(q) for q in params} != {id(q) for q in mine}:
        raise ValueError(
            "clip_grad_norm_: some of these parameters' gradients are sharded by a ShardedOptimizer (each rank "
            "holds its own shard), so a norm of a subset, or of parameters it does not hold, cannot be taken "
            "here; clip all of its parameters together with optimizer.clip_grad_norm_(max_norm) (or pass the "
            "ShardedOptimizer or model.parameters() of the wrapped model)"
        )
    return sharder.clip_grad_norm_(max_norm, p, error_if_nonfinite)


def _check_norm_type(norm_type: float | str) -> float:
    if isinstance(norm_type, str):
        if norm_type.lower() != "inf":
            raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or 'inf', got {norm_type!r}")
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or 'inf', got {norm_type!r}")
    return float(norm_type)


def _flat_norm(
    device: torch.device, work: list[tuple[_Segment, _Table]], p: float, out_dtype: torch.dtype | None
) -> torch.Tensor:
    """Norm of the flat segments on ``device``: one partial kernel per segment, one final kernel."""
    acc = acc_dtype(*(segment.dtype for segment, _ in work))
    kind = _NORM_KINDS.get(p, codes.NORM_P)
    p_hi, p_lo = split_float(p if math.isfinite(p) else 1.0)
    n_partials = sum(table.n_blocks for _, table in work)
    partials = torch.empty(max(n_partials, 1), dtype=acc, device=device)
    offset = 0
    for segment, table in work:
        if table.n_blocks:
            launch(
                kernels._norm_partial_kernel,
                (table.n_blocks,),
                (segment.buffer(), table.blocks, partials, offset, p_hi, p_lo),
                dict(NORM=kind, ALIGN=segment.align, HAS_TAIL=table.has_tail, BLOCK=BLOCK, num_warps=NUM_WARPS),
                device,
            )
            offset += table.n_blocks
    total = torch.empty((), dtype=out_dtype or acc, device=device)
    launch(
        kernels._norm_final_kernel,
        (1,),
        (partials, n_partials, total, p_hi, p_lo),
        dict(NORM=kind, EMULATE_BF16_RTNE=emulate_bf16_rtne(), BLOCK=FINAL_BLOCK, num_warps=FINAL_NUM_WARPS),
        device,
    )
    return total


def _grouped(grads: list[torch.Tensor]):
    return _group_tensors_by_device_and_dtype([grads]).items()  # type: ignore[list-item]


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's rule: foreach ops where the device supports them; foreach=True insists, False never."""
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return foreach


@torch.no_grad()
def _foreach_norms(grads: list[torch.Tensor], p: float, foreach: bool | None) -> list[torch.Tensor]:
    """One norm per gradient (in its dtype), with torch's foreach ops per (device, dtype)."""
    norms: list[torch.Tensor] = []
    for (device, _), ([tensors], _) in _grouped(grads):
        if _use_foreach(tensors, device, foreach):
            norms.extend(torch._foreach_norm(tensors, p))
        else:
            norms.extend(torch.linalg.vector_norm(g, p) for g in tensors)
    return norms


@torch.no_grad()
def _foreach_scale(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None) -> None:
    """Multiplies every gradient by torch's coefficient, a gradient listed k times k times.

    A tensor appears at most once per foreach call: CUDA's foreach kernel would race on a repeat
    (both chunks read the unscaled values), so repeats go into later rounds.
    """
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    rounds: list[list[torch.Tensor]] = [grads]
    if len(set(map(id, grads))) != len(grads):
        rounds, seen = [], collections.Counter()
        for grad in grads:
            k = seen[id(grad)]
            seen[id(grad)] += 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(grad)
    for tensors_of_round in rounds:
        for (device, _), ([tensors], _) in _grouped(tensors_of_round):
            coef_here = coef.to(device)
            if _use_foreach(tensors, device, foreach):
                torch._foreach_mul_(tensors, coef_here)
            else:
                for g in tensors:
                    g.mul_(coef_here)
