"""The launch kit (tfuse/_kit.py, kernels/kit.py): each launch setting spelled once.

The values the kit gives, and a scan of the launchers and kernels proving
that none of them re-derives a setting the kit owns.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import triton.language as tl

import tfuse
from tfuse import _kit
from tfuse.kernels.kit import _acc_dtype
from tfuse.ops import _tiles

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- values


def test_index_width_switches_at_the_int32_bound():
    assert _kit.INT32_LIMIT == 2**31 - 1 == torch.iinfo(torch.int32).max
    assert not _kit.needs_int64(0)
    assert not _kit.needs_int64(_kit.INT32_LIMIT - 1)
    assert _kit.needs_int64(_kit.INT32_LIMIT)
    assert _kit.needs_int64(2**40)
    assert not _kit.needs_int64(999, limit=1000) and _kit.needs_int64(1000, limit=1000)


def test_tile_plans_use_the_kit_bound():
    # _tiles re-exports the kit's constant (tests lower it there to take the int64 path on small data).
    assert _tiles.INT32_LIMIT is _kit.INT32_LIMIT


@pytest.mark.parametrize("n, expected", [(0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (49, 64), (1000, 1024),
                                         (2048, 2048), (2**20 + 1, 2**21)])
def test_next_power_of_2_examples(n, expected):
    assert _kit.next_power_of_2(n) == expected


def test_next_power_of_2_is_the_smallest_power_not_below_n():
    for n in range(1, 5000):
        p = _kit.next_power_of_2(n)
        assert p & (p - 1) == 0 and p >= n and (p == 1 or p // 2 < n)


@pytest.mark.parametrize("dtypes, expected", [
    ((torch.float16,), torch.float32),
    ((torch.bfloat16,), torch.float32),
    ((torch.float32,), torch.float32),
    ((torch.float64,), torch.float64),
    ((torch.bfloat16, torch.float16), torch.float32),
    ((torch.float32, torch.float64), torch.float64),
    ((torch.float64, torch.bfloat16), torch.float64),
])
def test_accumulator_dtype(dtypes, expected):
    assert _kit.acc_dtype(*dtypes) == expected
    assert _kit.acc_fp64(*dtypes) == (expected == torch.float64)


def test_kernel_side_accumulator_dtype_follows_the_flag():
    # A triton.constexpr_function: called from Python it is the plain function.
    assert _acc_dtype(True) == tl.float64
    assert _acc_dtype(False) == tl.float32


@pytest.mark.parametrize("tile, per_thread, warps", [
    (1, 16, 4), (2048, 16, 4), (4096, 16, 8), (1 << 16, 16, 8),  # elementwise tiles, optimizer blocks
    (1024, 8, 4), (2048, 8, 8), (512, 8, 4),  # batch-norm tiles
])
def test_warps(tile, per_thread, warps):
    assert _kit.num_warps(tile, per_thread) == warps
    assert _kit.NUM_WARPS <= warps <= _kit.MAX_WARPS


def test_bf16_emulation_exactly_under_the_interpreter():
    assert _kit.emulate_bf16_rtne() is tfuse.interpreter_active()


# ---------------------------------------------------------------- one spelling each

#: Files that must take their launch settings from the kit (the kit itself excluded).
SCANNED = sorted(
    path
    for pattern in ("kernels/*.py", "tfuse/ops/*.py", "tfuse/nn/*.py", "tfuse/optim/*.py", "tfuse/functional.py",
                    "tfuse/_launch.py")
    for path in ROOT.glob(pattern) if path.name != "kit.py"
)

#: What re-deriving a kit setting looks like, by setting.
RESPELLINGS = {
    "accumulator dtype preamble": re.compile(r"if\s+ACC_FP64\s*:|:\s*tl\.constexpr\s*=\s*tl\.float(32|64)\b"),
    "host accumulator rule": re.compile(r"torch\.float64\s+if\b.*\belse\s+torch\.float32"),
    "next power of two": re.compile(r"def\s+_?next_power_of_2\b|1\s*<<.*\.bit_length\(\)|triton\.next_power_of_2"),
    "int32 index bound": re.compile(r"2\s*\*\*\s*31\s*-\s*1|2147483647|0x7fffffff|\(\s*1\s*<<\s*31\s*\)\s*-\s*1|"
                                    r"^\s*_?INT32_LIMIT\s*=", re.IGNORECASE | re.MULTILINE),
    "warps constant": re.compile(r"^\s*_?[A-Z_]*NUM_WARPS\s*=\s*\d|num_warps\s*=\s*\d", re.MULTILINE),
}


def test_the_scan_covers_the_launchers_and_kernels():
    names = {path.relative_to(ROOT).as_posix() for path in SCANNED}
    assert {"kernels/batch_norm.py", "kernels/tiles.py", "tfuse/ops/add_act.py", "tfuse/ops/batch_norm.py",
            "tfuse/optim/_update.py", "tfuse/optim/clip.py"} <= names
    assert "tfuse/_kit.py" not in names and "kernels/kit.py" not in names


@pytest.mark.parametrize("setting", RESPELLINGS)
def test_no_launcher_or_kernel_respells_a_kit_setting(setting):
    pattern = RESPELLINGS[setting]
    found = [
        f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}: {match.group(0)!r}"
        for path in SCANNED
        for text in [path.read_text()]
        for match in pattern.finditer(text)
    ]
    assert not found, f"{setting} spelled outside the kit:\n" + "\n".join(found)


@pytest.mark.parametrize("meta, helper", [("ACC_FP64", "acc_fp64("), ("EMULATE_BF16_RTNE", "emulate_bf16_rtne()")])
def test_launchers_take_flags_from_the_kit(meta, helper):
    # Every ACC_FP64=... / EMULATE_BF16_RTNE=... a launcher passes is the kit's answer.
    uses = [
        (path.relative_to(ROOT), line)
        for path in SCANNED if path.parts[-2] in ("ops", "optim")
        for line in path.read_text().splitlines() for _ in re.finditer(rf"\b{meta}=", line)
    ]
    assert uses, f"no launcher passes {meta}: the scan is looking in the wrong place"
    wrong = [f"{path}: {line.strip()}" for path, line in uses if not re.search(rf"\b{meta}={re.escape(helper)}", line)]
    assert not wrong, f"{meta} not from tfuse._kit:\n" + "\n".join(wrong)
