"""A whole training step in one CUDA graph, checked small before it is timed big (GPU campaign).

    python scripts/gpu/graph_check.py "tfuse + CUDA graph"     # torchvision ResNet-50, batch 8, 64x64, bf16
    python scripts/gpu/graph_check.py "eager + CUDA graph" --size 32

Builds the variant and eager from the same weights, replays the graph three
times, synchronising after each, and compares its losses with eager's steps
on the same batch; prints the first two losses of both and exits 1 on a
fault or a mismatch. Run each variant in its own process: a fault in a
graph (an illegal address) ends the process's CUDA context.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("graph_check: needs a GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    spec = dataclasses.replace(build(args.model), image_size=args.size)
    load = Workload(spec, args.batch, args.layout, torch.device("cuda"))
    base = load.make_base()
    try:
        eager = make_variant("eager", load, base)
        graphed = make_variant(args.variant, load, base)
        replays = []
        for _ in range(3):
            replays.append(float(graphed.step()))
            torch.cuda.synchronize()
    except Exception:
        traceback.print_exc()
        print(f"graph_check {args.variant}: FAULT")
        return 1
    verdict = loss_check(graphed.losses, eager.losses, LOSS_RTOL[load.amp_dtype])
    print(f"graph_check {args.variant}: warm-up losses {graphed.losses} vs eager {eager.losses}: {verdict}; "
          f"replayed losses {replays}; Triton launches in the graph {graphed.triton_launches}")
    return 0 if verdict == "ok" and all(map(torch.isfinite, map(torch.tensor, replays))) else 1


if __name__ == "__main__":
    sys.exit(main())
