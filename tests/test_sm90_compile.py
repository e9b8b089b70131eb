"""The kernels compile for an H100/H200 (sm_90) with the installed Triton, and
contiguous operands are read and written with 128-bit vectors.

The interpreter checks numerics, not what the compiler accepts (globals must
be constexpr, constexprs cannot be reassigned, a constexpr cannot lead a
product with a tensor, ...); this closes that gap on a machine without a GPU.
It runs tests/sm90_compile.py in a fresh process, because the test process
itself runs with the interpreter on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")

# (case, kernel) pairs whose every global load and store must be 4 x 32 bits.
VECTORISED = [
    ("add3_contiguous_fp32", "_add_fwd_kernel"),
    ("add3_contiguous_bf16", "_add_fwd_kernel"),
    ("add8_contiguous_fp16", "_add_fwd_kernel"),
    ("bias_over_rows_fp32", "_add_fwd_kernel"),
    ("per_channel_channels_last_fp16", "_add_fwd_kernel"),
    ("add_act_gelu_bias_bf16", "_add_act_fwd_kernel"),
    ("add_act_gelu_bias_bf16", "_add_act_bwd_kernel"),
    ("add_act_relu_bias_residual_fp32", "_add_act_fwd_kernel"),
    ("add_act_relu_bias_residual_fp32", "_add_act_bwd_kernel"),
]


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 notice
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    planned = lines[0]["planned"]
    launches = {(entry["case"], entry["kernel"]): entry for entry in lines[1:]}
    assert sorted({case for case, _ in launches}) == sorted(planned)
    return launches


def test_every_kernel_compiles(compiled):
    kernels = {kernel for _, kernel in compiled}
    assert kernels == {
        "_add_fwd_kernel", "_add_act_fwd_kernel", "_add_act_bwd_kernel", "_sum_partials_kernel",
        "_bn_stats_partial_kernel", "_bn_stats_final_kernel", "_bn_act_fwd_kernel",
        "_bn_act_bwd_reduce_kernel", "_bn_bwd_final_kernel", "_bn_act_bwd_dx_kernel",
        "_norm_partial_kernel", "_norm_final_kernel", "_clip_segments_kernel", "_adam_kernel", "_sgd_kernel",
    }


@pytest.mark.parametrize("case, kernel", VECTORISED)
def test_contiguous_operands_use_128_bit_accesses(compiled, case, kernel):
    assert compiled[case, kernel]["loads"] == [4]
    assert compiled[case, kernel]["stores"] == [4]


def test_per_channel_nchw_vectorises_the_full_size_inputs(compiled):
    # The [C, 1, 1] input is one scalar load per row; the others are vectors.
    assert compiled["per_channel_nchw_bf16", "_add_fwd_kernel"]["loads"] == [1, 4]
    assert compiled["per_channel_nchw_bf16", "_add_fwd_kernel"]["stores"] == [4]


def test_float64_uses_128_bit_accesses(compiled):
    assert compiled["float64", "_add_fwd_kernel"]["loads"] == [2]  # 2 x 64 bits


@pytest.mark.parametrize("case, kernel", [
    ("adam_fp32", "_adam_kernel"),
    ("adamw_amsgrad_bf16_master", "_adam_kernel"),
    ("adam_fp16", "_adam_kernel"),
    ("sgd_momentum_fp32", "_sgd_kernel"),
    ("sgd_plain_bf16_master", "_sgd_kernel"),
])
def test_optimizer_streams_use_128_bit_accesses(compiled, case, kernel):
    # Scalar loads are the block table and the coefficient row; every stream is 128-bit.
    assert compiled[case, kernel]["loads"] == [1, 4]
    assert compiled[case, kernel]["stores"] == [4]


def test_adam_with_eps_zero_keeps_exact_run_ends(compiled):
    # eps == 0 would turn zero padding into 0/0, so runs end exactly and masks are per element.
    assert compiled["adam_eps0_fp64", "_adam_kernel"]["stores"] == [1]
