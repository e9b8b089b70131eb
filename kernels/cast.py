"""Conversion of float32/float64 results to the output dtype.

On a GPU ``x.to(tl.bfloat16)`` rounds to nearest even. Triton's interpreter
(3.6 to 3.9 at least) truncates instead, whatever ``fp_downcast_rounding``
says, which would make every bfloat16 result on CPU up to one ulp off. With
EMULATE_BF16_RTNE (set by the launchers only under the interpreter) the
rounding is done on the bits here, so the interpreted kernel gives the same
bfloat16 values as the compiled one. Compiled kernels keep the native cast.
"""

import triton
import triton.language as tl


@triton.jit
def _float32_to_bfloat16_rtne(x):
    """Round-to-nearest-even of float32 ``x`` to bfloat16, on the bits."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    # NaN stays NaN (set a mantissa bit that survives the shift).
    rounded = tl.where(x != x, bits | 0x400000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_to(x, dtype: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even on every backend."""
    if EMULATE_BF16_RTNE and dtype == tl.bfloat16:
        return _float32_to_bfloat16_rtne(x.to(tl.float32))
    else:
        return x.to(dtype)
