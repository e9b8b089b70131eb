"""A whole training step in one CUDA graph, checked small before it is timed big (GPU campaign).

    python scripts/gpu/graph_check.py "tfuse + CUDA graph"     # torchvision ResNet-50, batch 8, 64x64, bf16
    python scripts/gpu/graph_check.py "eager + CUDA graph" --size 32
    python scripts/gpu/graph_check.py "tfuse + CUDA graph" --amp float32   # no autocast

Builds, from the same weights, the graphed variant and its plain twin (the
same step without the graph: "tfuse" for "tfuse + CUDA graph"), replays the
graph three times, synchronising after each, and steps the twin as many
times. The verdict is the capture's: the graph's warm-up losses and its
replayed steps' losses against the twin's same steps (within LOSS_RTOL; a
model with dropout draws other masks in a replay, so there only the warm-up
is compared). Eager's first two losses are printed beside them, not judged:
at this deliberately small size (batch 8, 64x64: 2x2 maps before the pool)
bf16 rounding alone moves a loss by more than 1% (eager's own first loss
was 6.879 under bf16 autocast and 6.774 in float32 on an H100), so the
variant-vs-eager check belongs to the full-size rows of ``benchmarks.e2e``.
Exits 1 on a fault or a mismatch. Run each variant in its own process: a
fault in a graph (an illegal address) ends the process's CUDA context.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e import LOSS_RTOL, loss_check
from benchmarks.e2e_models import build
from benchmarks.e2e_step import GRAPH_VARIANTS, Workload, make_variant


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=GRAPH_VARIANTS)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--layout", default="channels_last")
    parser.add_argument("--amp", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="autocast dtype (float32: no autocast)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("graph_check: needs a GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    spec = dataclasses.replace(build(args.model), image_size=args.size)
    load = Workload(spec, args.batch, args.layout, torch.device("cuda"), amp_dtype=getattr(torch, args.amp))
    base = load.make_base()
    rtol = LOSS_RTOL[load.amp_dtype]
    twin_name = args.variant.replace(" + CUDA graph", "")
    try:
        eager = make_variant("eager", load, base)
        twin = make_variant(twin_name, load, base)
        graphed = make_variant(args.variant, load, base)  # (its warm-up, then one replay: a step more than twin's)
        twin_losses = [float(twin.step()) for _ in range(4)][1:]
        replays = []
        for _ in range(3):
            replays.append(float(graphed.step()))
            torch.cuda.synchronize()
    except Exception:
        traceback.print_exc()
        print(f"graph_check {args.variant}: FAULT")
        return 1
    verdict = loss_check(graphed.losses, twin.losses, rtol)
    if verdict == "ok" and not has_dropout(base):
        verdict = loss_check(replays, twin_losses, rtol).replace("step", "replay")
    finite = all(map(math.isfinite, replays))
    print(f"graph_check {args.variant}: warm-up losses {graphed.losses} vs {twin_name} {twin.losses}; replayed "
          f"losses {replays} vs {twin_name}'s same steps {twin_losses}: {verdict if finite else 'NOT FINITE'}; "
          f"eager's warm-up losses (not judged) {eager.losses}; Triton launches in the graph {graphed.triton_launches}")
    return 0 if verdict == "ok" and finite else 1


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a replay draws random numbers a plain step would draw otherwise (dropout in training)."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


if __name__ == "__main__":
    sys.exit(main())
