"""The benchmark harness and `python -m benchmarks`.

Nothing here depends on how loaded the machine is: the smoke run checks
structure, launch counts, byte counts, saved memory and that every row has
its check; the timing statistics and the flagging of noisy and implausible
numbers are tested on injected numbers.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_command

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks" / "__main__.py").is_file(), reason="needs the source tree (benchmarks/ is not installed)"
)

if (ROOT / "benchmarks" / "__main__.py").is_file() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ lives at the repository root

ALL = ["add", "add_act", "linear", "bn_act", "depthwise", "bn_depthwise", "group_norm_act", "layer_norm_act", "optim",
       "allreduce", "sharded", "overlap", "localsgd", "compile", "e2e", "host"]
TIME_CELL = re.compile(r"^\d+\.\d+ ±\d+%( \((noisy|implausible)\))?$")
CHECK_CELL = re.compile(r"^(ok|((noisy|implausible): .+))$")


def _harness():
    from benchmarks import harness

    return harness


def _timing(*samples: float):
    return _harness().Timing(tuple(samples))


def _context(copy_gbps: float = 20.0, device: str = "cpu", stall_reference_gbps: float | None = 30.0):
    h = _harness()
    machine = h.Machine(device=torch.device(device), name="test machine", slug="test", torch_version="2.x",
                        triton_version="3.x", python_version="3.x", date="2026-01-01", interpreted=False, load=0.0,
                        threads=2)
    return h.Context(machine=machine, copy_gbps=copy_gbps, quick=True, use_compile=False,
                     stall_reference_gbps=stall_reference_gbps)


# --- timing statistics and interleaving ----------------------------------------


def test_timing_median_quartiles_and_spread():
    timing = _timing(1.0, 2.0, 3.0, 4.0, 100.0)
    assert timing.median == 3.0
    assert timing.quartiles == (2.0, 4.0)
    assert timing.lo == 1.0 and timing.hi == 100.0
    assert timing.rel_iqr == pytest.approx(2.0 / 3.0)  # the outlier moves neither the median nor the IQR
    assert _timing(5.0).quartiles == (5.0, 5.0)
    with pytest.raises(ValueError):
        _harness().Timing(())


def test_cpu_timing_interleaves_providers_in_balanced_rounds():
    h = _harness()
    calls: list[str] = []

    def recorder(name):
        return lambda: calls.append(name)

    timings = h.time_interleaved({name: recorder(name) for name in "abc"}, torch.device("cpu"), quick=True)

    def collapse(names):  # one entry per run of calls of one provider (a batch, or batches back to back)
        return [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]

    rounds = len(next(iter(timings.values())).samples)
    low, high = h._CPU_ROUNDS[True]
    assert low <= rounds <= high
    assert all(len(t.samples) == rounds and t.median > 0 for t in timings.values())
    # Warm-up in the given order, then every round times each provider once, in the balanced design's order.
    expected = list("abc") + [name for index in range(rounds) for name in h._rotated(list("abc"), index)]
    assert collapse(calls) == collapse(expected)
    for index in range(rounds):
        assert sorted(h._rotated(list("abc"), index)) == ["a", "b", "c"]


def test_gpu_timing_pools_do_bench_runs_over_interleaved_rounds(monkeypatch):
    h = _harness()
    order: list[str] = []

    def fake_do_bench(fn, warmup, rep, return_mode="mean", quantiles=None):
        fn()
        assert return_mode == "all"
        return [1.0, 2.0, 3.0]

    monkeypatch.setattr(h.triton.testing, "do_bench", fake_do_bench)
    timings = h.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                 torch.device("cuda"), quick=False)
    rounds = h._GPU_ROUNDS[False]
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"][:2 * rounds]
    assert timings["a"].samples == (1.0, 2.0, 3.0) * rounds and timings["a"].median == 2.0


def test_gpu_timing_falls_back_to_quantiles_without_return_mode_all(monkeypatch):
    h = _harness()

    def old_do_bench(fn, warmup, rep, return_mode="mean", quantiles=None):
        if quantiles is not None:
            return [0.5 + q for q in quantiles]
        assert return_mode in ["min", "max", "mean", "median"]
        return 1.0

    monkeypatch.setattr(h.triton.testing, "do_bench", old_do_bench)
    timing = h.time_interleaved({"a": lambda: None}, torch.device("cuda"), quick=True)["a"]
    assert timing.median == pytest.approx(1.0) and len(timing.samples) == 5 * h._GPU_ROUNDS[True]


# --- flagging, on injected numbers ----------------------------------------------


def test_a_wide_spread_is_noisy_and_a_tight_one_is_not():
    h = _harness()
    assert h.check_timing("tfuse", _timing(1.0, 1.02, 0.99, 1.01, 1.0)) is None
    flag = h.check_timing("eager", _timing(1.0, 1.0, 3.0, 3.0, 5.0))
    assert flag.kind == "noisy" and "eager" in flag.reason and "IQR" in flag.reason


def test_more_than_a_copy_allows_is_implausible():
    h = _harness()
    # 469% of a 28 GB/s copy (the CPU table of issue 12): 16 MB in 0.122 ms = 131 GB/s.
    flag = h.check_timing("tfuse", _timing(0.122, 0.121, 0.123), nbytes=16_000_000, reference_gbps=28.0,
                          slack=h.COPY_SLACK["cpu"])
    assert flag.kind == "implausible" and "GB/s" in flag.reason
    # 1.9x the copy is allowed on a CPU (a copy moves 1.5x its counted bytes there), not on a GPU.
    nearly = _timing(0.3, 0.3, 0.3)  # 16 MB in 0.3 ms = 53.3 GB/s, 1.9x of 28
    assert h.check_timing("tfuse", nearly, nbytes=16_000_000, reference_gbps=28.0, slack=h.COPY_SLACK["cpu"]) is None
    assert h.check_timing("tfuse", nearly, nbytes=16_000_000, reference_gbps=28.0,
                          slack=h.COPY_SLACK["cuda"]).kind == "implausible"


def test_a_time_at_or_below_zero_is_implausible():
    h = _harness()
    assert h.check_timing("tfuse", _timing(0.0, 1.0, 1.0)).kind == "implausible"
    assert h.check_timing("tfuse", _timing(-0.5, 1.0, 1.0)).kind == "implausible"


def test_a_speedup_beyond_the_bound_is_implausible():
    h = _harness()
    assert h.check_ratio("vs_eager", 361.96, bound=4.0).kind == "implausible"
    assert h.check_ratio("vs_eager", 2.36, bound=4.0) is None
    assert h.check_ratio("vs_compile", 302.44, bound=None) is None  # no bound: only the inputs' flags count
    assert h.check_ratio("vs_eager", -1.0, bound=None).kind == "implausible"


def test_a_negative_difference_is_implausible_beyond_the_spread_and_noise_within_it():
    h = _harness()
    backward = _timing(50.0, 51.0, 52.0, 53.0, 54.0)  # IQR 2 ms
    value, flag = h.difference(_timing(20.0, 21.0, 22.0, 23.0, 24.0), backward, "sync")  # sync ms -30.0
    assert value == pytest.approx(-30.0) and flag.kind == "implausible"
    value, flag = h.difference(_timing(51.0, 52.0, 53.0, 54.0, 55.0), backward, "sync")
    assert value == pytest.approx(1.0) and flag.kind == "noisy"
    value, flag = h.difference(_timing(150.0, 151.0, 152.0, 153.0, 154.0), backward, "sync")
    assert value == pytest.approx(100.0) and flag is None


def test_a_stalled_canary_is_implausible():
    h = _harness()
    # Times quantised to the scheduler tick: a 4 MiB copy taking 7.99 ms runs at 0.5 GB/s.
    stalled = _timing(7.99, 7.99, 8.0, 7.98, 7.99)
    flag = h.check_stall(stalled, reference_gbps=25.0)
    assert flag.kind == "implausible" and flag.reason.startswith("stalled")
    assert h.check_stall(_timing(0.3, 0.31, 0.3), reference_gbps=25.0) is None  # 14 GB/s: within 4x
    assert h.check_stall(stalled, reference_gbps=None) is None  # no reference (GPU runs): no check


def _finished_row(timings, **kwargs):
    h = _harness()
    row = {"name": "row"}
    h.finish_row(row, timings, kwargs.pop("ctx", _context()), **kwargs)
    return row


def test_finish_row_flags_every_number_derived_from_a_flagged_time():
    nbytes = 16_000_000
    good = _timing(1.0, 1.01, 0.99, 1.0, 1.0)  # 16 GB/s
    fast = _timing(0.05, 0.05, 0.05)  # 320 GB/s: beyond any copy here
    copy = _timing(0.8, 0.8, 0.81)  # 20 GB/s
    row = _finished_row({"tfuse": fast, "eager": good, "copy": copy, "canary": _timing(0.2, 0.2, 0.2)},
                        nbytes=nbytes, copy_nbytes=nbytes, ratios={"vs_eager": "eager"}, ratio_bounds={"vs_eager": 4.0})
    assert row["vs_eager"] == pytest.approx(20.0)
    assert {key for key, flag in row["flags"].items() if flag.kind == "implausible"} == {
        "tfuse_ms", "tfuse_gbps", "pct_copy", "vs_eager"}
    assert "eager_ms" not in row["flags"] and "copy_gbps" not in row["flags"]
    assert row["eager_gbps"] == pytest.approx(16.0) and row["pct_copy"] == pytest.approx(1600.0)
    assert row["eager_ms_range"] == (1.0, 1.0)


def test_finish_row_marks_a_whole_row_timed_during_a_stall():
    stalled = _timing(7.99, 7.99, 8.0)  # all providers quantised alike: ratios look like 1.00x
    row = _finished_row({"tfuse": stalled, "eager": stalled, "canary": stalled}, nbytes=1_000_000,
                        ratios={"vs_eager": "eager"})
    assert row["vs_eager"] == pytest.approx(1.0)
    assert {flag.kind for flag in row["flags"].values()} == {"implausible"}
    assert {"tfuse_ms", "eager_ms", "tfuse_gbps", "vs_eager"} <= set(row["flags"])


def test_finish_row_on_a_gpu_uses_the_device_copy_bandwidth():
    ctx = _context(copy_gbps=3000.0, device="cuda", stall_reference_gbps=None)
    # 16 MB in 0.0011 ms is 14,545 GB/s, 485% of the copy: implausible; in 0.0064 ms, 2500 GB/s: fine.
    row = _finished_row({"tfuse": _timing(0.0011, 0.0011), "eager": _timing(0.0064, 0.0064)}, ctx=ctx,
                        nbytes=16_000_000, ratios={"vs_eager": "eager"})
    assert row["flags"]["tfuse_ms"].kind == "implausible" and "eager_ms" not in row["flags"]
    assert row["pct_copy"] == pytest.approx(100 * 16_000_000 / 0.0011 / 1e6 / 3000.0)


def _allreduce_rows(backward: list[float], per_tensor: list[float], canary: list[float]) -> list[dict]:
    ddp = [150.0, 151.0, 152.0, 153.0, 154.0]
    cnn = [30.0, 30.5, 31.0, 31.5, 32.0]
    rows = [("backward only (no sync)", "resnet50-sync", 0, backward),
            ("per-tensor all-reduce after backward", "resnet50-sync", 161, per_tensor),
            ("torch DDP bucket_cap_mb=25", "resnet50-sync", 4, ddp),
            ("local step (no sync), torch SGD", "cnn-step", 0, cnn),
            ("torch DDP bucket_cap_mb=25, torch SGD", "cnn-step", 1, cnn),
            ("copy canary", "canary", None, canary)]
    return [dict(label=label, panel=panel, calls=calls, samples=list(samples), x=None, sweep="")
            for label, panel, calls, samples in rows]


def test_allreduce_sync_time_is_flagged_by_its_own_spread_and_sign():
    from benchmarks import allreduce

    healthy_canary = [0.2] * 5  # 4 MiB in 0.2 ms: 21 GB/s
    # A noisy baseline does not make a clear 150 ms difference noise; a -30 ms one is implausible.
    rows = _allreduce_rows([30.0, 40.0, 55.0, 70.0, 80.0], [200.0, 201.0, 205.0, 209.0, 210.0], healthy_canary)
    allreduce._finish(rows, stall_reference_gbps=25.0)
    by_label = {row["label"]: row for row in rows}
    assert "copy canary" not in by_label
    assert by_label["backward only (no sync)"]["flags"]["ms"].kind == "noisy"
    per_tensor = by_label["per-tensor all-reduce after backward"]
    assert per_tensor["sync_ms"] == pytest.approx(150.0) and "sync_ms" not in per_tensor["flags"]
    rows = _allreduce_rows([50.0, 51.0, 52.0, 53.0, 54.0], [20.0, 21.0, 22.0, 23.0, 24.0], healthy_canary)
    allreduce._finish(rows, stall_reference_gbps=25.0)
    per_tensor = next(row for row in rows if row["label"] == "per-tensor all-reduce after backward")
    assert per_tensor["sync_ms"] == pytest.approx(-30.0) and per_tensor["flags"]["sync_ms"].kind == "implausible"
    # A stalled canary marks every row.
    rows = _allreduce_rows([50.0, 51.0, 52.0, 53.0, 54.0], [200.0, 201.0, 205.0, 209.0, 210.0], [7.99] * 5)
    allreduce._finish(rows, stall_reference_gbps=25.0)
    assert all(row["flags"]["ms"].reason.startswith("stalled") for row in rows)


def _overlap_result(canary: list[float]) -> dict:
    """What rank 0 of the overlap benchmark writes, with injected step times (ms)."""
    from benchmarks import overlap

    times = {overlap.DDP: [100.0, 101.0, 102.0, 103.0, 104.0], overlap.PLAIN: [90.0, 91.0, 92.0, 93.0, 94.0],
             overlap.OVERLAP: [60.0, 61.0, 80.0, 101.0, 160.0], overlap.CANARY: canary}
    rows = [dict(workload=workload, label=label, samples=list(samples), launches=None if label == overlap.CANARY else 0,
                 calls=None if label == overlap.CANARY else 5, ahead=5 if label == overlap.OVERLAP else None)
            for workload in (overlap.RESNET, overlap.CNN) for label, samples in times.items()]
    info = dict(tensors=161, numel=25_557_032, source="hard-coded", bucket_mb=25.0, batch=16, side=32,
                optimizer="FusedMomentum: 0 Triton launches per step")
    return {"rows": rows, "rounds": 5, "iterations": 1, "workloads": {overlap.RESNET: info, overlap.CNN: info},
            "checks": ["ResNet-50 gradient set: bit-identical", "small CNN: bit-identical"]}


def test_overlap_table_on_injected_times():
    """Ratios to DDP per workload, the canary row dropped, a stall marking its workload's rows; no ranks started."""
    from benchmarks import overlap

    shapes, _ = overlap.resnet50_shapes()  # (it checks 161 tensors, 25,557,032 elements itself)
    assert len(overlap.narrowed(shapes, overlap.QUICK_NARROWING)) == 161
    table = overlap.report(_overlap_result([0.2] * 5), "gloo", _context()).markdown(_context().machine)
    rows = _table_rows(table)
    assert [row["setup"] for row in rows] == [overlap.DDP, overlap.PLAIN, overlap.OVERLAP] * 2
    assert [row["vs DDP"] for row in rows[:3]] == ["1.00x", "0.90x", "0.78x (noisy)"]  # 80/102; IQR 40 of 80 ms
    assert rows[2]["min–max ms"] == "60.0–160.0" and rows[2]["stepped ahead"] == "5 of 5"
    assert rows[0]["stepped ahead"] == "-" and rows[0]["check"] == "ok"
    assert "bit-identical" in table and "CPU run:" in table
    stalled = overlap.report(_overlap_result([7.99] * 5), "gloo", _context()).markdown(_context().machine)
    assert all(row["check"].startswith("implausible: stalled") for row in _table_rows(stalled))


def test_the_table_marks_flagged_numbers_and_says_why():
    h = _harness()
    ok = _finished_row({"tfuse": _timing(1.0, 1.0, 1.0), "eager": _timing(2.0, 2.0, 2.0)}, nbytes=1000,
                       ratios={"vs_eager": "eager"})
    noisy = _finished_row({"tfuse": _timing(1.0, 2.0, 3.0, 4.0, 5.0), "eager": _timing(2.0, 2.0, 2.0)}, nbytes=1000,
                          ratios={"vs_eager": "eager"})
    bad = _finished_row({"tfuse": _timing(1.0, 1.0), "eager": _timing(400.0, 400.0)}, nbytes=1000,
                        ratios={"vs_eager": "eager"}, ratio_bounds={"vs_eager": 4.0})
    for row, name in ((ok, "ok"), (noisy, "noisy"), (bad, "bad")):
        row["name"] = name
    report = h.Report(name="t", title="T", notes=[], rows=[ok, noisy, bad], columns=[
        h.Column("name", "name"), h.Column("tfuse_ms", "tfuse ms", "{:.3f}", spread=True),
        h.Column("vs_eager", "vs eager", "{:.2f}x"), h.CHECK_COLUMN])
    table = report.markdown(_context().machine)
    assert "| ok | 1.000 ±0% | 2.00x | ok |" in table
    assert "| noisy | 3.000 ±33% (noisy) | 0.67x (noisy) | noisy: tfuse: spread (IQR) 67% of the median |" in table
    assert "| bad | 1.000 ±0% | 400.00x (implausible) | implausible: vs_eager: 400.00x, more than the 4.00x" in table
    assert "2 of 3 rows have marked numbers (1 with implausible ones, 1 with noisy ones only)" in table
    assert "Timing: the columns of a row are timed interleaved" in table


def test_plots_wrap_panels_into_a_grid_with_error_bars(tmp_path):
    pytest.importorskip("matplotlib")
    h = _harness()
    assert h.panel_grid(8) == (3, 3) and h.panel_grid(2) == (1, 2) and h.panel_grid(1) == (1, 1)
    rows = []
    for panel in range(8):
        for x in (10, 100, 1000):
            row = _finished_row({"tfuse": _timing(1.0, 1.1, 1.2)}, nbytes=1000)
            rows.append(dict(row, series=f"panel {panel}", numel=x))
    rows[0]["flags"]["tfuse_gbps"] = h.Flag("implausible", "test")
    report = h.Report(name="t", title="T", notes=[], columns=[h.Column("series", "series")], rows=rows,
                      plot_lines=[("tfuse_gbps", "tfuse")])
    fig = report.plot(_context().machine, tmp_path / "t.png")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 9 and len(visible) == 8
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = visible[0].get_legend_handles_labels()[1]
    assert "tfuse" in labels and "tfuse: implausible, not a result" in labels


def test_depthwise_class_verdicts_on_injected_rows():
    """The GPU run's per-shape-class verdict: a class goes to EAGER_SHAPE_CLASSES only when the Triton kernels
    lost to eager in every row of it, with no marked number."""
    from benchmarks import depthwise

    h = _harness()

    def row(key, ratio, flag=None, path="triton"):
        flags = {"triton_vs_eager": h.Flag("noisy", "test")} if flag else {}
        return dict(passes="forward+backward", shape_class=key, path=path, layer=f"layer {ratio}",
                    triton_vs_eager=ratio, flags=flags)

    slow, mixed, fast, noisy = (((3, 3), (s, s), True, torch.bfloat16, 4096) for s in (1, 2, 3, 4))
    rows = [row(slow, 0.8), row(slow, 0.9), row(mixed, 0.9), row(mixed, 1.2), row(fast, 1.5), row(noisy, 0.5, True),
            dict(row(slow, 0.1), passes="forward")]
    verdicts = {key: (path, verdict) for key, path, verdict in depthwise.class_verdicts(rows)}
    assert verdicts[slow][1].endswith("belongs in EAGER_SHAPE_CLASSES") and "0.80x" in verdicts[slow][1]
    assert "0.10x" not in verdicts[slow][1]  # forward-only rows do not decide
    assert verdicts[mixed][1].startswith("mixed") and verdicts[fast][1].startswith("Triton faster")
    assert verdicts[noisy][1].startswith("not decided") and verdicts[slow][0] == "triton"


@pytest.mark.parametrize("n", range(2, 8))
def test_interleaved_rounds_balance_who_runs_after_whom(n):
    """Over a cycle of rounds every provider follows every other one equally often (and starts as often): on a
    CPU, the provider after the copy reference runs with cold caches, which a fixed rotation pinned on one column."""
    from collections import Counter

    from benchmarks.harness import _rotated

    names = [f"p{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    pairs, starts = Counter(), Counter()
    for round_index in range(cycle):
        order = _rotated(names, round_index)
        assert sorted(order) == names
        starts[order[0]] += 1
        pairs.update(zip(order, order[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert len(starts) == n and len(set(starts.values())) == 1


def test_norm_act_class_verdicts_on_injected_rows(monkeypatch):
    """The same rule for group/layer norm + activation's dispatch table (tfuse.ops.norm_act.EAGER_SHAPE_CLASSES)."""
    from benchmarks import norm_act

    h = _harness()

    def row(key, ratio, flag=None):
        flags = {"vs_eager": h.Flag("noisy", "test")} if flag else {}
        return dict(passes="forward+backward", shape_class=key, net="net", shape=f"{ratio}", vs_eager=ratio,
                    flags=flags)

    slow, mixed, fast, noisy = (("group_norm_act", False, torch.bfloat16, 4 ** s) for s in (5, 6, 7, 8))
    rows = [row(slow, 0.8), row(slow, 0.9), row(mixed, 0.9), row(mixed, 1.2), row(fast, 1.5), row(noisy, 0.5, True),
            dict(row(slow, 0.1), passes="forward")]
    verdicts = dict(norm_act.class_verdicts(rows))
    assert verdicts[slow].endswith("belongs in EAGER_SHAPE_CLASSES") and "0.80x" in verdicts[slow]
    assert "0.10x" not in verdicts[slow]  # forward-only rows do not decide
    assert verdicts[mixed].startswith("mixed") and verdicts[fast].startswith("faster")
    assert verdicts[noisy].startswith("not decided")
    monkeypatch.setattr(norm_act.norm_act_ops, "EAGER_SHAPE_CLASSES", frozenset({slow, fast}))
    verdicts = dict(norm_act.class_verdicts(rows))
    assert verdicts[slow].endswith("as it should be") and verdicts[fast].endswith("should come out of it")


def test_a_plain_run_does_not_write_over_the_committed_tables():
    from benchmarks.__main__ import _parse, default_out_dir
    from benchmarks.harness import RESULTS_DIR

    assert _parse([]).out is None
    assert RESULTS_DIR.resolve() not in (default_out_dir().resolve(), *default_out_dir().resolve().parents)
    assert _parse(["--out", "benchmarks/results"]).out == Path("benchmarks/results")


# --- smoke run: every benchmark, --quick, one process ----------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """All benchmarks, --quick, in one process (a start-up of torch and triton, not six)."""
    out = tmp_path_factory.mktemp("benchmarks")
    env = {k: v for k, v in os.environ.items() if k != "TFUSE_BACKEND"}
    command = [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)]
    for name in ALL:
        command += ["--only", name]
    result = run_command(command, cwd=ROOT, env=env, timeout=900)
    return out, result


def _table(quick_run, name: str) -> tuple[str, list[dict[str, str]]]:
    out, result = quick_run
    assert result.returncode == 0, result.stderr[-4000:]
    tables = list(out.glob(f"{name}-*.md"))
    plots = list(out.glob(f"{name}-*.png"))
    assert len(tables) == 1 and len(plots) == 1
    assert plots[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = tables[0].read_text()
    assert "torch " in table and "triton " in table  # versions in the header
    if "(CPU)" in table:
        assert "CPU run:" in table  # the report says what a CPU timing does and does not show
    assert "- Timing:" in table and "- Checks:" in table
    rows = _table_rows(table)
    assert rows and all(CHECK_CELL.match(row["check"]) for row in rows), [row["check"] for row in rows]
    assert f"[{name} " in result.stderr  # progress
    _assert_csv_has_the_tables_rows(tables[0].with_suffix(".csv"), rows)
    return table, rows


def _assert_csv_has_the_tables_rows(path: Path, rows: list[dict[str, str]]) -> None:
    """Beside each table, its rows as numbers (one line per configuration): every time shown in the table is the
    CSV's median, with its quartiles around it, and the check column is the table's."""
    with path.open(newline="") as handle:
        numbers = list(csv.DictReader(handle))
    assert len(numbers) == len(rows) and numbers
    timed = [key[: -len("_q1")] for key in numbers[0] if key.endswith("_q1")]  # (e2e's times are min-max)
    for table_row, line in zip(rows, numbers):
        assert line["check"] == table_row["check"]
        for key in timed:
            if line[key] and line[f"{key}_q1"]:  # (a provider a configuration does not time: empty, "-" in the table)
                assert float(line[f"{key}_q1"]) <= float(line[key]) <= float(line[f"{key}_q3"]), (key, line)


def _table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``markdown``, as header -> cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def _time_cells(rows: list[dict[str, str]], *headers: str) -> None:
    for row in rows:
        for header in headers:
            assert TIME_CELL.match(row[header]), (header, row[header])


def test_add_benchmark(quick_run):
    _, rows = _table(quick_run, "add")
    main = [row for row in rows if row["pattern"] == "a + b + c"]
    assert main, rows
    assert main[0]["launches"] == "1"  # one Triton launch (through the interpreter on a CPU)
    assert main[0]["eager ops"] == "2"
    assert main[0]["elements"] == "20,000" and main[0]["MB moved"] == "0.32"  # 3 inputs + 1 output, float32
    assert {row["pattern"] for row in rows if row["eager ops"] == "7"} == {"8 inputs"}
    _time_cells(rows, next(h for h in rows[0] if h.endswith(" ms") and h.startswith("tfuse")), "eager ms", "compile ms")


def test_add_act_benchmark(quick_run):
    _, rows = _table(quick_run, "add_act")
    assert {row["act"] for row in rows} == {"relu", "gelu"}
    training = [row for row in rows if row["passes"] == "forward+backward"]
    assert training and all(row["launches"] == "1 + 2" for row in training)
    gelu = [row for row in training if row["act"] == "gelu"]
    # eager gelu(x + b) keeps x + b for backward; tfuse keeps nothing extra.
    assert all(float(row["tfuse saved MB"]) == 0 < float(row["eager saved MB"]) for row in gelu)
    _time_cells(rows, "eager ms", "compile ms")


def test_linear_benchmark(quick_run):
    _, rows = _table(quick_run, "linear")
    assert {(row["act"], row["passes"]) for row in rows} == {
        (act, passes) for act in ("relu", "gelu") for passes in ("forward", "forward+backward")
    }
    assert {row["saved MB"] for row in rows if row["act"] == "relu" and row["passes"] == "forward+backward"} == {"0.00"}
    _time_cells(rows, "Linear + act ms", "compile ms")


def test_bn_act_benchmark(quick_run):
    table, rows = _table(quick_run, "bn_act")
    assert {row["mode"] for row in rows} == {"eval forward", "train forward", "train forward+backward"}
    assert {row["residual"] for row in rows} == {"yes", "no"}
    _time_cells(rows, "eager ms", "compile ms")
    if "(CPU)" in table:
        assert "train forward 2, train backward 2, eval forward 1" in table  # the merges ride on the reductions


def test_bn_depthwise_benchmark(quick_run):
    table, rows = _table(quick_run, "bn_depthwise")
    assert {(row["act"], row["layout"], row["passes"]) for row in rows} == {
        ("relu6", "channels_last", passes) for passes in ("forward", "forward+backward")}
    # Training forward: statistics + the normalising convolution; backward: dw, dz, batch norm's reduce and dx.
    assert {row["passes"]: row["launches"] for row in rows} == {"forward": "2", "forward+backward": "2 + 4"}
    # Minimum bytes, float32: forward (2X + K + Y) 4, with backward (5X + 3Y + 3K) 4 (stride 1: Y = X).
    x, k = 2 * 16 * 14 * 14, 16 * 9
    moved = {row["passes"]: row["MB moved"] for row in rows}
    assert moved == {"forward": f"{(3 * x + k) * 4 / 1e6:.2f}", "forward+backward": f"{(8 * x + 3 * k) * 4 / 1e6:.2f}"}
    (training,) = [row for row in rows if row["passes"] == "forward+backward"]
    kept = {key: float(training[f"{key} MB"]) for key in ("x", "tfuse kept", "eager kept")}
    # The fused block keeps x (and per-channel statistics); eager keeps x, the batch norm output and the activation.
    assert kept["x"] == pytest.approx(x * 4 / 1e6, rel=1e-3)
    assert kept["x"] <= kept["tfuse kept"] < 1.05 * kept["x"]
    assert kept["eager kept"] == pytest.approx(3 * kept["x"], rel=0.05)
    _time_cells(rows, "tfuse (PyTorch path) ms" if "(CPU)" in table else "tfuse ms", "eager ms", "compile ms")



def _norm_act_kept(rows: list[dict[str, str]], x_elements: int) -> None:
    """tfuse keeps x (and per-row statistics); eager keeps x and the activation's input (SiLU, GELU): twice x."""
    for training in (row for row in rows if row["passes"] == "forward+backward"):
        kept = {key: float(training[f"{key} MB"]) for key in ("x", "tfuse kept", "eager kept")}
        assert kept["x"] == pytest.approx(x_elements * 4 / 1e6, rel=1e-3)
        assert kept["x"] <= kept["tfuse kept"] < 1.05 * kept["x"]
        assert kept["eager kept"] == pytest.approx(2 * kept["x"], rel=0.05)


def test_group_norm_act_benchmark(quick_run):
    table, rows = _table(quick_run, "group_norm_act")
    assert {(row["act"], row["layout"], row["passes"]) for row in rows} == {
        ("silu", layout, passes) for layout in ("channels_last", "NCHW") for passes in ("forward", "forward+backward")}
    launches = {row["passes"]: row["launches"] for row in rows}
    if "(CPU)" in table:  # the interpreter's 64 rows of 2560: one tile each, no split; 2 + 2 on a GPU when split
        assert launches == {"forward": "1", "forward+backward": "1 + 1"}
        # Minimum bytes, float32, x of 2x320x4x4 and 2 x 320 parameters: forward (2X + P) 4, with backward (5X + 3P) 4.
        x, p = 2 * 320 * 4 * 4, 2 * 320
        moved = {row["passes"]: row["MB moved"] for row in rows}
        assert moved == {"forward": f"{(2 * x + p) * 4 / 1e6:.2f}",
                         "forward+backward": f"{(5 * x + 3 * p) * 4 / 1e6:.2f}"}
        _norm_act_kept(rows, x)
        assert "tfuse's PyTorch path" in table
    else:
        assert set(launches.values()) <= {"1", "2", "1 + 1", "2 + 2"}
    _time_cells(rows, "tfuse (PyTorch path) ms" if "(CPU)" in table else "tfuse ms", "eager ms", "compile ms")


def test_layer_norm_act_benchmark(quick_run):
    table, rows = _table(quick_run, "layer_norm_act")
    assert {(row["act"], row["passes"]) for row in rows} >= {("gelu", "forward"), ("gelu", "forward+backward")}
    # Rows of 96 or 768 fit one tile: one launch forward, one backward (the d(weight) partials' sums are torch's).
    assert {row["passes"]: row["launches"] for row in rows} == {"forward": "1", "forward+backward": "1 + 1"}
    if "(CPU)" in table:  # x of 2x4x4x768 over 768
        x, p = 2 * 4 * 4 * 768, 2 * 768
        moved = {row["passes"]: row["MB moved"] for row in rows}
        assert moved == {"forward": f"{(2 * x + p) * 4 / 1e6:.2f}",
                         "forward+backward": f"{(5 * x + 3 * p) * 4 / 1e6:.2f}"}
        _norm_act_kept(rows, x)
    _time_cells(rows, "tfuse (PyTorch path) ms" if "(CPU)" in table else "tfuse ms", "eager ms", "compile ms")

def test_depthwise_benchmark(quick_run):
    table, rows = _table(quick_run, "depthwise")
    assert {(row["act"], row["layout"], row["passes"]) for row in rows} == {
        (act, layout, passes) for act, layout in (("relu", "NCHW"), ("silu", "channels_last"))
        for passes in ("forward", "forward+backward")}
    # One launch forward; backward: dx, then dw in one launch whose last programs merge (no bias).
    assert {row["passes"]: row["launches"] for row in rows} == {"forward": "1", "forward+backward": "1 + 2"}
    # Minimum bytes, float32: forward (X + K + Y) 4, with backward (3X + 2Y + 3K) 4.
    x, k = 2 * 16 * 14 * 14, 16 * 9
    relu_forward = next(row for row in rows if row["act"] == "relu" and row["passes"] == "forward")
    assert relu_forward["MB moved"] == f"{(2 * x + k) * 4 / 1e6:.2f}"
    training = {row["act"]: row for row in rows if row["passes"] == "forward+backward"}
    kept = {act: {key: float(row[f"{key} MB"]) for key in ("x", "tfuse kept", "eager kept", "eager in-place kept")}
            for act, row in training.items()}
    # tfuse keeps x alone. Eager relu keeps its output (which the convolution keeps too): the same bytes;
    # silu keeps its input and the convolution its output, in place as well (autograd clones the input).
    assert kept["relu"]["x"] == pytest.approx(x * 4 / 1e6, rel=1e-3)
    relu, silu = kept["relu"], kept["silu"]
    assert relu["tfuse kept"] == relu["eager kept"] == relu["eager in-place kept"] == relu["x"]
    assert silu["tfuse kept"] == silu["x"]
    assert silu["eager kept"] == silu["eager in-place kept"] == pytest.approx(2 * silu["x"], rel=1e-3)
    _time_cells(rows, next(h for h in rows[0] if h.endswith(" ms") and h.startswith("tfuse")), "eager ms", "compile ms")
    if "(CPU)" in table:
        assert "tfuse's PyTorch path" in table and "1x8x10x10 input" in table


def test_optim_benchmark(quick_run):
    table, rows = _table(quick_run, "optim")
    assert {row["optimizer"] for row in rows} == {"Adam", "SGD momentum", "Adagrad", "Lion", "LAMB", "LARS",
                                                  "Muon + AdamW"}
    torch_less = ("Lion", "LAMB", "LARS")  # torch has none of these: their torch columns are empty
    # torch's Muon has one implementation (a loop) and refuses convolution weights (the tiny shapes have one).
    (muon,) = [row for row in rows if row["optimizer"] == "Muon + AdamW"]
    assert muon["tfuse ops"] != "-" and all(muon[key] == "-" for key in ("loop ops", "foreach ops", "fused ops"))
    rows = [row for row in rows if row is not muon]
    with_torch = [row for row in rows if row["optimizer"] not in torch_less]
    assert all(row[key] != "-" for row in with_torch for key in ("loop ops", "foreach ops", "fused ops"))
    assert all(row[key] == "-" for row in rows if row["optimizer"] in torch_less for key in ("loop ops", "fused=True ms"))
    _time_cells(with_torch, "for-loop ms", "foreach ms", "fused=True ms")
    _time_cells(rows, "tfuse (PyTorch path) ms" if "(CPU)" in table else "tfuse ms")
    if "(CPU)" in table:
        assert all(row["launches"] == "-" for row in rows)  # the PyTorch path launches no Triton kernel
    else:
        assert all(row["launches"] == ("3" if row["optimizer"] in ("LAMB", "LARS") else "1") for row in rows)


def test_allreduce_benchmark(quick_run):
    _, rows = _table(quick_run, "allreduce")
    by_config = {row["configuration"]: row for row in rows}
    assert by_config["per-tensor all-reduce after backward"]["all-reduce calls"] == "5"  # tiny shapes: 5 tensors
    assert by_config["backward only (no sync)"]["all-reduce calls"] == "0"
    tfuse_rows = [row for name, row in by_config.items() if name.startswith("tfuse bucket_mb=")]
    assert len(tfuse_rows) == 7  # the bucket_mb sweep (5) and the CNN steps (2)
    assert by_config["tfuse max_params_per_bucket=1"]["all-reduce calls"] == "5"  # the count cap splits every tensor
    assert "torch DDP bucket_cap_mb=25" in by_config and "copy canary" not in by_config
    _time_cells(rows, "step ms")


def test_sharded_benchmark(quick_run):
    _, rows = _table(quick_run, "sharded")
    assert [row["configuration"] for row in rows] == [
        "tfuse ShardedOptimizer(FusedAdam)", "tfuse FusedDataParallel + ShardedOptimizer(FusedAdam)",
        "tfuse FusedDataParallel + ShardedOptimizer(FusedAdam, reduce='all_reduce')",
        "tfuse FusedDataParallel + FusedAdam (unsharded)", "torch DDP + ZeroRedundancyOptimizer(Adam)"]
    by_config = {row["configuration"]: row for row in rows}
    assert by_config["tfuse FusedDataParallel + FusedAdam (unsharded)"]["state vs unsharded"] == "1.00x"
    # Two ranks: each keeps about half the Adam state (shards are aligned, so a little over half).
    for sharded in ("tfuse ShardedOptimizer(FusedAdam)", "tfuse FusedDataParallel + ShardedOptimizer(FusedAdam)"):
        assert float(by_config[sharded]["state vs unsharded"].rstrip("x")) <= 0.55
    _time_cells(rows, "step ms")


def test_overlap_benchmark(quick_run):
    """--quick: both workloads, three setups each; the overlap was checked bit for bit and engaged on every bucket."""
    table, rows = _table(quick_run, "overlap")
    setups = ["torch DDP + torch SGD(momentum=0.9, fused=True)", "tfuse FusedDataParallel + FusedMomentum",
              "tfuse FusedDataParallel + FusedMomentum, overlap_step"]
    assert [(row["workload"], row["setup"]) for row in rows] == [
        (workload, setup) for workload in ("ResNet-50 gradient set (--quick)", "small CNN") for setup in setups]
    for row in rows:
        if row["setup"] != setups[0]:
            assert int(row["all-reduce calls"]) >= 3  # several buckets
        if row["setup"] == setups[2]:
            calls = row["all-reduce calls"]
            assert re.fullmatch(rf"{calls} of {calls} \((\d+) in backward\)", row["stepped ahead"]), row
            assert int(re.search(r"\((\d+) in", row["stepped ahead"]).group(1)) <= int(calls)
    assert table.count("bit-identical after 3 steps") == 2
    if "(CPU)" in table:  # timed on tfuse's PyTorch path, not through the interpreter
        assert "Triton launches counted in one step of each setup: 0." in table
    _time_cells(rows, "step ms")


def test_localsgd_benchmark(quick_run):
    _, rows = _table(quick_run, "localsgd")
    assert [row["configuration"] for row in rows] == [
        "FusedDataParallel (every-step all-reduce)", "LocalSGD k=1", "LocalSGD k=4", "LocalSGD k=16"]
    by_config = {row["configuration"]: row for row in rows}
    # A sync sends the flat parameter buffer once: 1/k of what every-step synchronisation sends (gradient buckets
    # and parameters have the same padded size), within the rounding of the cell.
    assert by_config["LocalSGD k=1"]["bytes vs every step"] == "1.000x"
    assert by_config["LocalSGD k=4"]["bytes vs every step"] == "0.250x"
    assert by_config["LocalSGD k=16"]["bytes vs every step"] == "0.062x"
    for row in rows:
        assert 0.0 < float(row["final loss"]) < 10.0 and row["held-out accuracy"].endswith("%")
    _time_cells(rows, "comm ms/step", "step ms")



def test_compile_benchmark(quick_run):
    _, rows = _table(quick_run, "compile")
    # --quick: the MLP block only; on a CPU no CUDA-graph row.
    assert [(row["model"], row["variant"]) for row in rows] == [
        ("mlp", "eager torch"), ("mlp", "compiled torch"), ("mlp", "eager tfuse"), ("mlp", "compiled tfuse")]
    assert rows[0]["x faster than eager torch"] == "1.00" and rows[1]["x faster than compiled torch"] == "1.00"
    _time_cells(rows, "ms / step")


def test_e2e_benchmark(quick_run):
    """--quick: the first group (a tiny ResNet-50, NCHW) on the CPU: eager and tfuse's PyTorch path, same losses."""
    table, rows = _table(quick_run, "e2e")
    assert [(row["model"], row["variant"]) for row in rows] == [("resnet50", "eager"), ("resnet50", "tfuse")]
    # Each variant's first two losses agree with eager's (a mismatch takes the check cell; timing flags may not).
    assert not any("MISMATCH" in row["check"] for row in rows)
    assert rows[0]["x eager"].startswith("1.00") and "not the performance of tfuse's GPU path" in table
    for row in rows:  # (a flagged cell reads "12.34 (noisy)")
        assert float(row["wall ms/step"].split()[0]) > 0 and float(row["host ms/step"].split()[0]) > 0



# --- the host census ----------------------------------------------------------------

# Per model: Triton launches of one tfuse training step by kernel, and the aten copy_ ops. Gradients accumulate
# in place into the flat buffers (no copy per parameter); the one copy_ left in the CNNs is the backward of an
# as_strided view of the classifier's input (an activation gradient). A change that adds a launch or a copy per
# step fails here.
BN_KERNELS = ("_bn_stats_partial_kernel", "_bn_act_fwd_kernel", "_bn_act_bwd_reduce_kernel", "_bn_act_bwd_dx_kernel")
CLIP_KERNELS = {"_norm_partial_kernel": 1, "_norm_final_kernel": 1, "_clip_segments_kernel": 1}
CENSUS = {
    # 49 BatchNorm2d+ReLU(+residual) layers x 4 kernels (2 forward, 2 backward); clip 3; one SGD launch.
    "resnet50": ({**{k: 49 for k in BN_KERNELS}, **CLIP_KERNELS, "_sgd_kernel": 1}, 1),
    # 35 BatchNorm2d+ReLU6 layers (the 17 without an activation stay torch's): 16 of them before a depthwise
    # convolution are normalised on its load (statistics, the convolution; its dw and dz, then batch norm's reduce
    # and dx), 19 are BatchNorm2d+ReLU6 (4 kernels); clip 3; SGD 1. (The census model is MobileNetV2 at width
    # 0.25, where the first block has a residual: its stem's ReLU6 has two users, so 16 blocks, not 17.)
    "mobilenet_v2": (
        {"_bn_stats_partial_kernel": 35, "_bn_act_fwd_kernel": 19, "_bn_act_bwd_reduce_kernel": 35,
         "_bn_act_bwd_dx_kernel": 35, "_dw_fwd_kernel": 16, "_dw_bwd_dx_kernel": 16, "_dw_bwd_dw_partial_kernel": 16,
         **CLIP_KERNELS, "_sgd_kernel": 1},
        1,
    ),
    # Nothing of the GPT-2 stack is fused by fuse_model (LayerNorm, attention, tanh-GELU MLP): clip 3, AdamW 1.
    "gpt2": ({**CLIP_KERNELS, "_adam_kernel": 1}, 0),
}


def test_host_census_counts_every_launch_and_copy_of_a_step(quick_run):
    """``--only host --quick`` (in the smoke run): the table, and exact launch and copy counts per step."""
    out, result = quick_run
    assert result.returncode == 0, result.stderr[-4000:]
    table = next(out.glob("host-*.md")).read_text()
    assert "stubbed driver" in table and "- Timing:" in table
    assert "Launch micro-benchmark (host us per launch" in table and "_bn_act_fwd_kernel" in table
    rows = {(row["model"], row["mode"]): row for row in _table_rows(table)}
    assert len(rows) == 9
    for model, (kernels, copies) in CENSUS.items():
        eager = rows[(model, "eager")]
        assert (eager["Triton launches"], eager["of them copy_"]) == ("0", "0")
        for mode in ("tfuse (Triton launch path)", "tfuse (launches as no-ops)"):
            row = rows[(model, mode)]
            assert int(row["Triton launches"]) == sum(kernels.values()), (model, mode)
            assert int(row["of them copy_"]) == copies, (model, mode)
            assert float(row["host ms/step, median (q1-q3)"].split()[0]) > 0
    # The launches by kernel, one progress line per row.
    by_kernel = dict(re.findall(r"^\[host\] (.+?): launches by kernel (\{.*\})$", result.stderr, flags=re.MULTILINE))
    assert len(by_kernel) == 9
    for (model, mode), row in rows.items():
        expected = CENSUS[model][0] if mode != "eager" else {}
        assert json.loads(by_kernel[f"{model}, {mode}"]) == expected, (model, mode)
