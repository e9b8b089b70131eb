"""End to end: a whole training step of real models, eager PyTorch against tfuse, CUDA graphs and torch.compile.

``python -m benchmarks --only e2e`` (a table like every benchmark's), or on
its own, as the GPU campaign runs it::

    python -m benchmarks.e2e --jsonl $OUT/e2e.jsonl --budget 300   # GPU: the plan below, as far as time allows
    python -m benchmarks.e2e --dry                                 # CPU: tiny models, seconds; checks the script
    python -m benchmarks.e2e --render e2e.jsonl --out benchmarks/results/e2e-h100.md

Each row is one variant (see :mod:`benchmarks.e2e_step`) of one model at
one batch size and memory layout: samples (images or tokens) per second,
wall ms per step (back-to-back steps, interleaved rounds: median and
range), host ms per step (a step started on an idle GPU, until its Python
returns), device ms (the sum of the GPU activity the profiler records in one
step) and its kernel count, Triton launches per step, peak memory, and the
check that the variant's first two losses agree with eager's from the same
weights on the same batch (a fast wrong step is not a result). Rows stream
out as JSON lines as each group of variants is measured, so a run cut at
its limit keeps what it measured.

The GPU plan, in order: ResNet-50 (bf16 autocast) channels_last then NCHW at
batch 32, 64, 128, 256 (eager, tfuse, each whole step in a CUDA graph);
MobileNetV2 batch 128 channels_last; GPT-2 small, 8 x 1024 tokens; then
``torch.compile`` (minutes of compiling each). ``--budget`` stops starting
groups that would not finish in time, and says which.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .e2e_step import VARIANTS

NAME = "e2e"
LOSS_RTOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
FOUR = ("eager", "tfuse", "eager + CUDA graph", "tfuse + CUDA graph")
DEFAULT_ESTIMATE_S = {"compile": 150.0, "other": 45.0}


def gpu_plan() -> list[tuple[str, str, int, tuple[str, ...]]]:
    """(model, layout, batch, variants) groups, most valuable first."""
    plan = [("resnet50", layout, batch, FOUR) for layout in ("channels_last", "nchw") for batch in (32, 64, 128, 256)]
    plan += [("mobilenet_v2", "channels_last", 128, FOUR), ("gpt2", "tokens", 8, FOUR)]
    plan += [("resnet50", "channels_last", batch, ("eager", "torch.compile")) for batch in (64, 256, 32, 128)]
    plan += [("mobilenet_v2", "channels_last", 128, ("eager", "torch.compile")),
             ("gpt2", "tokens", 8, ("eager", "torch.compile"))]
    return plan


def cpu_plan(use_compile: bool) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """Tiny models on the CPU: eager against tfuse's PyTorch path (and torch.compile)."""
    variants = ("eager", "tfuse", "torch.compile") if use_compile else ("eager", "tfuse")
    return [("resnet50", "nchw", 8, variants), ("resnet50", "channels_last", 8, variants),
            ("mobilenet_v2", "channels_last", 8, variants), ("gpt2", "tokens", 4, variants)]


def measure_group(model: str, layout: str, batch: int, variants: Sequence[str], *, device: torch.device,
                  scale: str, rounds: int, steps: int, host_steps: int, skip: dict[str, str]) -> list[dict[str, Any]]:
    """Builds and times every variant of one group; one row each (an ``error`` row for a variant that failed)."""
    from .e2e_models import build
    from .e2e_step import Workload, device_profile, host_ms, make_variant, summary, wall_ms

    from tfuse import _backend

    _backend._size_choices.clear()  # which path the size rule took, for this group's shapes only
    spec = build(model, scale)
    load = Workload(spec, batch, layout, device)
    base = load.make_base()
    common = {"model": model, "source": spec.source, "layout": layout, "batch": batch, "samples": load.samples,
              "unit": "tokens" if spec.tokens else "images"}
    built: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name in variants:
        row = rows[name] = {**common, "variant": name}
        if name in skip:
            row["error"] = skip[name]
            continue
        try:
            built[name] = make_variant(name, load, base)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error) else ''}"
            row["traceback"] = traceback.format_exc(limit=-6)
            skip[name] = f"skipped: failed at {model} {layout} batch {batch} ({row['error'][:120]})"
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    if built:
        walls = wall_ms(built, device, rounds, steps)
    reference = built.get("eager")
    for name, variant in built.items():
        row = rows[name]
        wall = summary(walls[name])
        device_ms, kernels = device_profile(variant, device)
        row.update(
            wall_ms=wall, wall_samples=walls[name], host_ms=summary(host_ms(variant, device, host_steps)),
            device_ms=device_ms, kernels=kernels,
            triton_launches=variant.triton_launches, peak_mb=variant.peak_mb, setup_s=variant.setup_s,
            losses=variant.losses, samples_per_s=load.samples / wall["median"] * 1e3, fusion=variant.note,
            # tfuse's size rule (tfuse._backend): "op elements-class" -> the path it took in this group
            size_dispatch={f"{op} {size}": path for (op, size), path in _backend.size_dispatch().items()},
        )
        if reference is not None:
            row["vs_eager"] = summary(walls["eager"])["median"] / wall["median"]
            row["loss_check"] = loss_check(variant.losses, reference.losses, LOSS_RTOL[load.amp_dtype])
    del built, base
    gc.collect()  # models, optimizers and graphs may sit in reference cycles: free them before the next group
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return list(rows.values())


def loss_check(losses: Sequence[float], reference: Sequence[float], rtol: float) -> str:
    """"ok" when the first two losses agree with eager's within ``rtol``, else what differs."""
    for index, (ours, theirs) in enumerate(zip(losses, reference)):
        if not math.isfinite(ours) or abs(ours - theirs) > rtol * abs(theirs):
            return f"MISMATCH at step {index + 1}: {ours:.5g} vs eager {theirs:.5g}"
    return "ok"


def run_plan(plan: Iterable[tuple[str, str, int, tuple[str, ...]]], *, device: torch.device, scale: str,
             rounds: int, steps: int, host_steps: int, budget_s: float | None, sink: Any = None,
             session: str = "all") -> list[dict[str, Any]]:
    """Measures the plan group by group, writing each row to ``sink`` (a text file, JSON lines) as it comes."""
    started = time.perf_counter()
    skip: dict[str, str] = {}
    estimates = dict(DEFAULT_ESTIMATE_S)
    rows: list[dict[str, Any]] = []
    for model, layout, batch, variants in plan:
        kind = "compile" if "torch.compile" in variants else "other"
        elapsed = time.perf_counter() - started
        if budget_s is not None and elapsed + estimates[kind] > budget_s:
            group_rows = [{"model": model, "layout": layout, "batch": batch, "variant": name,
                           "error": f"not measured: out of time ({elapsed:.0f} s of {budget_s:.0f} s used)"}
                          for name in variants]
        else:
            begin = time.perf_counter()
            try:
                group_rows = measure_group(model, layout, batch, variants, device=device, scale=scale, rounds=rounds,
                                           steps=steps, host_steps=host_steps, skip=skip)
            except Exception as error:
                group_rows = [{"model": model, "layout": layout, "batch": batch, "variant": name,
                               "error": f"{type(error).__name__}: {error}"[:300]} for name in variants]
            took = time.perf_counter() - begin
            estimates[kind] = took if kind == "compile" else max(took, 0.5 * estimates[kind])
        for row in group_rows:
            row["session"] = session
            rows.append(row)
            if sink is not None:
                sink.write(json.dumps(row, default=str) + "\n")
                sink.flush()
        print(f"[e2e {time.perf_counter() - started:.0f} s] " + "; ".join(_short(r) for r in group_rows),
              file=sys.stderr, flush=True)  # progress, as every benchmark's
    return rows


def _short(row: dict[str, Any]) -> str:
    head = f"{row['model']} {row['layout']} b{row['batch']} {row['variant']}"
    if "error" in row:
        return f"{head}: {row['error'][:100]}"
    return (f"{head}: {row['wall_ms']['median']:.2f} ms wall, {row['host_ms']['median']:.2f} ms host, "
            f"{row.get('loss_check', '-')}")


# --------------------------------------------------------------------------------------------- rendering


def _ms(value: dict[str, float] | None) -> str:
    if not value:
        return "-"
    return f"{value['median']:.2f} ({value['min']:.2f}-{value['max']:.2f})"


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(rows: Sequence[dict[str, Any]], header: Sequence[str] = ()) -> str:
    """The markdown table of ``rows`` (JSON-line rows of :func:`run_plan`), after ``header`` lines.

    Rows are grouped by model, layout and batch in the order they first appear; where several runs (processes)
    measured a group, each has its own eager reference row, named after the run.
    """
    lines = [*header, "", "| model | layout | batch | variant | samples/s | wall ms/step (min-max) | host ms/step | "
             "device ms/step | kernels | Triton launches | peak MB | x eager | losses vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["layout"], row["batch"]), []).append(row)
    for group in groups.values():
        sessions = {row.get("session") for row in group}
        for row in group:
            variant = row["variant"]
            if variant == "eager" and len(sessions) > 1:
                variant = f"eager (reference of {row.get('session')})"
            cells = [row["model"], row["layout"], str(row["batch"]), variant]
            if "error" in row:
                cells += [row["error"].replace("|", "/").splitlines()[0]] + ["-"] * 8
            else:
                cells += [f"{row['samples_per_s']:,.0f} {row['unit']}/s", _ms(row["wall_ms"]), _ms(row["host_ms"]),
                          _num(row.get("device_ms"), ".2f"), _num(row.get("kernels"), "d"),
                          _num(row.get("triton_launches"), "d"), _num(row.get("peak_mb"), ",.0f"),
                          _num(row.get("vs_eager"), ".2f"), row.get("loss_check", "-")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ python -m benchmarks


def run(ctx: Any) -> Any:
    """``python -m benchmarks --only e2e``: the GPU plan on a GPU, tiny models on a CPU."""
    import tfuse

    from .harness import Column, Report, Timing, check_text, check_timing

    on_gpu = ctx.machine.on_gpu
    plan = gpu_plan() if on_gpu else cpu_plan(ctx.use_compile)
    if ctx.quick or not ctx.use_compile:  # --quick: a smoke run, no minutes of compiling
        plan = [(m, layout, b, tuple(v for v in vs if v != "torch.compile")) for m, layout, b, vs in plan]
    rounds, steps = (3, 2) if ctx.quick else ((5, 4) if on_gpu else (5, 2))
    with _cpu_backend(on_gpu):
        rows = run_plan(plan[:1] if ctx.quick else plan, device=ctx.machine.device, scale="full" if on_gpu else "tiny",
                        rounds=rounds, steps=steps, host_steps=5, budget_s=None)
    for row in rows:
        for key in ("wall_ms", "host_ms"):
            if key in row:
                row[f"{key}_median"] = row[key]["median"]
        row["flags"] = {}
        if "wall_samples" in row:
            flag = check_timing(row["variant"], Timing(tuple(row["wall_samples"])))
            if flag is not None:
                row["flags"]["wall_ms_median"] = row["flags"]["samples_per_s"] = row["flags"]["vs_eager"] = flag
        # The check cell: a failed variant, losses that disagree with eager's, else the timing checks.
        loss = row.get("loss_check", "ok")
        row["check"] = row.get("error") or (loss if loss != "ok" else check_text(row))
        row["plot"] = "wall_ms" in row
    notes = [*notes_for(on_gpu), f"tfuse {tfuse.__version__}, torch {torch.__version__}."]
    return Report(
        name=NAME, title="End to end: one training step, eager PyTorch, tfuse, CUDA graphs, torch.compile",
        notes=notes, rows=rows,
        columns=[Column("model", "model"), Column("layout", "layout"), Column("batch", "batch"),
                 Column("variant", "variant"), Column("samples_per_s", "samples/s", "{:,.0f}"),
                 Column("wall_ms_median", "wall ms/step", "{:.2f}"), Column("host_ms_median", "host ms/step", "{:.2f}"),
                 Column("device_ms", "device ms/step", "{:.2f}"), Column("triton_launches", "Triton launches"),
                 Column("vs_eager", "x eager", "{:.2f}"), Column("check", "check")],
        plot_panels="model", plot_x="variant", plot_lines=(("wall_ms_median", "wall ms per step"),),
        plot_xlabel="", plot_ylabel="ms per step",
        timing_note="Timing: wall ms is the median over interleaved rounds of back-to-back steps (each round starts "
                    "from another variant); host ms the median of single steps started on an idle device.",
    )


def notes_for(on_gpu: bool) -> list[str]:
    notes = [
        "A step: zero_grad, forward under bf16 autocast, cross-entropy, backward, clip_grad_norm_ to 1, optimizer "
        "step (SGD momentum 0.9 for the CNNs, AdamW for GPT-2). eager: nn layers, torch.optim fused=True, torch's "
        "clip; tfuse: tfuse.setup (fuse_model, FusedMomentum/FusedAdamW over flat buffers), tfuse's clip; "
        "+ CUDA graph: the whole step captured once and replayed (capturable optimizers); torch.compile: the eager "
        "variant with torch.compile(model), default mode.",
        "losses vs eager (the check column of `python -m benchmarks`): each variant's first two losses from the "
        f"same weights on the same batch, within {LOSS_RTOL[torch.bfloat16]:g} relative of eager's (bf16 autocast).",
    ]
    if not on_gpu:
        notes.append("CPU run: tiny models; tfuse runs its PyTorch path here: these rows check that the benchmark "
                     "and the step work, they are not the performance of tfuse's GPU path.")
    return notes


def _cpu_backend(on_gpu: bool) -> Any:
    """tfuse's PyTorch path on a CPU (the Triton interpreter is for checking values, not for whole models)."""
    import contextlib

    import tfuse

    return contextlib.nullcontext() if on_gpu else tfuse.use_backend("torch")


# -------------------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", type=Path, help="append one JSON line per row here (default: $OUT/e2e.jsonl)")
    parser.add_argument("--budget", type=float, default=None, help="seconds: start no group that would end later")
    parser.add_argument("--dry", action="store_true", help="tiny models on the CPU, a few steps: checks the script")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile groups")
    parser.add_argument("--variants", default="", help="comma-separated variants to keep (eager is always kept, as "
                        f"the reference): {', '.join(VARIANTS)}")
    parser.add_argument("--render", type=Path, help="render this JSON-lines file as a markdown table and exit")
    parser.add_argument("--out", type=Path, help="with --render: write the table here (default: print it)")
    args = parser.parse_args(argv)
    if args.render:
        rows = [json.loads(line) for line in args.render.read_text().splitlines() if line.strip()]
        meta = [row for row in rows if row.get("kind") == "meta"]
        table = render([row for row in rows if row.get("kind") != "meta"], _header(meta[0] if meta else {}))
        if args.out:
            args.out.write_text(table)
        else:
            print(table)
        return 0
    on_gpu = torch.cuda.is_available() and not args.dry
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        torch.backends.cudnn.benchmark = True
    path = args.jsonl or Path(os.environ.get("OUT") or ".") / "e2e.jsonl"
    plan = gpu_plan() if on_gpu else cpu_plan(not args.no_compile and not args.dry)
    if args.no_compile:
        plan = [group for group in plan if "torch.compile" not in group[3]]
    if args.variants:
        keep = {"eager", *(v.strip() for v in args.variants.split(","))}
        unknown = keep - set(VARIANTS)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
        plan = [(m, layout, b, tuple(v for v in vs if v in keep)) for m, layout, b, vs in plan]
        plan = [group for group in plan if len(group[3]) > 1]
    if args.dry:
        plan = plan[:1] + plan[2:]  # one ResNet layout, MobileNetV2, GPT-2
    rounds, steps, host_steps = (5, 4, 5) if on_gpu else ((2, 1, 2) if args.dry else (5, 2, 5))
    meta = _meta(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as sink, _cpu_backend(on_gpu):
        sink.write(json.dumps(meta) + "\n")
        rows = run_plan(plan, device=device, scale="full" if on_gpu else "tiny", rounds=rounds, steps=steps,
                        host_steps=host_steps, budget_s=args.budget, sink=sink, session=args.variants or "all")
    print(render(rows, _header(meta)))
    bad = [row for row in rows if row.get("loss_check", "ok") != "ok"]
    return 1 if bad else 0


def _meta(device: torch.device) -> dict[str, Any]:
    import tfuse

    meta: dict[str, Any] = {"kind": "meta", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                            "tfuse": tfuse.__version__, "python": sys.version.split()[0], "device": str(device)}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    return meta


def _header(meta: dict[str, Any]) -> list[str]:
    where = meta.get("gpu") or "CPU (tiny models, tfuse's PyTorch path: not performance)"
    lines = ["# End to end: one training step, eager PyTorch, tfuse, CUDA graphs, torch.compile", "",
             f"{where}; torch {meta.get('torch')}, triton {meta.get('triton')}, Python {meta.get('python')}, "
             f"tfuse {meta.get('tfuse')}; measured {meta.get('date')} with `python -m benchmarks.e2e`.", ""]
    return lines + [f"- {note}" for note in notes_for(meta.get("device", "cpu").startswith("cuda"))]


if __name__ == "__main__":
    sys.exit(main())
