"""The forward of ``tfuse.add_act`` on both backends: ``act(sum(tensors))`` in one Triton launch, or torch ops.

:func:`add_act_forward` takes arguments already checked by its callers
(:func:`tfuse.ops.add_act.add_act`, the registered op, FusedLinear's
epilogue) and an :class:`_ActSpec` that says which activation and which
backend; the PyTorch path sums in float32 (float64) and rounds once, as the
kernel does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tfuse import kernels
from tfuse._backend import Backend, interpreter_active
from tfuse._kit import acc_dtype, split_float
from tfuse._launch import launch
from tfuse.ops._activations import Activation, math_mode
from tfuse.ops._tiles import empty_broadcast_output, plan_tiles, tile_meta
from tfuse.ops.add import add_forward


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
