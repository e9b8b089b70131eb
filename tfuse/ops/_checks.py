"""Input checks shared by the launchers: every check runs before any launch.

Messages name the op, the offending argument and its value, in the words
torch uses for the same mistake where it has them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Floating dtypes the kernels read and write. Computation is float32 for the
#: 16- and 32-bit types and float64 for float64.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)


def check_tensor_args(op: str, args: Sequence[object], min_count: int, max_count: int) -> torch.device:
    """Checks a variadic list of tensor arguments; returns their common device.

    Raises:
        TypeError: wrong number of arguments, a non-tensor argument, a sparse
            tensor, or a dtype the kernels do not support.
        RuntimeError: tensors on different devices (0-dim CPU tensors excepted).
    """
    if not min_count <= len(args) <= max_count:
        raise TypeError(f"tfuse.{op} takes {min_count} to {max_count} tensors, got {len(args)}")
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"tfuse.{op}: argument {index} must be a torch.Tensor, got {type(arg).__name__}")
        if arg.layout != torch.strided:
            raise TypeError(
                f"tfuse.{op}: argument {index} has layout {arg.layout}; only dense (strided) tensors are supported"
            )
        check_float_dtype(op, f"argument {index}", arg.dtype)
    # As in torch, a 0-dim CPU tensor may join tensors of another device (it is
    # a scalar); every other tensor must share one device.
    tensors: Sequence[torch.Tensor] = args  # type: ignore[assignment]
    devices = {t.device for t in tensors if not is_cpu_scalar(t)} or {tensors[0].device}
    if len(devices) > 1:
        names = sorted(str(d) for d in devices)
        raise RuntimeError(
            f"tfuse.{op}: Expected all tensors to be on the same device, but found at least "
            f"two devices, {names[0]} and {names[1]}!"
        )
    return devices.pop()


def is_cpu_scalar(tensor: torch.Tensor) -> bool:
    """A 0-dim CPU tensor, which torch lets take part in ops on any device."""
    return tensor.dim() == 0 and tensor.device.type == "cpu"


def check_float_dtype(op: str, what: str, dtype: torch.dtype) -> None:
    """Raises TypeError unless ``dtype`` is one of SUPPORTED_DTYPES."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"tfuse.{op}: {what} has dtype {dtype}; supported dtypes are {_DTYPE_NAMES}")


def broadcast_shape(op: str, shapes: Sequence[Sequence[int]]) -> torch.Size:
    """The shape all ``shapes`` broadcast to, by torch's rules.

    Raises:
        RuntimeError: two shapes differ in a dimension where neither is 1.
    """
    first = shapes[0]
    if all(shape == first for shape in shapes):
        return torch.Size(first)
    ndim = max(len(shape) for shape in shapes)
    result = [1] * ndim
    owner = [-1] * ndim  # which argument fixed the size of each dimension
    for index, shape in enumerate(shapes):
        offset = ndim - len(shape)
        for dim, size in enumerate(shape):
            out_dim = offset + dim
            if size == 1:
                continue
            if result[out_dim] == 1:
                result[out_dim] = size
                owner[out_dim] = index
            elif result[out_dim] != size:
                listed = ", ".join(str(list(s)) for s in shapes)
                raise RuntimeError(
                    f"tfuse.{op}: The size of tensor {owner[out_dim]} ({result[out_dim]}) must match "
                    f"the size of tensor {index} ({size}) at non-singleton dimension {out_dim}; "
                    f"shapes {listed} do not broadcast"
                )
    return torch.Size(result)


def promote_float_dtypes(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The result dtype torch gives ``t0 + t1 + ...`` for floating tensors.

    Zero-dimensional tensors take part in promotion only when no tensor with
    dimensions is present (all inputs are floating, so the category rule of
    torch reduces to this).
    """
    first = tensors[0].dtype
    if all(t.dtype == first for t in tensors):
        return first
    dimensioned = [t.dtype for t in tensors if t.dim() > 0]
    dtypes = dimensioned or [t.dtype for t in tensors]
    result = dtypes[0]
    for dtype in dtypes[1:]:
        result = torch.promote_types(result, dtype)
    return result


def is_dense(t: torch.Tensor) -> bool:
    """True when the elements of ``t`` fill a block of memory exactly once, in some dimension order."""
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def affine_pair(weight: torch.Tensor | None, bias: torch.Tensor | None):  # type: ignore[no-untyped-def]
    """Both or neither of a norm's weight and bias, dense (kernels index them densely): torch normalises with
    weight 1 (or bias 0) when only the other is given."""
    if weight is None and bias is not None:
        weight = torch.ones_like(bias)
    elif bias is None and weight is not None:
        bias = torch.zeros_like(weight)
    if weight is not None:
        weight, bias = weight.contiguous(), bias.contiguous()
    return weight, bias
