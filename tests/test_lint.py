"""The library passes its linter and formatter (ruff, configured in pyproject.toml).

ruff comes with the test extra (``pip install -e ".[test]"``); on a machine
without it (the offline GPU machines) these checks are skipped, CI runs them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_command

pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ["tfuse", "kernels"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return run_command([sys.executable, "-m", "ruff", *args], cwd=ROOT, timeout=120)


def test_the_library_passes_ruff_check():
    result = _ruff("check", "--no-cache", *LIBRARY)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_library_is_formatted_with_ruff_format():
    result = _ruff("format", "--check", "--no-cache", *LIBRARY)
    assert result.returncode == 0, result.stdout + result.stderr
