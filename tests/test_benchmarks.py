"""`python -m benchmarks` runs on this machine and writes its reports (smoke runs)."""

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


def _run_quick(name: str, out: Path) -> list[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "TFUSE_BACKEND"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", name, "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tables = list(out.glob(f"{name}-*.md"))
    plots = list(out.glob(f"{name}-*.png"))
    assert len(tables) == 1 and len(plots) == 1
    assert plots[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = tables[0].read_text()
    assert "torch " in table and "triton " in table  # versions in the header
    if "(CPU)" in table:
        assert "CPU run:" in table  # the report says what a CPU timing does and does not show
    return _table_rows(table)


def _table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``markdown``, as header -> cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def test_add_benchmark(tmp_path):
    rows = _run_quick("add", tmp_path)
    main = [row for row in rows if row["pattern"] == "a + b + c"]
    assert main, rows
    assert main[0]["launches"] == "1"  # one Triton launch (through the interpreter on a CPU)
    assert main[0]["eager ops"] == "2"
    assert main[0]["compile ms"] != "-"
    assert all(float(row["speed-up vs eager"].rstrip("x")) > 0 for row in rows)


def test_add_act_benchmark(tmp_path):
    rows = _run_quick("add_act", tmp_path)
    assert {row["act"] for row in rows} == {"relu", "gelu"}
    training = [row for row in rows if row["passes"] == "forward+backward"]
    assert training and all(row["launches"] == "1 + 2" for row in training)
    gelu = [row for row in training if row["act"] == "gelu"]
    # eager gelu(x + b) keeps x + b for backward; tfuse keeps nothing extra.
    assert all(float(row["tfuse saved MB"]) == 0 < float(row["eager saved MB"]) for row in gelu)
    assert all(row["compile ms"] != "-" for row in rows)


def test_linear_benchmark(tmp_path):
    rows = _run_quick("linear", tmp_path)
    assert {(row["act"], row["passes"]) for row in rows} == {
        (act, passes) for act in ("relu", "gelu") for passes in ("forward", "forward+backward")
    }
    assert all(float(row["vs Linear + act"].rstrip("x")) > 0 for row in rows)


def test_bn_act_benchmark(tmp_path):
    rows = _run_quick("bn_act", tmp_path)
    assert {row["mode"] for row in rows} == {"eval forward", "train forward", "train forward+backward"}
    assert {row["residual"] for row in rows} == {"yes", "no"}
    assert all(float(row["vs eager"].rstrip("x")) > 0 and row["compile ms"] != "-" for row in rows)
    table = next(tmp_path.glob("bn_act-*.md")).read_text()
    if "(CPU)" in table:
        assert "train forward 3, train backward 3, eval forward 1" in table


def test_optim_benchmark(tmp_path):
    rows = _run_quick("optim", tmp_path)
    assert {row["optimizer"] for row in rows} == {"Adam", "SGD momentum"}
    assert all(row[key] != "-" for row in rows for key in ("loop ops", "foreach ops", "fused ops"))
    assert all(float(row["vs fused=True"].rstrip("x")) > 0 for row in rows)
    table = next(tmp_path.glob("optim-*.md")).read_text()
    if "(CPU)" in table:
        assert all(row["launches"] == "-" for row in rows)  # the PyTorch path launches no Triton kernel
    else:
        assert all(row["launches"] == "1" for row in rows)  # one flat buffer, one launch


def test_allreduce_benchmark(tmp_path):
    rows = _run_quick("allreduce", tmp_path)
    by_config = {row["configuration"]: row for row in rows}
    assert by_config["per-tensor all-reduce after backward"]["all-reduce calls"] == "5"  # tiny shapes: 5 tensors
    assert by_config["backward only (no sync)"]["all-reduce calls"] == "0"
    tfuse_rows = [row for name, row in by_config.items() if name.startswith("tfuse bucket_mb=")]
    assert len(tfuse_rows) == 7  # the bucket_mb sweep (5) and the CNN steps (2)
    assert by_config["tfuse max_params_per_bucket=1"]["all-reduce calls"] == "5"  # the count cap splits every tensor
    assert "torch DDP bucket_cap_mb=25" in by_config
    assert all(float(row["step ms"]) > 0 for row in rows)
