"""tfuse's launch seam (tfuse/_launch.py): prepared launches, watching, simulated GPUs; the size rule."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

import tfuse
from tfuse import _backend, _launch
from tfuse._backend import Backend, select_backend

from helpers import run_command

ROOT = Path(__file__).resolve().parents[1]


def test_prepared_launches_against_a_stub_driver():
    """Prepared launches reuse a compiled kernel only for arguments of its specialisation (see the script)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = run_command([sys.executable, str(ROOT / "tests" / "prepared_launch_check.py")], timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_watchers_see_launches_and_run_false_skips_them(device):
    seen = []
    out = None
    with (
        tfuse.use_backend("triton"),
        _launch.watch_launches(lambda kernel, *_: seen.append(_launch.kernel_name(kernel))),
    ):
        out = tfuse.add(torch.ones(4, device=device), torch.ones(4, device=device))
    assert seen == ["_add_fwd_kernel"] and out.tolist() == [2.0] * 4
    with tfuse.use_backend("triton"), _launch.watch_launches(lambda *_: None, run=False), tfuse.count_launches() as n:
        skipped = tfuse.add(torch.ones(4, device=device), torch.ones(4, device=device))
    assert n.total == 1  # counted, not run: the output is as allocated
    assert skipped.shape == (4,)
    assert _launch._launching  # the seam launches again after the block


def test_simulated_gpu_answers_the_device_questions():
    cpu = torch.device("cpu")
    assert _launch.gpu_sm_count(cpu) is None and _launch.target_programs(cpu) == 8
    with _launch.simulate_gpu(132, resident=lambda kernel, args, meta: 7):
        assert _launch.gpu_sm_count(cpu) == 132
        assert _launch.target_programs(cpu) == 528
        assert _launch.resident_programs(None, (), {}, cpu) == 7
        assert select_backend(torch.device("meta"), "add") is Backend.TRITON
        with tfuse.use_backend("torch"):
            assert select_backend(cpu, "add") is Backend.TORCH  # a forced backend still wins
    assert not _launch.simulated_gpu()


@pytest.fixture
def cuda_rules(monkeypatch):
    """select_backend's rules for a CUDA device, on a machine that may have none (only the rules run)."""
    monkeypatch.setattr(_backend, "triton_available", lambda: True)
    monkeypatch.setattr(_backend, "_size_choices", {})
    monkeypatch.delenv(_backend.BACKEND_ENV_VAR, raising=False)
    monkeypatch.delenv(_backend.SMALL_OP_ENV_VAR, raising=False)
    return torch.device("cuda", 0)


def test_small_ops_take_the_pytorch_path_on_cuda(cuda_rules, caplog):
    threshold = _backend.SMALL_OP_ELEMENTS
    with caplog.at_level(logging.INFO, logger="tfuse"):
        assert select_backend(cuda_rules, "batch_norm_act", threshold - 1) is Backend.TORCH
        assert select_backend(cuda_rules, "batch_norm_act", threshold - 2) is Backend.TORCH  # same class: no new log
        assert select_backend(cuda_rules, "batch_norm_act", threshold) is Backend.TRITON
        assert select_backend(cuda_rules, "batch_norm_act") is Backend.TRITON  # no size given: no rule
    logged = [r.getMessage() for r in caplog.records if "PyTorch path for CUDA tensors" in r.getMessage()]
    assert len(logged) == 1 and "TFUSE_SMALL_OP_ELEMENTS" in logged[0] and "TFUSE_BACKEND=triton" in logged[0]
    classes = _backend.size_dispatch()
    assert classes[("batch_norm_act", threshold // 2)] == "torch" and classes[("batch_norm_act", threshold)] == "triton"
    # On the CPU size changes nothing.
    assert select_backend(torch.device("cpu"), "add", 1) is select_backend(torch.device("cpu"), "add")


def test_the_size_rule_is_overridable(cuda_rules, monkeypatch):
    with tfuse.use_backend("triton"):
        assert select_backend(cuda_rules, "add", 1) is Backend.TRITON
    monkeypatch.setenv(_backend.BACKEND_ENV_VAR, "triton")
    assert select_backend(cuda_rules, "add", 1) is Backend.TRITON
    monkeypatch.delenv(_backend.BACKEND_ENV_VAR)
    monkeypatch.setenv(_backend.SMALL_OP_ENV_VAR, "0")
    assert select_backend(cuda_rules, "add", 1) is Backend.TRITON
    monkeypatch.setenv(_backend.SMALL_OP_ENV_VAR, "100")
    assert select_backend(cuda_rules, "add", 99) is Backend.TORCH
    monkeypatch.setenv(_backend.SMALL_OP_ENV_VAR, "lots")
    with pytest.raises(ValueError, match="TFUSE_SMALL_OP_ELEMENTS='lots' must be a number of elements"):
        select_backend(cuda_rules, "add", 99)
