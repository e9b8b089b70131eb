"""`python -m benchmarks` runs on this machine and writes its report (a smoke run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks" / "__main__.py").is_file(), reason="needs the source tree (benchmarks/ is not installed)"
)


def test_add_benchmark_quick_run_writes_table_and_plot(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TFUSE_BACKEND",)}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "add", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tables = list(tmp_path.glob("add-*.md"))
    plots = list(tmp_path.glob("add-*.png"))
    assert len(tables) == 1 and len(plots) == 1
    assert plots[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = tables[0].read_text()
    assert "torch " in table and "triton " in table  # versions in the header
    rows = _table_rows(table)
    main = [row for row in rows if row["pattern"] == "a + b + c"]
    assert main, table
    assert main[0]["launches"] == "1"  # one Triton launch (through the interpreter on a CPU)
    assert main[0]["eager ops"] == "2"
    assert main[0]["compile ms"] != "-"
    assert all(float(row["speed-up vs eager"].rstrip("x")) > 0 for row in rows)
    if "(CPU)" in table:
        assert "interpreter timings are not performance" in table


def _table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``markdown``, as header -> cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]
