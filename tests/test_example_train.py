"""The README's main command, ``python -m tfuse.examples.train``, in its short mode: 2 CPU ranks, 8 steps.

It runs as a user runs it (a fresh process, no TRITON_INTERPRET: the PyTorch
path), and its two trainings (tfuse, plain PyTorch from the same weights on
the same batches) must agree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import run_command

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def test_the_example_trains_both_ways_and_they_agree(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    command = [sys.executable, "-m", "tfuse.examples.train", "--quick", "--cpu", "--out", str(tmp_path)]
    result = run_command(command, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "2 ranks (gloo on the CPU)" in out
    assert "fusion: fused 7 BatchNorm2d+ReLU (3 with residual), 1 Linear+ReLU (torch.fx)" in out
    assert "all-reduce: 28 gradient tensors -> 1 all-reduce call(s) per step over 2 ranks" in out
    assert "held-out accuracy" in out and "step time, plain / tfuse:" in out
    saved = json.loads((tmp_path / "train.json").read_text())
    fused, plain = saved["trainings"]["tfuse"], saved["trainings"]["plain PyTorch"]
    assert len(fused["losses"]) == len(plain["losses"]) == 8
    # Same weights, same batches, float32 on both sides: the curves differ by rounding only.
    for a, b in zip(fused["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-3 * abs(b), (fused["losses"], plain["losses"])
    assert abs(fused["accuracy"][-1] - plain["accuracy"][-1]) <= 2 / 256  # a test image or two either way
    assert saved["step_time_ratio"] > 0
    assert (tmp_path / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_refused(capsys):
    # main() itself, in this process: it refuses before any rank starts (the command line's way into main() runs
    # in the test above; a process of its own here would cost an import of torch and tfuse for an argparse error).
    from tfuse.examples import train

    with pytest.raises(SystemExit) as raised:
        train.main(["--batch", "7"])
    assert raised.value.code == 2 and "--batch a multiple of --ranks" in capsys.readouterr().err


def test_digits_without_scikit_learn_is_refused_before_any_rank_starts(monkeypatch, capsys):
    from tfuse.examples import train

    real = train.importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    with pytest.raises(SystemExit) as raised:
        train.parse(["--data", "digits", "--cpu"])
    assert raised.value.code == 2 and "--data digits needs scikit-learn" in capsys.readouterr().err


def test_each_run_gets_its_own_output_folder():
    from benchmarks.__main__ import default_out_dir

    first, second = default_out_dir(), default_out_dir()
    assert first != second and first.is_dir() and second.is_dir()
    first.rmdir(), second.rmdir()


def test_the_optimizer_comparison_builds_each_run_and_each_steps_the_model():
    """``python -m tfuse.examples.optimizers`` (its curves are committed, not rerun here): each run's optimizer
    takes the example's model, LARS and LAMB with biases and batch-norm parameters in a group without weight
    decay, Muon with its matrices and the rest split, and a step moves every parameter that has a gradient."""
    import torch

    from tfuse.examples.optimizers import runs
    from tfuse.examples.train import SmallResNet, glyph_digits

    images, labels = glyph_digits(16, seed=0)
    for name, batch, make in runs():
        torch.manual_seed(0)
        model = SmallResNet()
        optimizer = make(model)
        before = [p.detach().clone() for p in model.parameters()]
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), name
        if "LARS" in name or "LAMB" in name:
            assert [g["weight_decay"] for g in optimizer.param_groups][1] == 0.0
        if "Muon" in name:
            assert {g["use_muon"] for g in optimizer.param_groups} == {True, False}
