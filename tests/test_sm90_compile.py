"""The kernels compile for an H100/H200 (sm_90) with the installed Triton, and
contiguous inputs are read and written with 128-bit vectors.

The interpreter checks numerics, not what the compiler accepts (globals must
be constexpr, constexprs cannot be reassigned, ...); this closes that gap on a
machine without a GPU. It runs tests/sm90_compile.py in a fresh process,
because the test process itself runs with the interpreter on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")

# Cases whose every global load and store must be a 4 x 32-bit vector.
VECTORISED = [
    "add3_contiguous_fp32",
    "add3_contiguous_bf16",
    "add8_contiguous_fp16",
    "bias_over_rows_fp32",
    "per_channel_channels_last_fp16",
]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 notice
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    planned = lines[0]["planned"]
    cases = {case["case"]: case for case in lines[1:]}
    assert sorted(cases) == sorted(planned)
    return cases


def test_every_case_compiles(compiled):
    assert len(compiled) >= 8


@pytest.mark.parametrize("case", VECTORISED)
def test_contiguous_operands_use_128_bit_accesses(compiled, case):
    assert compiled[case]["loads"] == [4]
    assert compiled[case]["stores"] == [4]


def test_per_channel_nchw_vectorises_the_full_size_inputs(compiled):
    # The [C, 1, 1] input is one scalar load per row; the others are vectors.
    assert compiled["per_channel_nchw_bf16"]["loads"] == [1, 4]
    assert compiled["per_channel_nchw_bf16"]["stores"] == [4]
