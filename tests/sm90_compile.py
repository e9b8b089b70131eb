"""Compiles tfuse's kernels for an H100/H200 (sm_90) without a GPU.

Run as a script with the interpreter OFF (it needs compiled JIT functions):
``python tests/sm90_compile.py``. For each case it builds the exact arguments
the launcher would pass, lets Triton specialise them as a launch would, and
compiles to PTX and cubin with Triton's bundled ptxas. It prints one JSON line
per case with the vector widths of the global loads and stores found in the
PTX, so a test can check that contiguous inputs are read with 128-bit loads.
This proves the kernels compile for the GPU with the installed Triton; it
says nothing about speed.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from tfuse import kernels  # noqa: E402
from tfuse.ops.add import add_launch_args  # noqa: E402
from tfuse.ops._tiles import empty_broadcast_output  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(kernel, args: tuple, meta: dict) -> str:
    """PTX of ``kernel`` specialised for ``args``/``meta`` as a launch would specialise it."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    return compiled.asm["ptx"]


def add_case(shapes: list[tuple[int, ...]], dtype: torch.dtype, channels_last: bool = False) -> tuple[tuple, dict]:
    inputs = [torch.empty(shape, dtype=dtype) for shape in shapes]
    if channels_last:
        inputs = [t.to(memory_format=torch.channels_last) if t.dim() == 4 else t for t in inputs]
    out = empty_broadcast_output(inputs, torch.broadcast_shapes(*shapes), dtype)
    _, args, meta = add_launch_args(out, inputs)
    return args, meta


CASES = {
    "add3_contiguous_fp32": add_case([(1 << 20,)] * 3, torch.float32),
    "add3_contiguous_bf16": add_case([(1 << 20,)] * 3, torch.bfloat16),
    "add8_contiguous_fp16": add_case([(4096, 256)] * 8, torch.float16),
    "bias_over_rows_fp32": add_case([(4096, 1024), (1024,), (4096, 1024)], torch.float32),
    "per_channel_nchw_bf16": add_case([(32, 64, 56, 56), (64, 1, 1), (32, 64, 56, 56)], torch.bfloat16),
    "per_channel_channels_last_fp16": add_case([(32, 64, 56, 56), (64, 1, 1)], torch.float16, channels_last=True),
    "strided_rank3_fp32": add_case([(8, 64, 33), (8, 1, 33), (1, 64, 1)], torch.float32),
    "float64": add_case([(1000,), (1000,)], torch.float64),
}


def vector_widths(ptx: str, op: str) -> list[int]:
    """Vector widths (1 for scalar) of the ``ld.global``/``st.global`` instructions in ``ptx``."""
    widths = []
    for match in re.finditer(rf"\b{op}\.global(?:\.[a-z0-9_:]+)*?(?:\.v(\d))?\.(?:b|f|u|s)\d+", ptx):
        widths.append(int(match.group(1) or 1))
    return widths


def main(names: list[str]) -> None:
    names = names or list(CASES)
    print(json.dumps({"planned": names}))
    for name in names:
        args, meta = CASES[name]
        ptx = compile_for_sm90(kernels._add_fwd_kernel, args, meta)
        print(json.dumps({"case": name, "loads": sorted(set(vector_widths(ptx, "ld"))), "stores": sorted(set(vector_widths(ptx, "st")))}))


if __name__ == "__main__":
    main(sys.argv[1:])
