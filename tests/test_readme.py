"""The README's Python examples run as written on the machine a newcomer has (a CPU, no interpreter).

Each ```python block runs in a fresh process without TRITON_INTERPRET, as a
user's script would. The line before a block can say how else to run it:

- ``<!-- readme-test: torchrun N -->``: the block is a torchrun script; it is
  written to a file and launched on N processes (gloo ranks on a CPU), as
  ``torchrun --nproc_per_node=N script.py`` would;
- ``<!-- readme-test: not run (...) -->``: the block cannot run here (it
  needs a CUDA GPU, say), and is skipped with the reason given.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from helpers import run_command

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = "<!-- readme-test: not run"
TORCHRUN = re.compile(r"<!-- readme-test: torchrun (\d+) -->")
TIMEOUT_S = 180  # a block takes ~6 s alone on a 2-core CPU; the margin is for a loaded machine


class Block(NamedTuple):
    line: int  # where the block starts in README.md, for the test id and the failure message
    code: str
    marker: str  # the line before the block ("" when it has no readme-test marker)


def python_blocks() -> list[Block]:
    """Every ```python block of the README, with the line before it."""
    if not README.is_file():
        return []
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip().splitlines()[-1:] or [""]
        marker = before[0] if before[0].startswith("<!-- readme-test:") else ""
        blocks.append(Block(line, match.group(1), marker))
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_examples() -> None:
    assert README.is_file(), "needs the source tree"
    assert sum(block.marker == "" for block in BLOCKS) >= 4
    assert sum(bool(TORCHRUN.fullmatch(block.marker)) for block in BLOCKS) >= 1
    for block in BLOCKS:  # a misspelt marker would otherwise run a torchrun script as a plain one
        known = block.marker == "" or block.marker.startswith(NOT_RUN) or TORCHRUN.fullmatch(block.marker)
        assert known, f"README block at line {block.line}: unknown marker {block.marker!r}"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{block.line}" for block in BLOCKS])
def test_example_runs_on_a_plain_cpu(block: Block, tmp_path: Path) -> None:
    if block.marker.startswith(NOT_RUN):
        pytest.skip(f"README block at line {block.line} is marked as not runnable here: {block.marker}")
    # As a user's shell has it: no interpreter, automatic backend; one thread per process, as two
    # ranks (or two xdist workers) share a small machine's cores.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = TORCHRUN.fullmatch(block.marker)
    if torchrun:
        # A file, not -c: torchrun runs a script. cwd is tmp_path, so files the block writes
        # (checkpoints) land there.
        script = tmp_path / "snippet.py"
        script.write_text(block.code)
        nproc = f"--nproc_per_node={torchrun.group(1)}"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", nproc, str(script)]
    else:
        command = [sys.executable, "-c", block.code]
    result = run_command(command, cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"README block at line {block.line}:\n{result.stderr[-3000:]}"
