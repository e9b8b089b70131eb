"""The tests' own helpers: a subprocess past its time fails with a message that says what to do; the
interpreter's arithmetic is unchanged by what conftest.py skips."""

from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.language.semantic import TritonSemantic

from conftest import DEVICE
from helpers import TIMEOUT_SCALE_ENV, run_command


def test_a_subprocess_past_its_time_fails_saying_what_ran_and_how_to_allow_more(monkeypatch):
    monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception) as failed:
        run_command([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], timeout=2)
    message = str(failed.value)
    assert "did not finish in 2 s" in message and "load average" in message
    assert f"{TIMEOUT_SCALE_ENV}=2" in message and "started" in message


def test_the_scale_gives_more_time(monkeypatch):
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "40")
    result = run_command([sys.executable, "-c", "import time; time.sleep(0.3); print('done')"], timeout=0.05)
    assert result.returncode == 0 and result.stdout.strip() == "done"


@triton.jit
def _wrapping_int32_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(y_ptr + offsets, (x * 3 + x) - (x - 7))  # int32 mul, add and sub, overflowing in some lanes


def test_interpreted_int32_arithmetic_is_the_same_without_the_unasserted_overflow_check(monkeypatch):
    """Importing tfuse under the interpreter skips its int32 overflow check, which nothing asserts while debug is
    off (tfuse/_interpreter.py): an overflowing kernel gives the same values, and raises no more, with Triton's own
    check as without it."""
    if DEVICE.type == "cuda":
        pytest.skip("the interpreter's check: a CPU run (on a GPU the kernel is compiled, not interpreted)")
    assert getattr(TritonSemantic.binary_op_sanitize_overflow_impl, "__wrapped__", None) is not None, "not skipped"
    current = TritonSemantic.binary_op_sanitize_overflow_impl
    x = torch.tensor([2**31 - 1, -(2**31), 12345, 2**30, -7, 0, 1 << 29, -(1 << 30)] * 2, dtype=torch.int32,
                     device=DEVICE)
    wide = x.long()
    expected = ((wide * 3 + wide) - (wide - 7) + 2**31) % 2**32 - 2**31  # int32 wraparound
    for sanitize in (getattr(current, "__wrapped__", current), current):
        monkeypatch.setattr(TritonSemantic, "binary_op_sanitize_overflow_impl", sanitize)
        y = torch.empty_like(x)
        _wrapping_int32_kernel[(1,)](x, y, BLOCK=16)
        assert torch.equal(y.long(), expected)
