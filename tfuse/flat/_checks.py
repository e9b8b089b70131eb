"""The argument checks of FlatParams, and the small helpers its modules share.

The checks (:func:`_unique_params`, :func:`_check_world_size`,
:func:`_check_options`) raise what FlatParams' constructor and setters
raise; the helpers compare tensor geometry (:func:`_same_memory`,
:func:`_dense_strides`, :func:`_same_element_order`), group parameters by
(device, dtype) and put counts and sizes into words for messages.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

from tfuse.flat._home import flat_params_of

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _unique_params(
    params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
) -> tuple[list[torch.nn.Parameter], dict[torch.nn.Parameter, str]]:
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "FlatParams: params argument given to FlatParams should be an iterable of Tensors, "
            f"but got {torch.typename(params)}"
        )
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise TypeError(
            "FlatParams: params should be an iterable of Tensors (e.g. model.parameters()), of (name, Tensor) pairs, "
            f"or an nn.Module, but got {type(params).__name__}"
        )
    unique: list[torch.nn.Parameter] = []
    names: dict[torch.nn.Parameter, str] = {}
    seen: set[int] = set()
    for index, item in enumerate(params):
        name = None
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, param = item
        else:
            param = item
        what = f"parameter {index}" if name is None else f"parameter {index} ({name!r})"
        if isinstance(param, torch.nn.Module):
            raise TypeError(
                f"FlatParams: {what} is a module ({type(param).__name__}), not a torch.Tensor; pass "
                "module.parameters(), or the module itself"
            )
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"FlatParams: {what} is a {type(param).__name__}, not a torch.Tensor")
        if id(param) in seen:
            continue  # tied parameters appear once
        if param.is_sparse or param.layout != torch.strided:
            raise TypeError(f"FlatParams: {what} is sparse ({param.layout}); sparse parameters cannot be coalesced")
        if param.dtype not in _SUPPORTED:
            raise TypeError(
                f"FlatParams: {what} has dtype {param.dtype}; only float16, bfloat16, float32 and "
                "float64 parameters can be coalesced"
            )
        if not param.is_leaf:
            raise ValueError(f"FlatParams: can't coalesce a non-leaf Tensor ({what})")
        owner = flat_params_of(param)
        if owner is not None:
            raise ValueError(f"FlatParams: {what} already lives in another FlatParams ({owner.describe()})")
        seen.add(id(param))
        unique.append(param)
        if name is not None:
            names[param] = name
    if not unique:
        raise ValueError("FlatParams got an empty parameter list")
    return unique, names


def _check_world_size(world_size: int | None) -> None:
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"FlatParams: world_size must be a positive int or None, got {world_size!r}")


def _check_options(bucket_mb: float | None, max_params_per_bucket: int | None, align_bytes: int) -> None:
    if bucket_mb is not None and (
        isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0
    ):
        raise ValueError(f"FlatParams: bucket_mb must be a positive number or None, got {bucket_mb!r}")
    if max_params_per_bucket is not None and (
        isinstance(max_params_per_bucket, bool)
        or not isinstance(max_params_per_bucket, int)
        or max_params_per_bucket < 1
    ):
        raise ValueError(
            f"FlatParams: max_params_per_bucket must be a positive int or None, got {max_params_per_bucket!r}"
        )
    if (
        isinstance(align_bytes, bool)
        or not isinstance(align_bytes, int)
        or align_bytes < 1
        or align_bytes & (align_bytes - 1)
    ):
        raise ValueError(f"FlatParams: align_bytes must be a power of two, got {align_bytes!r}")


def _group_by_device_and_dtype(params: list[torch.nn.Parameter]) -> dict[tuple[torch.device, torch.dtype], list]:
    groups: dict[tuple[torch.device, torch.dtype], list] = {}
    for param in params:
        groups.setdefault((param.device, param.dtype), []).append(param)
    return groups


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _count(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _same_memory(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()


def _dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor with ``tensor``'s memory format (torch.preserve_format's rule)."""
    return tuple(torch.empty_like(tensor, device="meta").stride())


def _same_element_order(shape: tuple[int, ...], strides: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """Whether two dense layouts of ``shape`` put every element at the same position (size-1 dims do not count)."""
    return all(a == b for size, a, b in zip(shape, strides, other) if size > 1)
