"""The README's Python examples run as written on the machine a newcomer has (a CPU, no interpreter).

Each ```python block runs in a fresh process without TRITON_INTERPRET, as a
user's script would; a block preceded by ``<!-- readme-test: not run (...) -->``
says why it cannot run here (it needs torchrun, say) and is skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = "<!-- readme-test: not run"


def python_blocks() -> list[tuple[int, str, bool]]:
    """(line number, code, runnable) of every ```python block."""
    if not README.is_file():
        return []
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip().splitlines()[-1:] or [""]
        blocks.append((line, match.group(1), not before[0].startswith(NOT_RUN)))
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_examples():
    assert README.is_file(), "needs the source tree"
    assert sum(runnable for _, _, runnable in BLOCKS) >= 4


@pytest.mark.parametrize("line, code, runnable", BLOCKS, ids=[f"line{line}" for line, _, _ in BLOCKS])
def test_example_runs_on_a_plain_cpu(line, code, runnable, tmp_path):
    if not runnable:
        pytest.skip(f"README block at line {line} is marked as not runnable here")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"README block at line {line}:\n{result.stderr[-3000:]}"
