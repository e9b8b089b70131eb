"""The launch kit: the launch settings every launcher derives by the same rules, each written once.

Kernels take a few compile-time switches whose values follow from the
tensors alone. Each rule lives here, so no launcher re-derives one:

* ``ACC_FP64``: :func:`acc_fp64` (and :func:`acc_dtype` for host buffers);
  kernels turn the flag into a dtype with ``kernels.kit._acc_dtype``.
* ``INDEX_64``: :func:`needs_int64`, against the one bound :data:`INT32_LIMIT`.
* ``num_warps``: :data:`NUM_WARPS`, or :func:`num_warps` for a tile size.
* ``EMULATE_BF16_RTNE``: :func:`emulate_bf16_rtne` (used by ``kernels.cast._cast_to``).
* power-of-two block sizes: :func:`next_power_of_2`.

Programs per SM (how many programs a grid aims for) stay in
:mod:`tfuse._launch` (``target_programs``, ``resident_programs``,
``gpu_sm_count``), next to the launch: benchmarks/roofline.py replaces those
in each launching module to answer as a given GPU would, which the pure
functions here never need.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tfuse._backend import interpreter_active

#: Offsets are computed in int32 below this bound and in int64 from it on
#: (the largest int32; a lane's offset must stay below it).
INT32_LIMIT = 2**31 - 1

#: Warps of a program unless its tile asks for more (see :func:`num_warps`).
NUM_WARPS = 4
#: Most warps a tiled program gets: past 8, a program's registers per SM (and
#: its share of the partial buffers) grow without more bandwidth.
MAX_WARPS = 8


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The accumulator dtype for tensors of ``dtypes``: float64 when any is float64, else float32.

    Loads are converted to it, sums and statistics are kept in it, and the
    result is rounded once to its own dtype: float16/bfloat16 never
    accumulate in their own precision, and float64 never loses its own.
    """
    return torch.float64 if torch.float64 in dtypes else torch.float32


def acc_fp64(*dtypes: torch.dtype) -> bool:
    """The ``ACC_FP64`` meta-parameter for tensors of ``dtypes`` (:func:`acc_dtype` is float64)."""
    return acc_dtype(*dtypes) == torch.float64


def needs_int64(largest_offset: int, limit: int = INT32_LIMIT) -> bool:
    """The ``INDEX_64`` meta-parameter: True when an offset up to ``largest_offset`` needs int64.

    ``largest_offset`` is the largest element offset any lane computes, masked
    lanes of a last partial tile included (they compute their offsets before
    the mask discards them, so they must not overflow either). ``limit`` is
    :data:`INT32_LIMIT`; tests lower it to take the int64 path on small data.
    """
    return largest_offset >= limit


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): Triton block shapes are powers of two."""
    return 1 << max(n - 1, 0).bit_length()


def num_warps(tile_elements: int, elements_per_thread: int) -> int:
    """Warps for a program over ``tile_elements`` elements, ``elements_per_thread`` per thread.

    Between :data:`NUM_WARPS` and :data:`MAX_WARPS`: small tiles keep 4 warps
    (fewer threads would leave too few loads in flight per SM), large ones
    get more threads rather than more registers per thread.
    """
    return max(NUM_WARPS, min(MAX_WARPS, tile_elements // (32 * elements_per_thread)))


def emulate_bf16_rtne() -> bool:
    """The ``EMULATE_BF16_RTNE`` meta-parameter: round bfloat16 stores on the bits (kernels/cast.py).

    True exactly when the kernels run under Triton's interpreter, whose
    float32 -> bfloat16 conversion truncates instead of rounding to nearest
    even. Kernels look at it only for bfloat16 stores; compiled kernels
    always get False and keep the native conversion.
    """
    return interpreter_active()


_FLOAT32_MAX = float(np.finfo(np.float32).max)


@functools.lru_cache(maxsize=256)
def split_float(value: float) -> tuple[float, float]:
    """``value`` as two float32 numbers whose sum keeps ~48 bits: Triton passes Python floats as float32.

    Kernels rejoin them with ``kernels.kit._float_arg`` (hi + lo in float64
    kernels, hi alone in float32 ones), so a float64 kernel's slope, eps or
    momentum is not rounded to 24 bits on the way in.
    """
    if not abs(value) <= _FLOAT32_MAX:  # inf, NaN, or beyond float32: the kernel sees inf (or NaN) either way
        return value, 0.0
    hi = float(np.float32(value))
    return hi, float(np.float32(value - hi))
