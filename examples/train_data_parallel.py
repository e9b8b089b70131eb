"""Data-parallel training with tfuse: FusedDataParallel + FusedMomentum, launched by torchrun.

    torchrun --nproc_per_node=2 examples/train_data_parallel.py --steps 20

On GPUs every process takes the GPU of its LOCAL_RANK and the ranks talk
through NCCL; without a GPU (or with fewer GPUs than processes, or with
--backend gloo) they use gloo on the CPU. Each rank trains on
its own synthetic shard; rank 0 prints the loss averaged over ranks.

Logging: rank 0 logs at INFO, the other ranks only at WARNING and above
(every rank would otherwise repeat the same lines); --log-all-ranks logs
INFO from every rank. Each line names its rank.

Shutdown: after training, every rank waits for the others at a barrier and
then destroys the process group explicitly, while the interpreter is fully
alive. A process that leaves gloo's worker threads and their pending work
for interpreter finalization can die with SIGABRT at exit after a
successful run (importing tfuse before the process group exists keeps torch
from pinning the group past destroy_process_group: see
tfuse/distributed/__init__.py); a rank that tears down its connections
while a peer still talks to it makes that peer fail. When
training raises, the rank skips both and exits with the error at once: a
barrier or a teardown could wait on a peer stuck in a collective until the
process-group timeout, while torchrun ends the other ranks as soon as one
exits with an error.
"""

from __future__ import annotations

import argparse
import logging
import os

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


def configure_logging(log_all_ranks: bool) -> None:
    """INFO on rank 0 (or on every rank with --log-all-ranks), WARNING and above elsewhere.

    The rank comes from torchrun's RANK variable, so that the lines logged
    while joining the process group follow the same rule.
    """
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 or log_all_ranks else logging.WARNING
    logging.basicConfig(level=level, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")


def train(args: argparse.Namespace, device: torch.device) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: NCCL if each rank has a GPU")
    parser.add_argument("--merge", type=int, default=1, help="gradient_merge_steps (micro-batches per optimizer step)")
    parser.add_argument("--log-all-ranks", action="store_true", help="log INFO from every rank, not only rank 0")
    args = parser.parse_args()
    configure_logging(args.log_all_ranks)

    device = init_process_group_from_env(backend=args.backend)
    train(args, device)  # raises straight out on failure (see "Shutdown" above)
    dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()  # explicitly, before interpreter finalization


if __name__ == "__main__":
    main()
