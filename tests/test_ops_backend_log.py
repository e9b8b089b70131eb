"""Which backend serves each op is logged once per (op, backend), at INFO, through the op modules' loggers."""

from __future__ import annotations

import logging

import pytest
import torch

import tfuse
from tfuse import _backend
from tfuse.functional import batch_norm_act

from conftest import ON_CUDA

OPS = {
    "add": ("tfuse.ops.add", lambda x: tfuse.add(x, x)),
    "add_act": ("tfuse.ops.add_act", lambda x: tfuse.add_act(x, act="gelu")),
    "batch_norm_act": ("tfuse.ops.batch_norm", lambda x: batch_norm_act(x, None, None, training=True)),
}


@pytest.fixture
def fresh_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(_backend, "_announced", set())
    caplog.set_level(logging.INFO, logger="tfuse")
    return caplog


@pytest.mark.parametrize("op", OPS)
def test_each_op_says_once_which_backend_serves_it(op, fresh_log, device):
    logger, run = OPS[op]
    x = torch.randn(4, 3, device=device)
    for _ in range(3):
        run(x)
        with tfuse.use_backend("torch"):
            run(x)
    records = [r for r in fresh_log.records if r.name == logger]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO]
    triton, torch_path = (r.getMessage() for r in records)
    where = "CUDA" if ON_CUDA else "CPU through Triton's interpreter, TRITON_INTERPRET=1"
    assert triton == f"tfuse.{op}: Triton kernels ({where}; device {x.device})"
    assert torch_path == f"tfuse.{op}: PyTorch path (forced by use_backend='torch'; device {x.device})"


def test_automatic_pytorch_path_says_why(fresh_log, monkeypatch):
    # A CPU tensor without the interpreter: what a CPU user sees.
    monkeypatch.setattr(_backend, "interpreter_active", lambda: False)
    tfuse.add(torch.ones(2), torch.ones(2))
    monkeypatch.setenv(tfuse.BACKEND_ENV_VAR, "torch")
    tfuse.add_act(torch.ones(2), act="relu")
    messages = [r.getMessage() for r in fresh_log.records if r.name.startswith("tfuse.ops")]
    assert messages == [
        "tfuse.add: PyTorch path (CPU without TRITON_INTERPRET=1; device cpu)",
        "tfuse.add_act: PyTorch path (forced by TFUSE_BACKEND='torch'; device cpu)",
    ]
