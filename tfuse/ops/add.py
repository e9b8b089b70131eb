"""``tfuse.add``: the sum of 2 to 8 tensors in one kernel launch.

Layering: :func:`add` checks its arguments and hands them to the autograd
Function (or straight to the forward when no gradient is wanted);
:func:`add_forward` picks the backend and writes the result.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tfuse import kernels
from tfuse._backend import Backend, log_backend_once, select_backend
from tfuse._kit import acc_dtype
from tfuse._launch import launch
from tfuse.ops._checks import broadcast_shape, check_tensor_args, is_cpu_scalar, promote_float_dtypes
from tfuse.ops._library import compiling, op_backend, tfuse_op
from tfuse.ops._tiles import empty_broadcast_output, plan_tiles, tile_meta

#: Most inputs one launch adds (each input is a pointer and a stride tuple of
#: the kernel; past this, split the sum).
MAX_INPUTS = 8

_log = logging.getLogger(__name__)


def add(*tensors: torch.Tensor) -> torch.Tensor:
    """Adds 2 to 8 tensors with broadcasting, reading each once and writing once.

    Same result as ``t0 + t1 + ...`` in torch: broadcasting and dtype
    promotion by torch's rules, output in the layout of the first full-size
    input. The sum is accumulated in float32 (float64 for float64 results)
    and rounded once, so for float16/bfloat16 it is at least as accurate as
    the chain of torch adds. Gradients flow to every input that requires one:
    the incoming gradient summed over that input's broadcast dimensions, in
    the input's dtype.

    Example:
        >>> import torch, tfuse
        >>> x = torch.randn(8, 16)
        >>> bias = torch.randn(16)
        >>> residual = torch.randn(8, 16)
        >>> torch.allclose(tfuse.add(x, bias, residual), x + bias + residual)
        True

    Raises:
        TypeError: fewer than 2 or more than 8 arguments, a non-tensor
            argument, a sparse tensor, or a non-floating dtype.
        RuntimeError: tensors on different devices (a 0-dim CPU tensor may
            join tensors of another device, as in torch), shapes that do not
            broadcast, or a forced backend that cannot run here.
    """
    device = check_tensor_args("add", tensors, 2, MAX_INPUTS)
    if device.type != "cpu" and any(is_cpu_scalar(t) for t in tensors):
        tensors = tuple(t.to(device) if is_cpu_scalar(t) else t for t in tensors)
    shape = broadcast_shape("add", [t.shape for t in tensors])
    dtype = promote_float_dtypes(tensors)
    if compiling():
        return torch.ops.tfuse.add(list(tensors))
    backend = select_backend(device, "add", shape.numel())
    log_backend_once(_log, "add", backend, device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _add_op.apply(list(tensors), shape=shape, dtype=dtype, backend=backend)
    return add_forward(tensors, shape, dtype, backend)


def add_forward(
    tensors: Sequence[torch.Tensor], shape: torch.Size, dtype: torch.dtype, backend: Backend
) -> torch.Tensor:
    """Writes ``sum(tensors)`` into a new tensor of ``shape`` and ``dtype`` (inputs already checked)."""
    out = empty_broadcast_output(tensors, shape, dtype)
    if out.numel() == 0:
        return out
    if backend is Backend.TRITON:
        _add_triton(out, tensors)
    else:
        _add_torch(out, tensors)
    return out


def _add_triton(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    plan = plan_tiles(out, tensors, max_col_rank=None)
    launch(
        kernels._add_fwd_kernel,
        plan.grid,
        (out, tuple(tensors), plan.in_strides, plan.outer_sizes, plan.col_divs, plan.n_rows, plan.n_cols),
        dict(N_INPUTS=len(tensors), **tile_meta(plan, out)),
        out.device,
    )


def _add_torch(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """The PyTorch path: whole-tensor adds, accumulated in float32/float64, rounded once."""
    acc_type = acc_dtype(out.dtype)
    acc = out if out.dtype == acc_type else torch.empty_like(out, dtype=acc_type)
    first, second, *rest = tensors
    spans_output = first.shape == acc.shape or second.shape == acc.shape  # then their broadcast is the output's shape
    if first.dtype == acc_type and second.dtype == acc_type and spans_output:
        torch.add(first, second, out=acc)
    else:
        # torch.add(out=...) would round to the inputs' common dtype first, and
        # would resize ``acc`` when the first two do not span the output's shape.
        acc.copy_(first)
        acc.add_(second)
    for tensor in rest:
        acc.add_(tensor)
    if acc is not out:
        out.copy_(acc)


def sum_to_input(grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of an input of ``shape`` that was broadcast to ``grad.shape``."""
    if grad.shape != shape:
        grad = grad.sum_to_size(shape)
    return grad.to(dtype)


# ---------------------------------------------------------------------------- the op: eager Function and torch.library


def _add_setup(ctx, inputs, output, **_) -> None:  # type: ignore[no-untyped-def]
    """Saves only the inputs' shapes and dtypes."""
    (tensors,) = inputs
    ctx.input_meta = [(t.shape, t.dtype) for t in tensors]


def _add_backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    """Differentiable torch ops (a sum over broadcast dimensions and a cast) on both backends, so double
    backward (``create_graph=True``) works as for torch's add."""
    needed = ctx.needs_input_grad[0]  # one flag per tensor of the list
    return [
        sum_to_input(grad_out, shape, dtype) if need else None for (shape, dtype), need in zip(ctx.input_meta, needed)
    ]


@tfuse_op("tfuse::add", setup_context=_add_setup, backward=_add_backward)
def _add_op(
    tensors: list[torch.Tensor],
    *,
    shape: torch.Size | None = None,
    dtype: torch.dtype | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """``torch.ops.tfuse.add``: :func:`add` as an op (arguments checked by the caller; the eager caller
    passes the broadcast shape, result dtype and backend it worked out)."""
    if shape is None:
        shape = broadcast_shape("add", [t.shape for t in tensors])
    if backend is None:
        backend = op_backend(tensors[0].device, "add", tensors[0], shape.numel())
    return add_forward(tensors, shape, promote_float_dtypes(tensors) if dtype is None else dtype, backend)
