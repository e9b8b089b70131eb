"""The GPU campaign's scripts, run in their dry mode on the CPU, so they are tested before device time is spent.

A device call brings back at most 8 files from $OUT, so the two calls together
must write at most 8; each must leave its log even when a phase fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_command

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts" / "gpu"
MAX_FILES_BACK = 8

pytestmark = pytest.mark.skipif(not SCRIPTS.is_dir(), reason="needs the source tree (scripts/ is not installed)")


def _run_dry(script: str, out: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    env.update(OUT=str(out), PYTHON=sys.executable, **env_extra)
    return run_command(["bash", str(SCRIPTS / script), "--dry"], cwd=ROOT, env=env, timeout=300)


def test_both_calls_run_dry_and_bring_back_at_most_8_files(tmp_path):
    out1, out2 = tmp_path / "call1", tmp_path / "call2"
    first = _run_dry("call1.sh", out1)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = _run_dry("call2.sh", out2)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]

    files = [p for p in list(out1.rglob("*")) + list(out2.rglob("*")) if p.is_file()]
    assert len(files) <= MAX_FILES_BACK, sorted(p.name for p in files)
    assert sorted(p.name for p in out1.iterdir()) == ["e2e.jsonl", "e2e.log", "env.txt"]
    assert sorted(p.name for p in out2.iterdir()) == ["bench.log", "junit.xml", "micro.json", "micro.log", "pytest.log"]

    # call 1: the end-to-end benchmark streamed its rows (eager and tfuse for each model), every loss check ok.
    assert "e2e [tfuse] exit 0" in (out1 / "env.txt").read_text()
    rows = [json.loads(line) for line in (out1 / "e2e.jsonl").read_text().splitlines()]
    measured = [row for row in rows if row.get("kind") != "meta"]
    assert {(row["model"], row["variant"]) for row in measured} >= {
        (model, variant) for model in ("resnet50", "mobilenet_v2", "gpt2") for variant in ("eager", "tfuse")}
    assert all(row.get("loss_check") == "ok" for row in measured), measured
    assert "| resnet50 |" in (out1 / "e2e.log").read_text()  # the rendered table

    # call 2: the test selection collects, and the micro-benchmark ran its families with passing checks.
    bench = (out2 / "bench.log").read_text()
    assert "pytest exit 0" in bench and "micro exit 0" in bench, bench
    collected = (out2 / "pytest.log").read_text()
    assert "tests/test_batch_norm_act.py::" in collected
    assert "tests/test_distributed.py::" not in collected and "tests/test_add_act.py::" not in collected
    data = json.loads((out2 / "micro.json").read_text())
    assert {row["family"] for row in data["results"]} >= {"bn_act", "optim", "clip", "host"}
    assert not [row for row in data["results"] if "error" in row or row.get("ok") is False]


def test_the_micro_table_flags_a_failed_check(tmp_path):
    data = dict(head=dict(device="GPU X", torch="2.11", triton="3.6", python="3.12", date="2026-11-22"), copy_gbps=3000.0,
                results=[dict(family="add", case="a+b", ms=0.5, gbps=3000.0, pct_copy=100.0, rel_err=0.5, ok=False,
                              eager_ms=1.0),
                         dict(family="host", case="tfuse.add", ms=0.1, us_per_call=100.0),
                         dict(family="clip", error="Traceback...\nRuntimeError: boom")])
    source, table_path = tmp_path / "micro.json", tmp_path / "micro.md"
    source.write_text(json.dumps(data))
    # Its main() in this process (the command line's way into main() runs in call2.sh, above): --render reads the
    # JSON and writes the table, with no device and no timing.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # benchmarks/ lives at the repository root
    from benchmarks import micro

    assert micro.main(["--render", str(source), "--out", str(table_path)]) == 0
    table = table_path.read_text()
    assert "| add | a+b | 0.5000 | 3000 | 100% | 1.0000 | 2.00x | - | 5.00e-01 | **NO** |" in table
    assert "| host | tfuse.add | - | - | - | - | - | 0.100 | - | - |" in table
    assert "ERROR: RuntimeError: boom" in table
