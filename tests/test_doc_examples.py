"""The Python examples of the README and of the documentation pages (docs/*.md) run as written on the machine a
newcomer has (a CPU, no interpreter).

Each ```python block runs in a process of its own without TRITON_INTERPRET, as a
user's script would: one runner process imports torch and tfuse once, then forks
a child per block, which runs it in a fresh namespace and folder (the imports,
~6 s each on a 2-core CPU, would otherwise be most of this file's time). The line
before a block can say how else to run it:

- ``<!-- doc-test: torchrun N -->``: the block is a torchrun script; it is
  written to a file and launched on N processes (gloo ranks on a CPU), as
  ``torchrun --nproc_per_node=N script.py`` would;
- ``<!-- doc-test: not run (...) -->``: the block cannot run here (it
  needs a CUDA GPU, say), and is skipped with the reason given.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers import run_command

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
NOT_RUN = "<!-- doc-test: not run"
TORCHRUN = re.compile(r"<!-- doc-test: torchrun (\d+) -->")
TIMEOUT_S = 180  # a block takes ~6 s alone on a 2-core CPU; the margin is for a loaded machine


class Block(NamedTuple):
    where: str  # "README.md:12", "docs/optimizers.md:40": the test id and the failure message
    code: str
    marker: str  # the line before the block ("" when it has no doc-test marker)


def python_blocks() -> list[Block]:
    """Every ```python block of the README and the docs pages, with the line before it."""
    blocks = []
    for document in DOCUMENTS:
        if not document.is_file():
            continue
        text = document.read_text()
        name = document.relative_to(ROOT).as_posix()
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip().splitlines()[-1:] or [""]
            marker = before[0] if before[0].startswith("<!-- doc-test:") else ""
            blocks.append(Block(f"{name}:{line}", match.group(1), marker))
    return blocks


BLOCKS = python_blocks()


def test_the_docs_have_examples() -> None:
    assert README.is_file(), "needs the source tree"
    readme = [block for block in BLOCKS if block.where.startswith("README.md:")]
    assert sum(block.marker == "" for block in readme) >= 2, "the README's quick start lost its examples"
    assert sum(block.marker == "" for block in BLOCKS) >= 12
    assert sum(bool(TORCHRUN.fullmatch(block.marker)) for block in BLOCKS) >= 5
    for block in BLOCKS:  # a misspelt marker would otherwise run a torchrun script as a plain one
        known = block.marker == "" or block.marker.startswith(NOT_RUN) or TORCHRUN.fullmatch(block.marker)
        assert known, f"{block.where}: unknown marker {block.marker!r}"
    for document in DOCUMENTS:  # an older marker name would silently run its block as a plain one
        assert "<!-- readme-test:" not in document.read_text(), f"{document.name}: write <!-- doc-test: ... -->"


#: Runs blocks given as a JSON list of [where, code] in its argv[1]: torch and tfuse imported once, then a
#: forked child per block (its own namespace, folder and output files); prints a JSON line per block.
_RUNNER = r"""
import json, os, sys, time, traceback
import torch, tfuse  # once, for every block
blocks, root, timeout = json.load(open(sys.argv[1])), sys.argv[2], float(sys.argv[3])
for index, (where, code) in enumerate(blocks):
    folder = os.path.join(root, f"block{index}")
    os.makedirs(folder)
    out = os.path.join(folder, "stderr.txt")
    pid = os.fork()
    if pid == 0:
        os.chdir(folder)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stderr.flush()
        os._exit(status)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.05)
    said = open(out).read()[-3000:] + (f"(killed after {timeout:.0f} s)" if status == -1 else "")
    print(json.dumps({"where": where, "status": status, "stderr": said}), flush=True)
"""


@pytest.fixture(scope="module")
def plain_results(tmp_path_factory) -> dict[str, dict]:
    """Every plain block, run by one runner process (see _RUNNER): where -> status and stderr."""
    blocks = [[block.where, block.code] for block in BLOCKS if block.marker == ""]
    root = tmp_path_factory.mktemp("doc-examples")
    listing = root / "blocks.json"
    listing.write_text(json.dumps(blocks))
    env = _user_env()
    result = run_command([sys.executable, "-c", _RUNNER, str(listing), str(root / "runs"), str(TIMEOUT_S)], env=env,
                         timeout=TIMEOUT_S * len(blocks))
    assert result.returncode == 0, result.stderr[-3000:]
    return {entry["where"]: entry for entry in map(json.loads, result.stdout.splitlines())}


def _user_env() -> dict[str, str]:
    """As a user's shell has it: no interpreter, automatic backend; one thread per process, as two ranks (or
    two xdist workers) share a small machine's cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_example_runs_on_a_plain_cpu(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if block.marker.startswith(NOT_RUN):
        pytest.skip(f"{block.where} is marked as not runnable here: {block.marker}")
    if block.marker == "":
        outcome = request.getfixturevalue("plain_results")[block.where]
        assert outcome["status"] == 0, f"{block.where}:\n{outcome['stderr']}"
        return
    env = _user_env()
    torchrun = TORCHRUN.fullmatch(block.marker)
    if torchrun:
        # A file, not -c: torchrun runs a script. cwd is tmp_path, so files the block writes
        # (checkpoints) land there.
        script = tmp_path / "snippet.py"
        script.write_text(block.code)
        nproc = f"--nproc_per_node={torchrun.group(1)}"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", nproc, str(script)]
    else:  # an unknown marker: test_the_readme_has_examples names it
        pytest.fail(f"{block.where}: unknown marker {block.marker!r}")
    result = run_command(command, cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{block.where}:\n{result.stderr[-3000:]}"
