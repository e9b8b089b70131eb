"""Backend selection: TFUSE_BACKEND, use_backend, the interpreter rule, and their errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tfuse
from tfuse import Backend

from conftest import ON_CUDA

from helpers import run_command


def test_auto_picks_triton_where_kernels_can_run(device):
    assert tfuse.select_backend(device, "add") is Backend.TRITON
    if not ON_CUDA:
        assert tfuse.interpreter_active()


def test_auto_uses_torch_on_devices_triton_does_not_serve():
    out = tfuse.add(torch.ones(3, device="meta"), torch.ones(3, device="meta"))
    assert out.device.type == "meta" and out.shape == (3,)
    assert tfuse.select_backend(torch.device("meta"), "add") is Backend.TORCH


@pytest.mark.parametrize("value, expected", [("torch", Backend.TORCH), (" Torch ", Backend.TORCH), ("triton", Backend.TRITON), ("auto", Backend.TRITON), ("", Backend.TRITON)])
def test_environment_variable(monkeypatch, device, value, expected):
    monkeypatch.setenv("TFUSE_BACKEND", value)
    assert tfuse.select_backend(device, "add") is expected
    with tfuse.count_launches() as launches:
        out = tfuse.add(torch.ones(5, device=device), torch.ones(5, device=device))
    assert launches.total == (1 if expected is Backend.TRITON else 0)
    assert (out == 2).all()


@pytest.mark.parametrize("value", ["cuda", "tritonn", "1"])
def test_unknown_environment_value_is_an_error(monkeypatch, device, value):
    monkeypatch.setenv("TFUSE_BACKEND", value)
    message = rf"TFUSE_BACKEND='{value}' is not a tfuse backend; expected one of auto, triton, torch"
    with pytest.raises(ValueError, match=message):
        tfuse.add(torch.ones(2, device=device), torch.ones(2, device=device))


def test_use_backend_overrides_environment_and_nests(monkeypatch, device):
    monkeypatch.setenv("TFUSE_BACKEND", "triton")
    with tfuse.use_backend("torch"):
        assert tfuse.select_backend(device, "add") is Backend.TORCH
        with tfuse.use_backend("triton"):
            assert tfuse.select_backend(device, "add") is Backend.TRITON
        assert tfuse.select_backend(device, "add") is Backend.TORCH
    with tfuse.use_backend("auto"):  # auto defers to nothing: the automatic rule
        assert tfuse.select_backend(device, "add") is Backend.TRITON


def test_use_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"use_backend='gpu' is not a tfuse backend"):
        with tfuse.use_backend("gpu"):
            pass


def test_forced_triton_on_unsupported_device():
    with tfuse.use_backend("triton"), pytest.raises(RuntimeError, match=r"cannot run on device meta"):
        tfuse.add(torch.ones(2, device="meta"), torch.ones(2, device="meta"))


def _run_without_interpreter(code: str, backend: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    env["TFUSE_BACKEND"] = backend
    return run_command([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=120)


def test_forced_triton_on_cpu_without_interpreter_says_how_to_fix():
    result = _run_without_interpreter(
        """
        import torch, tfuse
        try:
            tfuse.add(torch.ones(3), torch.ones(3))
        except RuntimeError as error:
            print(error)
        """,
        backend="triton",
    )
    assert result.returncode == 0, result.stderr
    assert "interpreter is off" in result.stdout
    assert "Set TRITON_INTERPRET=1" in result.stdout


def test_cpu_without_interpreter_runs_the_torch_path():
    result = _run_without_interpreter(
        """
        import torch, tfuse
        assert not tfuse.interpreter_active()
        a, b, c = torch.randn(3, 1000).unbind()
        with tfuse.count_launches() as launches:
            out = tfuse.add(a, b, c)
        assert launches.total == 0, launches
        torch.testing.assert_close(out, a + b + c)
        print("ok")
        """,
        backend="auto",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
