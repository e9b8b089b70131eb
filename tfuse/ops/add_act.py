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

Inside: this module holds the entry points, their argument checks and the
torch.library ops; ``_add_act_forward`` computes the forward on both
backends, ``_add_act_backward`` the backward, whose Triton launches
``_add_act_plan`` lays out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from tfuse._backend import Backend, log_backend_once, select_backend
from tfuse.ops._activations import Activation, GradSource, check_activation
from tfuse.ops._add_act_backward import _backward_torch, _backward_triton
from tfuse.ops._add_act_forward import _ActSpec, add_act_forward
from tfuse.ops._add_act_plan import CHAN as CHAN
from tfuse.ops._add_act_plan import _backward_blocks as _backward_blocks
from tfuse.ops._add_act_plan import grad_slots
from tfuse.ops._checks import broadcast_shape, check_tensor_args, is_cpu_scalar, is_dense, promote_float_dtypes
from tfuse.ops._library import DTYPES, compiling, dtype_code, op_backend, tfuse_op

_log = logging.getLogger(__name__)

#: Most tensors added to x before the activation.
MAX_OTHERS = 3


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
