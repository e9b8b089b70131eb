"""Compile-time helpers every kernel shares (the kernel side of tfuse/_kit.py).

The accumulator dtype: kernels take the ACC_FP64 flag the launcher computes
(``tfuse._kit.acc_fp64``) and name their accumulator dtype once, with

    ACC: tl.constexpr = _acc_dtype(ACC_FP64)

A ``triton.constexpr_function`` is evaluated while the kernel is compiled
(and called as plain Python under the interpreter), so the result is a
compile-time dtype: the generated code is what a literal ``tl.float32`` or
``tl.float64`` gives. (A ``@triton.jit`` helper cannot return a dtype.)
"""

import triton
import triton.language as tl


@triton.constexpr_function
def _acc_dtype(fp64):
    """float64 if ``fp64`` else float32: the dtype loads are converted to and sums are kept in."""
    return tl.float64 if fp64 else tl.float32


@triton.jit
def _float_arg(hi, lo, ACC_FP64: tl.constexpr):
    """A float argument the launcher split into two float32 numbers (``tfuse._kit.split_float``).

    Triton passes Python floats to kernels as float32, which would round a
    slope, eps or momentum to 24 bits in float64 kernels; hi + lo in float64
    keeps ~48 bits. float32 kernels take hi, the float32 value they always had.
    """
    if ACC_FP64:
        value = tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        value = tl.cast(hi, tl.float32)
    return value
