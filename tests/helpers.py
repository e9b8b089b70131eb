"""Shared helpers for the tests: input layouts, error bounds for sums, and subprocesses with timeouts."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

import pytest

import torch
import torch.nn.functional as F

from tfuse.ops._activations import Activation

LOW_PRECISION = (torch.float16, torch.bfloat16)


def make_input(shape: Sequence[int], dtype: torch.dtype, device: torch.device, layout: str = "contiguous") -> torch.Tensor:
    """A random tensor of ``shape`` whose memory layout is ``layout``.

    Layouts: contiguous; transposed (last two dims swapped in memory);
    strided (every other element of a larger tensor, with a storage offset);
    channels_last (4-D only); expanded (a stride-0 view of a smaller tensor).
    """
    shape = tuple(shape)
    if layout == "contiguous" or len(shape) == 0:
        return torch.randn(shape, device=device).to(dtype)
    if layout == "transposed":
        if len(shape) < 2:
            return make_input(shape, dtype, device, "strided")
        swapped = shape[:-2] + (shape[-1], shape[-2])
        return torch.randn(swapped, device=device).to(dtype).transpose(-1, -2)
    if layout == "strided":
        big = torch.randn(shape[:-1] + (2 * shape[-1] + 1,), device=device).to(dtype)
        return big[..., 1::2]
    if layout == "channels_last":
        return torch.randn(shape, device=device).to(dtype).to(memory_format=torch.channels_last)
    if layout == "expanded":
        small = torch.randn(shape[:-1] + (1,), device=device).to(dtype)
        return small.expand(shape)
    raise ValueError(f"unknown layout {layout!r}")


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def assert_sum_accurate(result: torch.Tensor, inputs: Sequence[torch.Tensor]) -> None:
    """Checks ``result`` against the float64 sum of ``inputs`` with an error bound.

    A sum accumulated in float32 and rounded once to the output dtype is off
    the exact sum by at most one rounding of the output (u_out * |sum|) plus
    the accumulation error (n * u_32 * sum |x_i|), plus half the subnormal
    spacing of the output dtype. This is the bound of the algorithm, not a
    tolerance tuned to pass.
    """
    exact = sum(t.double() for t in inputs)
    magnitude = sum(t.double().abs() for t in inputs)
    acc_dtype = torch.float64 if result.dtype == torch.float64 else torch.float32
    finfo = torch.finfo(result.dtype)
    bound = (
        unit_roundoff(result.dtype) * exact.abs()
        + len(inputs) * unit_roundoff(acc_dtype) * magnitude
        + finfo.tiny * finfo.eps
    )
    if result.dtype == torch.float64:
        bound = 2 * bound  # the float64 reference rounds as often as the result does
    _assert_within((result.double() - exact).abs(), bound)


def _assert_within(error: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """Raises naming how many elements exceed their bound, and the worst one."""
    bad = error > bound
    if bad.any():
        worst = (error - bound).flatten().argmax()
        raise AssertionError(
            f"{what}{int(bad.sum())} of {bad.numel()} elements beyond the error bound; at the worst, "
            f"error {error.flatten()[worst].item():.3e} against bound {bound.flatten()[worst].item():.3e}"
        )


def assert_batch_norm_input_grad_accurate(
    result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, grad_out: torch.Tensor, eps: float
) -> None:
    """Checks training-mode batch norm's d(x) against float64, with the error bound of its terms.

    ``dx = w * invstd * (g - mean(g) - xhat * mean(g * xhat))`` per channel
    (dim 1), ``g`` the gradient at the batch norm's output (``grad_out``,
    float64). Where those terms cancel (a few elements per channel), any
    float32 evaluation keeps only the bits the cancellation leaves: each term,
    and ``xhat = (x - mean) * invstd`` itself, carries a few roundings of its
    own magnitude. The bound is 16 unit roundoffs of float32 times
    ``|w| * invstd * (|g| + mean|g| + (|xhat| + (|x| + |mean|) * invstd) * mean|g * xhat|)``,
    plus torch's float32 tolerance: the algorithm's bound, not a tolerance
    tuned to pass (a wrong formula is off by the size of the terms).
    """
    dims = [d for d in range(x.dim()) if d != 1]
    shape = [1 if d != 1 else x.shape[1] for d in range(x.dim())]
    x64, g = x.detach().double(), grad_out.detach().double()
    mean = x64.mean(dims, keepdim=True)
    invstd = (x64.var(dims, unbiased=False, keepdim=True) + eps).rsqrt()
    xhat = (x64 - mean) * invstd
    w = torch.ones(shape, dtype=torch.float64) if weight is None else weight.detach().double().reshape(shape)
    exact = w * invstd * (g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True))
    terms = w.abs() * invstd * (
        g.abs()
        + g.abs().mean(dims, keepdim=True)
        + (xhat.abs() + (x64.abs() + mean.abs()) * invstd) * (g * xhat).abs().mean(dims, keepdim=True)
    )
    bound = 16 * unit_roundoff(torch.float32) * terms + 1e-5 + 1.3e-6 * exact.abs()
    _assert_within((result.detach().double() - exact).abs(), bound, "d(x): ")


def assert_matches_torch_sum(result: torch.Tensor, inputs: Sequence[torch.Tensor]) -> None:
    """Checks ``result`` against torch's own ``t0 + t1 + ...``: same dtype, shape and values.

    float32/float64 sums round in the same order as torch's chain, so torch's
    default tolerances apply. float16/bfloat16 chains in torch round after
    every add, ours once: they may differ by n roundings of the output dtype
    in all (n - 1 of torch's, one of ours), bounded by n * u_out * sum |x_i|.
    """
    expected = inputs[0]
    for tensor in inputs[1:]:
        expected = expected + tensor
    assert result.dtype == expected.dtype
    assert result.shape == expected.shape
    if result.dtype in LOW_PRECISION:
        magnitude = sum(t.double().abs() for t in inputs)
        bound = len(inputs) * unit_roundoff(result.dtype) * magnitude + torch.finfo(result.dtype).tiny
        assert ((result.double() - expected.double()).abs() <= bound).all()
    else:
        torch.testing.assert_close(result, expected)


class _HardswishFloat64(torch.autograd.Function):
    """torch's hardswish with the CPU kernel's formula on every device (x * clamp(x + 3, 0, 6) / 6).

    torch's CUDA kernel multiplies by a float32 1/6 (4e-7 off in float64, seen on an H100). The
    backward is torch's own, exact in float64 on every device (its constants 3 and 0.5 are)."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return z * (z + 3).clamp(0, 6) / 6

    @staticmethod
    def backward(ctx, dy):
        (z,) = ctx.saved_tensors
        return torch.ops.aten.hardswish_backward(dy, z)


class _HardsigmoidFloat64(torch.autograd.Function):
    """torch's hardsigmoid divided by 6 on every device (its CUDA forward and backward multiply by a
    float32 1/6); the backward keeps torch's branches (dy / 6 strictly inside (-3, 3), else 0)."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return (z + 3).clamp(0, 6) / 6

    @staticmethod
    def backward(ctx, dy):
        (z,) = ctx.saved_tensors
        return torch.where((z > -3) & (z < 3), dy / 6, torch.zeros((), dtype=dy.dtype, device=dy.device))


def _exact_in_float64(function, torch_function):
    """float64 through ``function`` (exact on every device), other dtypes through torch's own."""
    return lambda z: function.apply(z) if z.dtype == torch.float64 else torch_function(z)


def torch_activation(act: str, negative_slope: float = 0.2):
    """The torch.nn.functional reference of one of tfuse's activations."""
    return {
        "relu": F.relu,
        "leaky_relu": lambda z: F.leaky_relu(z, negative_slope),
        "gelu": F.gelu,
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "silu": F.silu,
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "relu6": F.relu6,
        "hardtanh": F.hardtanh,
        "hardswish": _exact_in_float64(_HardswishFloat64, F.hardswish),
        "hardsigmoid": _exact_in_float64(_HardsigmoidFloat64, F.hardsigmoid),
        "mish": F.mish,
        "elu": F.elu,
        "identity": lambda z: z,
    }[act]


#: Every activation tfuse fuses, by name (from the table itself, so a new entry is tested everywhere).
ACTIVATION_NAMES = tuple(member.label for member in Activation)
#: Activations that cover every path the kernels take by activation (a derivative from the output that selects
#: or multiplies, from the input, none; a slope): the cross-products with every layout use these, and every
#: other activation (whose path is one of these) is crossed with a few layouts only. (Test time, not coverage.)
PATH_ACTIVATIONS = ("relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "identity")


#: Multiplies every subprocess timeout of the tests (a loaded or slow machine: 2, 3...).
TIMEOUT_SCALE_ENV = "TFUSE_TEST_TIMEOUT_SCALE"


def run_command(command: Sequence[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` bounded by ``timeout`` seconds (times
    $TFUSE_TEST_TIMEOUT_SCALE), so a hang fails instead of stalling CI. A run past its bound fails the test
    with what ran, for how long, the machine's load, how to allow more time, and the end of its output."""
    limit = timeout * float(os.environ.get(TIMEOUT_SCALE_ENV) or 1)
    try:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=limit, **kwargs)
    except subprocess.TimeoutExpired as expired:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        output = (expired.stdout or b"")[-2000:] + (expired.stderr or b"")[-2000:]
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        pytest.fail(
            f"{' '.join(map(str, command))[:200]} did not finish in {limit:.0f} s (load average {load:.1f} on "
            f"{os.cpu_count()} cores; a loaded machine runs it slower: {TIMEOUT_SCALE_ENV}=2 allows twice as "
            f"long). The end of its output:\n{output}",
            pytrace=False,
        )

