"""Compiles tfuse's kernels for an H100/H200 (sm_90) without a GPU.

Run as a script with the interpreter OFF (it needs compiled JIT functions):
``python tests/sm90_compile.py [CASE ...]``. Each case runs real tfuse calls
on CPU tensors with the launches captured instead of executed, then compiles
every captured launch exactly as Triton would specialise it, to PTX and cubin
with Triton's bundled ptxas. It prints one JSON line per launch with the
vector widths of the global loads and stores in the PTX, so a test can check
that contiguous operands use 128-bit accesses. This proves the kernels
compile for the GPU with the installed Triton; it says nothing about speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import tfuse  # noqa: E402
import tfuse.ops.add as add_op  # noqa: E402
import tfuse.ops.add_act as add_act_op  # noqa: E402
import tfuse.ops.batch_norm as batch_norm_op  # noqa: E402
import tfuse.optim.clip as clip_op  # noqa: E402
import tfuse.optim._flat_optimizer as flat_optimizer  # noqa: E402
import tfuse.optim.adam as adam_op  # noqa: E402
import tfuse.optim.sgd as sgd_op  # noqa: E402
from tfuse._backend import Backend  # noqa: E402
from tfuse._launch import kernel_name  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(kernel, args: tuple, meta: dict) -> str:
    """PTX of ``kernel`` specialised for ``args``/``meta`` as a launch would specialise it."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    return compiled.asm["ptx"]


@contextlib.contextmanager
def captured_launches() -> Iterator[list]:
    """Runs tfuse ops on CPU tensors as if on a GPU: the Triton path, launches recorded, not run."""
    launches: list = []

    def capture(kernel, grid, args, meta, device):
        launches.append((kernel, args, meta))

    saved = {}
    for module in (add_op, add_act_op, batch_norm_op, clip_op, adam_op, sgd_op, flat_optimizer):
        saved[module] = {name: getattr(module, name) for name in ("launch", "select_backend") if hasattr(module, name)}
        for name in saved[module]:
            setattr(module, name, capture if name == "launch" else (lambda device, op: Backend.TRITON))
    try:
        yield launches
    finally:
        for module, originals in saved.items():
            for name, value in originals.items():
                setattr(module, name, value)


def add_case(shapes, dtype, channels_last=False) -> Callable[[], None]:
    def run():
        inputs = [torch.empty(shape, dtype=dtype) for shape in shapes]
        if channels_last:
            inputs = [t.to(memory_format=torch.channels_last) if t.dim() == 4 else t for t in inputs]
        tfuse.add(*inputs)
    return run


def add_act_case(x_shape, other_shapes, dtype, act, channels_last=False) -> Callable[[], None]:
    """Forward and backward (every input requiring grad) of tfuse.add_act."""
    def run():
        x = torch.zeros(x_shape, dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        inputs = [x.requires_grad_()] + [torch.zeros(s, dtype=dtype, requires_grad=True) for s in other_shapes]
        y = tfuse.add_act(*inputs, act=act)
        y.backward(torch.zeros_like(y))
    return run


def bn_case(shape, dtype, act, residual, training=True, channels_last=False) -> Callable[[], None]:
    """Forward and backward of FusedBatchNormAct2d (weight, bias, x and residual requiring grad)."""
    def run():
        layer = tfuse.nn.FusedBatchNormAct2d(shape[1], act=act).train(training)
        x = torch.zeros(shape, dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        skip = torch.zeros(shape, dtype=dtype, requires_grad=True) if residual else None
        y = layer(x, skip)
        y.backward(torch.zeros_like(y))
    return run


def clip_case(norm_type, dtype) -> Callable[[], None]:
    """clip_grad_norm_ over a FlatParams of a small MLP (every parameter has a gradient)."""
    def run():
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).to(dtype)
        flat = tfuse.flat.FlatParams(model.parameters())
        for param in flat.params:
            param.grad = None
        for param in flat.params:  # gradients as views, without running a backward
            param.grad = flat.grad_view(param)
        tfuse.optim.clip_grad_norm_(flat, 1.0, norm_type)
    return run


def optim_case(optimizer_cls, dtype, **options) -> Callable[[], None]:
    """One step of a fused optimizer over a small MLP whose gradients are flat views."""
    def run():
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).to(dtype)
        optimizer = optimizer_cls(model.parameters(), **options)
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
    return run


CASES = {
    "add3_contiguous_fp32": add_case([(1 << 20,)] * 3, torch.float32),
    "add3_contiguous_bf16": add_case([(1 << 20,)] * 3, torch.bfloat16),
    "add8_contiguous_fp16": add_case([(4096, 256)] * 8, torch.float16),
    "bias_over_rows_fp32": add_case([(4096, 1024), (1024,), (4096, 1024)], torch.float32),
    "per_channel_nchw_bf16": add_case([(32, 64, 56, 56), (64, 1, 1), (32, 64, 56, 56)], torch.bfloat16),
    "per_channel_channels_last_fp16": add_case([(32, 64, 56, 56), (64, 1, 1)], torch.float16, channels_last=True),
    "strided_rank3_fp32": add_case([(8, 64, 33), (8, 1, 33), (1, 64, 1)], torch.float32),
    "float64": add_case([(1024,), (1024,)], torch.float64),
    "add_act_gelu_bias_bf16": add_act_case((4096, 1024), [(1024,)], torch.bfloat16, "gelu"),
    "add_act_relu_bias_residual_fp32": add_act_case((4096, 1024), [(1024,), (4096, 1024)], torch.float32, "relu"),
    "add_act_silu_per_channel_fp16": add_act_case((32, 64, 56, 56), [(64, 1, 1)], torch.float16, "silu"),
    "add_act_tanh_strided_fp32": add_act_case((8, 64, 33), [(8, 1, 33), ()], torch.float32, "tanh"),
    "add_act_gelu_tanh_alone_fp64": add_act_case((1024,), [], torch.float64, "gelu_tanh"),
    "add_act_identity_channels_last_bf16": add_act_case((32, 64, 14, 14), [(64, 1, 1)], torch.bfloat16, "identity", channels_last=True),
    "add_act_leaky_relu_fp32": add_act_case((512, 256), [(256,)], torch.float32, "leaky_relu"),
    "add_act_sigmoid_fp16": add_act_case((512, 256), [(512, 1)], torch.float16, "sigmoid"),
    "bn_relu_residual_nchw_bf16": bn_case((32, 64, 56, 56), torch.bfloat16, "relu", residual=True),
    "bn_gelu_channels_last_fp16": bn_case((32, 64, 56, 56), torch.float16, "gelu", residual=False, channels_last=True),
    "bn_silu_eval_fp32": bn_case((8, 256, 14, 14), torch.float32, "silu", residual=True, training=False),
    "bn_tanh_fp64": bn_case((4, 16, 8, 8), torch.float64, "tanh", residual=False),
    "clip_l2_fp32": clip_case(2.0, torch.float32),
    "clip_inf_bf16": clip_case("inf", torch.bfloat16),
    "clip_p3_fp16": clip_case(3.0, torch.float16),
    "adam_fp32": optim_case(tfuse.optim.FusedAdam, torch.float32),
    "adamw_amsgrad_bf16_master": optim_case(tfuse.optim.FusedAdamW, torch.bfloat16, amsgrad=True, master_weights=True),
    "adam_fp16": optim_case(tfuse.optim.FusedAdam, torch.float16, weight_decay=0.1),
    "adam_eps0_fp64": optim_case(tfuse.optim.FusedAdam, torch.float64, eps=0.0),
    "sgd_momentum_fp32": optim_case(tfuse.optim.FusedSGD, torch.float32, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_plain_bf16_master": optim_case(tfuse.optim.FusedSGD, torch.bfloat16, lr=0.1, master_weights=True),
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
        with captured_launches() as launches:
            CASES[name]()
        for kernel, args, meta in launches:
            ptx = compile_for_sm90(kernel, args, meta)
            print(json.dumps({
                "case": name,
                "kernel": kernel_name(kernel),
                "loads": sorted(set(vector_widths(ptx, "ld"))),
                "stores": sorted(set(vector_widths(ptx, "st"))),
            }))


if __name__ == "__main__":
    main(sys.argv[1:])
