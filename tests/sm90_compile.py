"""Compiles tfuse's kernels for an H100/H200 (sm_90) without a GPU, and reads the static roofline.

Run as a script with the interpreter OFF (it needs compiled JIT functions):
``python tests/sm90_compile.py [CASE ...]``. Two sets of cases share one
compiler, which compiles each specialisation once (benchmarks/roofline.py):

* compile cases (``CASES`` below): small calls covering every kernel,
  dtype, activation and addressing mode, on CPU tensors, so each kernel is
  proven to compile for sm_90 with the installed Triton;
* roofline cases (``benchmarks.roofline.cases()``): realistic shapes
  (ResNet-50 batch norm, 1e8 adds, 16384^2 add_act, optimizer steps over
  ResNet-50 and GPT-2 small, clip_grad_norm_) on meta tensors.

Launches are captured instead of run and compiled exactly as Triton would
specialise them, to PTX and cubin with Triton's bundled ptxas. One JSON line
per launch (``kind``: ``compile`` or ``launch``) gives registers, spills,
global access widths per pointer argument, barriers, grid and occupancy; one
per op phase (``phase``) the bytes moved against the minimum; then
``sass_check`` lines (the cubin decoder against nvdisasm), ``merge_check``
lines (how batch norm's reductions hand their partials to the program that
merges them, read from the PTX) and a ``summary``.
This says nothing about speed; it shows regressions without a GPU.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 notice
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ lives at the repository root

import torch  # noqa: E402

import tfuse  # noqa: E402
from benchmarks import roofline  # noqa: E402
from benchmarks.roofline import captured_launches  # noqa: E402,F401  (kept importable from here)


def compile_for_sm90(kernel, args: tuple, meta: dict) -> str:
    """PTX of ``kernel`` specialised for ``args``/``meta`` as a launch would specialise it."""
    compiled, _ = roofline.default_compiler().compile(kernel, args, meta)
    return compiled.ptx


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


def depthwise_case(shape, kernel, dtype, act_in, act_out=None, bias=False, stride=1, dilation=1,
                   channels_last=False) -> Callable[[], None]:
    """Forward and backward of relu_depthwise_conv2d (x, weight and bias requiring grad), padding k // 2."""
    def run():
        x = torch.zeros(shape, dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        weight = torch.zeros(shape[1], 1, *kernel, dtype=dtype, requires_grad=True)
        b = torch.zeros(shape[1], dtype=dtype, requires_grad=True) if bias else None
        padding = (kernel[0] // 2, kernel[1] // 2)
        y = tfuse.functional.relu_depthwise_conv2d(x, weight, b, stride=stride, padding=padding, dilation=dilation,
                                                   act_in=act_in, act_out=act_out)
        y.backward(torch.zeros_like(y))
    return run


def norm_act_case(op, shape, arg, dtype, act, residual, affine=True, channels_last=False,
                  negative_slope=None) -> Callable[[], None]:
    """Forward and backward of group_norm_act (``arg``: groups) or layer_norm_act (``arg``: the normalised size),
    x, weight, bias and the residual requiring grad."""
    def run():
        x = torch.zeros(shape, dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        c = shape[1] if op == "group_norm_act" else arg
        weight, bias = ((torch.ones(c, dtype=dtype, requires_grad=True) for _ in range(2)) if affine
                        else (None, None))
        skip = torch.zeros(shape, dtype=dtype, requires_grad=True) if residual else None
        y = getattr(tfuse.functional, op)(x, arg, weight, bias, act=act, negative_slope=negative_slope,
                                          residual=skip)
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
    "dw_relu6_bias_nchw_bf16": depthwise_case((8, 32, 28, 28), (3, 3), torch.bfloat16, "relu6", bias=True),
    "dw_silu_k5s2_channels_last_fp16": depthwise_case((8, 64, 14, 14), (5, 5), torch.float16, "silu", stride=2,
                                                      channels_last=True),
    "dw_gelu_out_relu_dilated_fp32": depthwise_case((4, 16, 20, 20), (3, 3), torch.float32, "gelu", act_out="relu",
                                                    bias=True, dilation=2),
    "dw_leaky_out_silu_3x5_fp64": depthwise_case((2, 8, 9, 9), (3, 5), torch.float64, "leaky_relu", act_out="silu",
                                                 stride=(2, 1)),
    # Group norm and layer norm + activation: the act' from the output (relu) and from the recomputed input with
    # a residual (gelu, leaky_relu with a negative slope), no affine, float16/float64, split rows (a group of
    # 16384 elements, 4 rows: the statistics and dx kernels), looped rows with d(weight) partials in memory.
    "gn_relu_residual_nchw_fp16": norm_act_case("group_norm_act", (4, 32, 8, 8), 8, torch.float16, "relu", True),
    "gn_gelu_residual_channels_last_bf16": norm_act_case("group_norm_act", (4, 48, 6, 6), 4, torch.bfloat16,
                                                         "gelu", True, channels_last=True),
    "gn_silu_split_rows_fp32": norm_act_case("group_norm_act", (2, 8, 64, 64), 2, torch.float32, "silu", False),
    "gn_leaky_no_affine_fp64": norm_act_case("group_norm_act", (2, 8, 5, 5), 2, torch.float64, "leaky_relu", True,
                                             affine=False, negative_slope=-0.1),
    "ln_gelu_tanh_residual_fp32": norm_act_case("layer_norm_act", (64, 768), 768, torch.float32, "gelu_tanh", True),
    "ln_tanh_looped_rows_bf16": norm_act_case("layer_norm_act", (4, 12288), 12288, torch.bfloat16, "tanh", False),
    "clip_l2_fp32": clip_case(2.0, torch.float32),
    "clip_inf_bf16": clip_case("inf", torch.bfloat16),
    "clip_p3_fp16": clip_case(3.0, torch.float16),
    "adam_fp32": optim_case(tfuse.optim.FusedAdam, torch.float32),
    "adamw_amsgrad_bf16_master": optim_case(tfuse.optim.FusedAdamW, torch.bfloat16, amsgrad=True, master_weights=True),
    "adam_fp16": optim_case(tfuse.optim.FusedAdam, torch.float16, weight_decay=0.1),
    "adam_eps0_fp64": optim_case(tfuse.optim.FusedAdam, torch.float64, eps=0.0),
    "sgd_momentum_fp32": optim_case(tfuse.optim.FusedSGD, torch.float32, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_plain_bf16_master": optim_case(tfuse.optim.FusedSGD, torch.bfloat16, lr=0.1, master_weights=True),
    "adagrad_fp32": optim_case(tfuse.optim.FusedAdagrad, torch.float32, lr=0.1, weight_decay=0.1),
    "adagrad_bf16_master": optim_case(tfuse.optim.FusedAdagrad, torch.bfloat16, lr=0.1, master_weights=True),
    "lion_fp32": optim_case(tfuse.optim.FusedLion, torch.float32, weight_decay=0.1),
    "lion_bf16_master": optim_case(tfuse.optim.FusedLion, torch.bfloat16, master_weights=True),
    "lamb_fp32": optim_case(tfuse.optim.FusedLAMB, torch.float32, weight_decay=0.1),
    "lamb_bf16_master": optim_case(tfuse.optim.FusedLAMB, torch.bfloat16, master_weights=True),
    "lars_fp32": optim_case(tfuse.optim.FusedLARS, torch.float32, weight_decay=5e-5, nesterov=True),
    "lars_bf16_master": optim_case(tfuse.optim.FusedLARS, torch.bfloat16, master_weights=True),
    "muon_fp32": optim_case(tfuse.optim.FusedMuon, torch.float32, weight_decay=0.1),
    "muon_bf16_master": optim_case(tfuse.optim.FusedMuon, torch.bfloat16, master_weights=True),
}

# Every activation in every kernel family that applies one: each is a constexpr branch of the activation
# helpers, compiled only when some case selects it (hardswish and hardsigmoid once failed to compile with
# Triton 3.6 while no case here selected them).
from tfuse.ops._activations import Activation  # noqa: E402

for _act in Activation:
    CASES[f"sweep_add_act_{_act.label}_fp32"] = add_act_case((64, 32), [(32,)], torch.float32, _act.label)
    CASES[f"sweep_bn_{_act.label}_fp32"] = bn_case((2, 8, 4, 4), torch.float32, _act.label, residual=True)
    CASES[f"sweep_dw_{_act.label}_fp32"] = depthwise_case((2, 8, 6, 6), (3, 3), torch.float32, _act.label,
                                                          act_out=_act.label, bias=True)

vector_widths = roofline.vector_widths

#: Kernels whose SASS decoding is checked against nvdisasm (one loop-free, one with a loop and barriers).
SASS_CHECKED = (("add3_1e8_fp32", "_add_fwd_kernel"), ("bn_64x112x112_nchw_bf16", "_bn_stats_partial_kernel"))

#: Reductions whose last program per group merges the group's partials (kernels/batch_norm.py, kernels/depthwise.py).
MERGING_REDUCTIONS = ("_bn_stats_partial_kernel", "_bn_act_bwd_reduce_kernel", "_dw_bwd_dw_partial_kernel")


def merge_ordering(ptx: str) -> dict:
    """How a merging reduction publishes its partials and learns it is last, from its PTX: its atomics, whether a
    CTA barrier lies between each atomic and the last global store before it (every thread's partials stored
    before the release), and how many global loads after the first bypass L1 (``ld.global.cg``)."""
    lines = ptx.splitlines()
    atomics = [i for i, line in enumerate(lines) if re.search(r"\batom\.", line)]
    barriers = []
    for atomic in atomics:
        last_store = max((i for i, line in enumerate(lines[:atomic]) if "st.global" in line), default=-1)
        barriers.append(any("bar.sync" in line for line in lines[last_store + 1:atomic]))
    return dict(
        atomics=[re.search(r"\batom\.[\w.:]+", lines[i]).group(0) for i in atomics],
        barriers_before=barriers,
        cg_loads_after=sum("ld.global.cg" in line for line in lines[atomics[0]:]) if atomics else 0,
    )


def main(names: list[str]) -> None:
    start = time.perf_counter()
    realistic = roofline.cases()
    compile_names = [n for n in names if n in CASES] if names else list(CASES)
    roofline_cases = [c for c in realistic if c.name in names] if names else realistic
    unknown = set(names) - set(CASES) - {c.name for c in realistic}
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}")
    print(json.dumps({"kind": "planned", "compile": compile_names, "roofline": [c.name for c in roofline_cases]}))
    compiler = roofline.Compiler()
    compile_launches = []
    for name in compile_names:
        with captured_launches(compiler=compiler) as capture:
            CASES[name]()
        compile_launches += [(name, launch) for launch in capture.launches]
    captured = roofline.capture_cases(roofline_cases, compiler=compiler)
    # Every distinct specialisation compiles once, in parallel processes, before any record is read.
    compiler.prefetch([launch for _, launch in compile_launches] + [l for _, ls in captured for l in ls])
    compile_records = [roofline.launch_record(compiler, launch, name) for name, launch in compile_launches]
    for record in compile_records:
        print(json.dumps(dict(record, kind="compile")))
    records, phases = roofline.run_cases(roofline_cases, compiler, captured=captured)
    for record in records:
        print(json.dumps(dict(record, kind="launch")))
    for phase in phases:
        print(json.dumps(dict(phase, kind="phase")))
    launches = len(compile_launches) + len(records)
    checked = {(r["case"], r["kernel"]): r["key"] for r in records}
    by_key = {c.short_key: c for c in compiler.cache.values()}
    for case, kernel in SASS_CHECKED:
        if (case, kernel) in checked:
            compiled = by_key[checked[case, kernel]]
            print(json.dumps(dict(kind="sass_check", case=case, kernel=kernel,
                                  decoded=roofline.sass_counts(compiled.cubin, kernel),
                                  nvdisasm=roofline.nvdisasm_counts(compiled.cubin, kernel))))
    for record in compile_records + records:
        if record["kernel"] in MERGING_REDUCTIONS:
            print(json.dumps(dict(kind="merge_check", case=record["case"], kernel=record["kernel"],
                                  **merge_ordering(by_key[record["key"]].ptx))))
    print(json.dumps(dict(
        kind="summary", triton=roofline.triton.__version__, launches=launches, compiled=len(compiler.cache),
        builds=compiler.builds, workers=roofline.default_workers(), compile_seconds=round(compiler.compile_seconds, 1),
        seconds=round(time.perf_counter() - start, 1),
    )))


if __name__ == "__main__":
    main(sys.argv[1:])
