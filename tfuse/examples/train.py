"""tfuse end to end: a small ResNet trained data-parallel with tfuse, then with plain PyTorch, side by side.

    python -m tfuse.examples.train            # 2 CPU processes (gloo), or one process per GPU (NCCL)
    python -m tfuse.examples.train --quick    # a few steps: a smoke run

The data needs no download: 16x16 images of the digits 0-9 drawn from a 3x5
bitmap font, each shifted, stretched and noised at random (a fixed seed), or
scikit-learn's bundled 8x8 handwritten digits with ``--data digits`` when
scikit-learn is installed. Each rank trains on its share of every batch.

Two trainings from the same initial weights, on the same batches, epoch by
epoch in turn (so both see the same machine load):

* tfuse: ``tfuse.setup`` with the default strategy: BatchNorm + ReLU (with the
  residual adds) and Linear + ReLU fused, FusedDataParallel (bucketed
  all-reduce over flat gradient buffers), FusedMomentum over the same buffers;
* plain PyTorch: the nn layers, DistributedDataParallel, torch.optim.SGD.

Printed by rank 0: the fusion report, one progress line per step (loss and
step time), per-epoch held-out accuracy of both, and at the end both final
accuracies and the median step-time ratio, measured in this invocation. The
loss curves of both go to a PNG (with matplotlib) and the numbers to a JSON
file in ``--out`` (default: a temporary folder, printed).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# ---------------------------------------------------------------------------- data

_FONT = {  # 3 x 5 glyphs, rows top to bottom
    0: ("111", "101", "101", "101", "111"),
    1: ("010", "110", "010", "010", "111"),
    2: ("111", "001", "111", "100", "111"),
    3: ("111", "001", "111", "001", "111"),
    4: ("101", "101", "111", "001", "001"),
    5: ("111", "100", "111", "001", "111"),
    6: ("111", "100", "111", "101", "111"),
    7: ("111", "001", "010", "010", "010"),
    8: ("111", "101", "111", "101", "111"),
    9: ("111", "101", "111", "001", "111"),
}


def glyph_digits(count: int, seed: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images [1, size, size] of random digits (shifted, stretched, noised) and their labels."""
    generator = torch.Generator().manual_seed(seed)
    glyphs = torch.tensor([[[float(c) for c in row] for row in _FONT[d]] for d in range(10)])  # [10, 5, 3]
    labels = torch.randint(0, 10, (count,), generator=generator)
    images = torch.zeros(count, 1, size, size)
    for index, label in enumerate(labels.tolist()):
        height = int(torch.randint(9, 14, (1,), generator=generator))
        width = int(torch.randint(6, 10, (1,), generator=generator))
        glyph = nn.functional.interpolate(glyphs[label][None, None], size=(height, width), mode="nearest")[0, 0]
        top = int(torch.randint(0, size - height + 1, (1,), generator=generator))
        left = int(torch.randint(0, size - width + 1, (1,), generator=generator))
        images[index, 0, top : top + height, left : left + width] = glyph
    images += 0.3 * torch.randn(images.shape, generator=generator)
    return images, labels


def load_data(kind: str, quick: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, test) as (images, labels), the same on every rank."""
    if kind == "digits":
        from sklearn.datasets import load_digits  # optional: pip install scikit-learn

        bunch = load_digits()
        images = torch.tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0
        labels = torch.tensor(bunch.target)
        return (images[:1500], labels[:1500]), (images[1500:], labels[1500:])
    train = glyph_digits(512 if quick else 4096, seed=0)
    test = glyph_digits(256 if quick else 1024, seed=1)
    return train, test


# ---------------------------------------------------------------------------- model


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or channels_in != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class SmallResNet(nn.Module):
    """A ResNet for small grey images: stem, three basic blocks, a two-layer head."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.layer3 = BasicBlock(2 * width, 2 * width)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.head(x.mean((2, 3), keepdim=True))


# ---------------------------------------------------------------------------- training


class Trainer:
    """One of the two trainings: its model, optimizer, and what it measured."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.name, self.model, self.optimizer = name, model, optimizer
        self.losses: list[float] = []
        self.step_ms: list[float] = []
        self.accuracy: list[float] = []

    def step(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device) -> float:
        begin = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.step_ms.append((time.perf_counter() - begin) * 1e3)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        self.losses.append(float(reduced) / dist.get_world_size())
        return self.losses[-1]

    @torch.no_grad()
    def evaluate(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        self.model.eval()
        correct = sum(
            int((self.model(images[i : i + 256]).argmax(1) == labels[i : i + 256]).sum())
            for i in range(0, len(labels), 256)
        )
        self.model.train()
        self.accuracy.append(correct / len(labels))
        return self.accuracy[-1]


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, result_file: str) -> None:
    import tfuse  # before the process group exists (see tfuse/distributed/__init__.py)

    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    chatty = rank == 0
    try:
        (train_x, train_y), (test_x, test_y) = load_data(args.data, args.quick)
        train_x, train_y, test_x, test_y = (t.to(device) for t in (train_x, train_y, test_x, test_y))
        torch.manual_seed(0)
        base = SmallResNet().to(device)
        example = train_x[: args.batch // world]
        strategy = tfuse.FusionStrategy()
        fused = tfuse.setup(
            copy.deepcopy(base),
            "momentum",
            strategy,
            example_inputs=example,
            lr=args.lr,
            momentum=0.9,
            weight_decay=5e-4,
        )
        plain_model = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[rank] if use_cuda else None)
        plain_opt = torch.optim.SGD(plain_model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        trainers = [Trainer("tfuse", fused.model, fused.optimizer), Trainer("plain PyTorch", plain_model, plain_opt)]
        if chatty:
            print(
                f"tfuse {tfuse.__version__}, torch {torch.__version__}; {world} ranks "
                f"({'NCCL, one GPU each' if use_cuda else 'gloo on the CPU'}); data: {args.data}, "
                f"{len(train_y)} train / {len(test_y)} test images"
            )
            for line in fused.summary:
                print(f"  {line}")
        per_rank = args.batch // world
        steps_per_epoch = len(train_y) // args.batch
        if args.steps is not None:
            steps_per_epoch = min(steps_per_epoch, args.steps)
        generator = torch.Generator().manual_seed(1)
        for epoch in range(args.epochs):
            order = torch.randperm(len(train_y), generator=generator).to(device)
            for trainer in trainers:  # the same batches, one training after the other, epoch by epoch
                for step in range(steps_per_epoch):
                    batch = order[step * args.batch : (step + 1) * args.batch]
                    mine = batch[rank * per_rank : (rank + 1) * per_rank]
                    loss = trainer.step(train_x[mine], train_y[mine], device)
                    if chatty:
                        _progress(trainer, epoch, step, steps_per_epoch, loss)
                accuracy = trainer.evaluate(test_x, test_y)
                if chatty:
                    print(
                        ("\r" if _ON_TERMINAL else "")
                        + f"[{trainer.name:13}] epoch {epoch + 1}/{args.epochs}: held-out accuracy "
                        f"{accuracy:.1%}, median step {statistics.median(trainer.step_ms[-steps_per_epoch:]):.1f} ms"
                        + (" " * 20 if _ON_TERMINAL else "")
                    )
        if chatty:
            result = _result(trainers, fused, world, use_cuda, args)
            Path(result_file).write_text(json.dumps(result))
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _progress(trainer: Trainer, epoch: int, step: int, steps: int, loss: float) -> None:
    """A progress bar redrawn in place on a terminal; in a log file or a pipe, four whole lines per epoch."""
    done = int(20 * (step + 1) / steps)
    line = (
        f"[{trainer.name:13}] epoch {epoch + 1} [{'#' * done}{'.' * (20 - done)}] step {step + 1}/{steps} "
        f"loss {loss:.4f} step {trainer.step_ms[-1]:.1f} ms"
    )
    if _ON_TERMINAL:
        print("\r" + line, end="", flush=True)
    elif (step + 1) % max(1, steps // 4) == 0 or step + 1 == steps:
        print(line, flush=True)


#: Whether stdout is a terminal (carriage returns redraw the bar) rather than a log file or a pipe.
_ON_TERMINAL = sys.stdout.isatty()


def _result(trainers: list[Trainer], fused: Any, world: int, cuda: bool, args: argparse.Namespace) -> dict:
    skip = min(5, len(trainers[0].step_ms) // 4)  # warm-up steps (first launches, allocator) left out
    medians = {t.name: statistics.median(t.step_ms[skip:]) for t in trainers}
    return {
        "world": world,
        "device": "cuda" if cuda else "cpu",
        "report": str(fused.report),
        "summary": fused.summary,
        "epochs": args.epochs,
        "trainings": {
            t.name: {"losses": t.losses, "accuracy": t.accuracy, "median_step_ms": medians[t.name]} for t in trainers
        },
        "step_time_ratio": medians["plain PyTorch"] / medians["tfuse"],
    }


# ---------------------------------------------------------------------------- launcher


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tfuse.examples.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=None, help="processes (default: the GPUs, or 2 on a CPU)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="global batch size (split over the ranks)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=None, help="at most this many steps per epoch")
    parser.add_argument(
        "--data",
        choices=("glyphs", "digits"),
        default="glyphs",
        help="glyphs: generated, no download; digits: scikit-learn's 8x8 digits (needs scikit-learn)",
    )
    parser.add_argument("--quick", action="store_true", help="small data, 1 epoch of 8 steps: a smoke run")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (gloo) even where GPUs are present")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the plot and the JSON results (default: a new temp folder)"
    )
    args = parser.parse_args(argv)
    if args.data == "digits" and importlib.util.find_spec("sklearn") is None:
        parser.error("--data digits needs scikit-learn (pip install scikit-learn), or use --data glyphs (no download)")
    if args.quick:
        args.epochs, args.steps = 1, 8 if args.steps is None else args.steps
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 0
    if args.ranks is None:
        args.ranks = gpus or 2
    if gpus and args.ranks > gpus:
        parser.error(f"--ranks {args.ranks}: only {gpus} GPU(s); pass --cpu to train on the CPU")
    if args.ranks < 1 or args.batch % args.ranks or args.epochs < 1:
        parser.error("--ranks >= 1, --epochs >= 1, and --batch a multiple of --ranks")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    # A fresh folder per run by default: two runs (or two users) never overwrite each other's results.
    out = args.out or Path(tempfile.mkdtemp(prefix="tfuse-train-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args.ranks, init_file, args, result_file), nprocs=args.ranks, join=True)
        result = json.loads(Path(result_file).read_text())
    (out / "train.json").write_text(json.dumps(result, indent=1))
    fused, plain = result["trainings"]["tfuse"], result["trainings"]["plain PyTorch"]
    print()
    print(f"{'':15}{'final accuracy':>16}{'median step':>14}")
    print(f"{'tfuse':15}{fused['accuracy'][-1]:>16.1%}{fused['median_step_ms']:>11.1f} ms")
    print(f"{'plain PyTorch':15}{plain['accuracy'][-1]:>16.1%}{plain['median_step_ms']:>11.1f} ms")
    print(
        f"step time, plain / tfuse: {result['step_time_ratio']:.2f}x (measured now, {result['world']} ranks on "
        f"{result['device']}; on a CPU tfuse runs its PyTorch path, so this is not the GPU kernels' speed)"
    )
    plot = _plot(result, out / "train.png")
    print(
        f"results: {out / 'train.json'}"
        + (f", loss curves: {plot}" if plot else " (pip install matplotlib for the plot)")
    )
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files (the Agg backend), or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plot(result: dict, path: Path) -> Path | None:
    """The loss curves (distinct styles: where they coincide one still sees both) above their relative gap."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax, gap_ax) = plt.subplots(2, 1, figsize=(6, 4.8), sharex=True, gridspec_kw=dict(height_ratios=(3, 1)))
    runs = list(result["trainings"].items())
    styles = [dict(linestyle="-", linewidth=2.4, alpha=0.45), dict(linestyle="--", marker="o", markersize=3)]
    for (name, run), style in zip(runs, styles + [{}] * len(runs)):
        ax.plot(run["losses"], label=f"{name} (accuracy {run['accuracy'][-1]:.1%})", **style)
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_yscale("log")
    ax.set_title(f"SmallResNet, {result['world']} ranks ({result['device']}): tfuse vs plain PyTorch", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    if len(runs) == 2:
        (_, first), (_, second) = runs
        gaps = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(first["losses"], second["losses"])]
        gap_ax.plot(gaps, marker=".", color="C2")
        worst = max(gaps, default=0.0)
        verdict = "the curves coincide" if worst <= 1e-3 else "the curves differ"
        gap_ax.set_title(f"relative gap |tfuse - plain| / plain: at most {worst:.1e} ({verdict})", fontsize=8)
    gap_ax.set_xlabel("step")
    gap_ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
