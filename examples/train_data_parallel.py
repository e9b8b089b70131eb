"""Data-parallel training with tfuse: FusedDataParallel + FusedMomentum, launched by torchrun.

    torchrun --nproc_per_node=2 examples/train_data_parallel.py --steps 20

On GPUs every process takes the GPU of its LOCAL_RANK and the ranks talk
through NCCL; without a GPU (or with fewer GPUs than processes, or with
--backend gloo) they use gloo on the CPU. Each rank trains on
its own synthetic shard; rank 0 prints the loss averaged over ranks.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

from tfuse.distributed import FusedDataParallel, init_process_group_from_env
from tfuse.optim import FusedMomentum


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: NCCL if each rank has a GPU")
    parser.add_argument("--merge", type=int, default=1, help="gradient_merge_steps (micro-batches per optimizer step)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    device = init_process_group_from_env(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = FusedDataParallel(build_model().to(device), bucket_mb=args.bucket_mb, gradient_merge_steps=args.merge)
    optimizer = FusedMomentum(model.parameters(), lr=0.05, momentum=0.9)  # shares the wrapper's flat buffers
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    loss_fn = torch.nn.CrossEntropyLoss()

    step = 0
    while step < args.steps:
        images = torch.randn(args.batch, 3, 16, 16, generator=generator).to(device)
        labels = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
        loss = loss_fn(model(images), labels)
        loss.backward()  # returns with the gradients averaged over ranks (on merge boundaries)
        if not model.gradients_synchronized:
            continue  # a gradient-merge micro-batch: keep accumulating
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step}/{args.steps} loss {mean_loss.item() / world:.4f}", flush=True)

    # Every replica must hold the same weights after training.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()])
    gathered = [torch.empty_like(checksum) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    if rank == 0:
        print(f"replicas identical: {all(torch.equal(g, gathered[0]) for g in gathered)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
