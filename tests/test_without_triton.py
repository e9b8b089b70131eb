"""tfuse where Triton is not installed (macOS, Windows, images without it): it imports, and the
PyTorch path serves every op; asking for the Triton backend is a clear error.

Each test runs a fresh interpreter in which any import of ``triton`` fails, as on
a machine without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import run_command

ROOT = Path(__file__).resolve().parent.parent

BLOCK_TRITON = """
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, _NoTriton())
"""


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    script = BLOCK_TRITON + textwrap.dedent(code)
    return run_command([sys.executable, "-c", script], cwd=ROOT, env=env, timeout=300)


def test_every_op_runs_on_the_pytorch_path_without_triton():
    result = run_without_triton("""
        import logging, sys
        import torch, torch.nn.functional as F
        import tfuse
        from tfuse.functional import batch_norm_act

        assert "triton" not in sys.modules
        assert not tfuse._backend.triton_available() and not tfuse.interpreter_active()
        torch.manual_seed(0)
        x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        b = torch.randn(8, dtype=torch.float64, requires_grad=True)
        with tfuse.count_launches() as launches:
            y = tfuse.add_act(x, b, act="gelu")
            (gx, gb) = torch.autograd.grad(y.sum(), (x, b))
            s = tfuse.add(x, x, b)
            bn = batch_norm_act(x.view(4, 8, 1), None, None, training=True, act="silu")
        ref = F.gelu(x + b)
        (rx, rb) = torch.autograd.grad(ref.sum(), (x, b))
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gb, rb)
        torch.testing.assert_close(s, x + x + b)
        torch.testing.assert_close(bn, F.silu(F.batch_norm(x.view(4, 8, 1), None, None, training=True)))
        assert launches.total == 0

        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), tfuse.nn.FusedBatchNormAct2d(4), torch.nn.Flatten(),
                                    tfuse.nn.FusedLinear(4 * 6 * 6, 3, act="silu"))
        optimizer = tfuse.optim.FusedAdam(model.parameters(), lr=1e-3, capturable=True)
        model(torch.randn(2, 3, 8, 8)).square().sum().backward()
        tfuse.optim.clip_grad_norm_(optimizer, 1.0)
        optimizer.step()
        assert "0 Triton launches per step" in optimizer.describe() and "PyTorch path" in optimizer.describe()
        assert "triton" not in sys.modules
        print("ok")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
    assert "Triton not available" not in result.stderr  # torch.library's warning: tfuse registers plain ops then


def test_asking_for_the_triton_backend_without_triton_says_what_to_do():
    result = run_without_triton("""
        import os, torch, tfuse
        os.environ["TFUSE_BACKEND"] = "triton"
        try:
            tfuse.add(torch.ones(2), torch.ones(2))
        except RuntimeError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the Triton backend was requested, but Triton is not installed" in result.stdout
    assert "TFUSE_BACKEND=auto or torch" in result.stdout


def test_the_backend_log_line_names_the_reason():
    result = run_without_triton("""
        import logging, torch, tfuse
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        tfuse.add_act(torch.ones(2), act="relu")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tfuse.add_act: PyTorch path (Triton is not installed; device cpu)" in result.stderr


def test_triton_is_a_linux_only_dependency_and_the_license_is_shipped():
    text = (ROOT / "pyproject.toml").read_text()
    (dependencies,) = re.findall(r"^dependencies = \[(.*)\]$", text, flags=re.M)
    (triton,) = [d.strip(' "') for d in dependencies.split(",") if "triton" in d]
    assert triton == "triton>=3.6; sys_platform == 'linux'"
    assert 'license = "Apache-2.0"' in text and 'license-files = ["LICENSE"]' in text  # SPDX, and the file shipped
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n                           Version 2.0")
