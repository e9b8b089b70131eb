"""tfuse's optimizer families training the example job's model: LARS and LAMB at a large batch, Muon beside AdamW.

    python -m tfuse.examples.optimizers            # 2 CPU processes (gloo), or one process per GPU (NCCL)
    python -m tfuse.examples.optimizers --quick    # a few steps: a smoke run

The model and data are :mod:`tfuse.examples.train`'s (a small ResNet, 16x16
digit glyphs), wrapped in ``FusedDataParallel``. Every run starts from the
same weights and sees the same batches:

* at a large batch (1024): ``FusedMomentum`` with the linearly scaled lr, then
  ``FusedLARS`` and ``FusedLAMB`` with biases and batch-norm parameters in a
  group without weight decay (so not adapted, as MLPerf and Apex exclude them);
* at batch 128: ``FusedAdamW``, then ``FusedMuon`` (convolution and linear
  weights to Muon, the rest to its AdamW groups with AdamW's lr).

Rank 0 prints each run's held-out accuracy per epoch and writes the loss
curves (one PNG, two panels) and the numbers (JSON) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tfuse.examples.train import SmallResNet, Trainer, load_data, pyplot


def _groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weights with ``weight_decay``; biases and batch-norm parameters (1-D) without, as MLPerf's LARS and Apex's
    LAMB are used."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]  # fmt: skip


def runs() -> list[tuple[str, int, Callable[[nn.Module], torch.optim.Optimizer]]]:
    """(name, global batch, optimizer over a model) of every run, in the order they train."""
    from tfuse.optim import FusedAdamW, FusedLAMB, FusedLARS, FusedMomentum, FusedMuon

    return [
        ("SGD momentum, batch 1024", 1024, lambda m: FusedMomentum(_groups(m, 5e-4), lr=0.2, momentum=0.9)),
        ("LARS, batch 1024", 1024, lambda m: FusedLARS(_groups(m, 5e-4), lr=1.0, momentum=0.9, trust_coefficient=0.02)),
        ("LAMB, batch 1024", 1024, lambda m: FusedLAMB(_groups(m, 0.01), lr=0.02)),
        ("AdamW, batch 128", 128, lambda m: FusedAdamW(m.parameters(), lr=3e-3, weight_decay=0.01)),
        ("Muon + AdamW, batch 128", 128, lambda m: FusedMuon(m.parameters(), lr=0.02, adamw_lr=3e-3)),
    ]


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, result_file: str) -> None:
    from tfuse.distributed import FusedDataParallel

    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        data = load_data("glyphs", args.quick)
        (train_x, train_y), (test_x, test_y) = (tuple(t.to(device) for t in pair) for pair in data)
        torch.manual_seed(0)
        initial = SmallResNet().state_dict()
        results = []
        for name, batch, make in runs():
            model = SmallResNet().to(device)
            model.load_state_dict(initial)
            wrapped = FusedDataParallel(model)
            trainer = Trainer(name, wrapped, make(model))
            generator = torch.Generator().manual_seed(1)  # the same batches for every run of a batch size
            batch = min(batch, len(train_y))  # (--quick has less data)
            per_rank, steps = batch // world, len(train_y) // batch
            epochs = args.epochs * (4 if batch > 256 else 1)  # about the same number of steps at both batch sizes
            for epoch in range(epochs):
                order = torch.randperm(len(train_y), generator=generator).to(device)
                for step in range(min(steps, args.steps or steps)):
                    mine = order[step * batch : (step + 1) * batch][rank * per_rank : (rank + 1) * per_rank]
                    trainer.step(train_x[mine], train_y[mine], device)
                accuracy = trainer.evaluate(test_x, test_y)
                if rank == 0:
                    print(f"[{name:24}] epoch {epoch + 1}/{epochs}: loss {trainer.losses[-1]:.4f}, "
                          f"held-out accuracy {accuracy:.1%}", flush=True)  # fmt: skip
            results.append(dict(name=name, batch=batch, losses=trainer.losses, accuracy=trainer.accuracy,
                                describe=trainer.optimizer.describe()))  # fmt: skip
        if rank == 0:
            Path(result_file).write_text(json.dumps(dict(world=world, device=str(device), runs=results)))
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on the CPU)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs at batch 128 (four times as many at 1024)")
    parser.add_argument("--steps", type=int, default=None, help="at most this many steps per epoch")
    parser.add_argument("--quick", action="store_true", help="less data, one epoch, two steps per epoch")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where CUDA is available")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNG and the JSON (default: a new one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.steps = 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    world = args.world or (torch.cuda.device_count() if cuda else 2)
    out = args.out or Path(tempfile.mkdtemp(prefix="tfuse-optimizers-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        result_file = str(Path(scratch) / "result.json")
        mp.spawn(_worker, args=(world, str(Path(scratch) / "init"), args, result_file), nprocs=world, join=True)
        result = json.loads(Path(result_file).read_text())
    (out / "optimizers.json").write_text(json.dumps(result, indent=1))
    print(f"numbers: {out / 'optimizers.json'}")
    plot = _plot(result, out / "optimizers.png")
    if plot is not None:
        print(f"loss curves: {plot}")
    return 0


def _plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        print("(matplotlib is not installed: no plot)")
        return None
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, large in zip(axes, (True, False)):
        for run in (r for r in result["runs"] if (r["batch"] > 256) == large):
            label = f"{run['name']} (held-out {run['accuracy'][-1]:.1%})"
            axis.plot(range(1, len(run["losses"]) + 1), run["losses"], label=label, linewidth=1.2)
        axis.set(xlabel="step", ylabel="training loss (mean over ranks)", yscale="log",
                 title="large batch: LARS and LAMB" if large else "Muon beside AdamW")  # fmt: skip
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle(f"tfuse optimizers, the example job's small ResNet, {result['world']} ranks ({result['device']})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
