"""What each rank runs in the multi-process tfuse.setup tests (see test_setup.py).

Scenarios are module-level functions ``(rank, world_size) -> dict`` (spawned
ranks import them). The reference is torch alone: the unfused model trained
with torch.optim on the whole batch in one process, in float64.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dist_helpers import run_named

import tfuse
from tfuse.distributed import FusedDataParallel, ShardedOptimizer

ROWS = 4  # rows per rank


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.SiLU(), torch.nn.Linear(16, 3)
    ).double()


def batches(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(world * ROWS, 6, generator=generator, dtype=torch.float64),
             torch.randn(world * ROWS, 3, generator=generator, dtype=torch.float64)) for _ in range(steps)]


def loss(model, x, y) -> torch.Tensor:
    return (model(x) - y).square().mean()


def whole_batch_reference(world: int, steps: int, **options) -> list[torch.Tensor]:
    reference = net()
    optimizer = torch.optim.AdamW(reference.parameters(), **options)
    for x, y in batches(world, steps):
        optimizer.zero_grad()
        loss(reference, x, y).backward()
        optimizer.step()
    return [p.detach().clone() for p in reference.parameters()]


def train(setup, rank: int, world: int, steps: int) -> list[torch.Tensor]:
    model, optimizer = setup
    for x, y in batches(world, steps):
        optimizer.zero_grad()
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        loss(model, x[rows], y[rows]).backward()
        setup.step()
    return [p.detach().clone() for p in model.parameters()]


def default(rank: int, world: int) -> dict:
    """Fused layers, FusedDataParallel, FusedAdamW: the whole-batch result of torch alone."""
    setup = tfuse.setup(net(), "adamw", lr=1e-2, weight_decay=0.1)
    params = train(setup, rank, world, 3)
    return {
        "model": type(setup.model).__name__,
        "optimizer": type(setup.optimizer).__name__,
        "fused": setup.report.counts(),
        "allreduce_calls": setup.model.num_allreduce_calls,
        "summary": setup.summary,
        "params": params,
        "reference": whole_batch_reference(world, 3, lr=1e-2, weight_decay=0.1),
        "shares_buffers": setup.optimizer.flat_params == (setup.model.flat,),
    }


def knobs(rank: int, world: int) -> dict:
    """Bucket size, count cap and gradient merge reach FusedDataParallel."""
    strategy = tfuse.FusionStrategy(fuse_grad_size_in_mb=None, max_params_per_bucket=2, gradient_merge_steps=2)
    setup = tfuse.setup(net(), "sgd", strategy, lr=0.1)
    model = setup.model
    return {
        "buckets": model.num_allreduce_calls,
        "merge": model.gradient_merge_steps,
        "bucket_mb": model.bucket_mb,
        "max_params": model.max_params_per_bucket,
        "summary": setup.summary,
    }


def sharded(rank: int, world: int) -> dict:
    setup = tfuse.setup(net(), "adamw", tfuse.FusionStrategy(sharding="optimizer"), lr=1e-2, weight_decay=0.1)
    params = train(setup, rank, world, 3)
    return {
        "optimizer": type(setup.optimizer).__name__,
        "is_sharded": isinstance(setup.optimizer, ShardedOptimizer),
        "params": params,
        "reference": whole_batch_reference(world, 3, lr=1e-2, weight_decay=0.1),
    }


def local_sgd(rank: int, world: int) -> dict:
    """LocalSGD every 2 iterations: replicas differ between syncs, equal after one."""
    setup = tfuse.setup(net(), "sgd", tfuse.FusionStrategy(local_sgd_every=2), lr=0.1)
    after_one = train(setup, rank, world, 1)
    gathered = [torch.cat([p.flatten() for p in after_one])]
    others = [torch.empty_like(gathered[0]) for _ in range(world)]
    dist.all_gather(others, gathered[0])
    differ_before = not torch.equal(others[0], others[1])
    after_two = train(setup, rank, world, 1)
    flat = torch.cat([p.flatten() for p in after_two])
    dist.all_gather(others, flat)
    return {"differ_before": differ_before, "equal_after": all(torch.equal(o, others[0]) for o in others),
            "syncs": setup.local_sgd.syncs}


def torch_ddp(rank: int, world: int) -> dict:
    strategy = tfuse.FusionStrategy(fuse_all_reduce_ops=False, fuse_all_optimizer_ops=False)
    setup = tfuse.setup(net(), "adamw", strategy, lr=1e-2, weight_decay=0.1)
    params = train(setup, rank, world, 3)
    return {
        "model": type(setup.model).__name__,
        "optimizer": type(setup.optimizer).__module__ + "." + type(setup.optimizer).__name__,
        "params": params,
        "reference": whole_batch_reference(world, 3, lr=1e-2, weight_decay=0.1),
    }


def tune(rank: int, world: int) -> dict:
    """tune_buckets on this rank's rows: a table, the same recommendation everywhere, the model untouched."""
    model = net()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(world, 1)[0]
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    tuning = tfuse.tune_buckets(model, torch.nn.functional.mse_loss, (x[rows], y[rows]),
                                candidates=[(1e-4, None), (None, None), (64, None), (None, 2)], steps=3, warmup=1,
                                rounds=2)
    errors = []
    for bad_model, bad_batch in ((torch.nn.ReLU(), (x[rows], y[rows])), (model, (x[rows],))):
        try:
            tfuse.tune_buckets(bad_model, torch.nn.functional.mse_loss, bad_batch, steps=1, rounds=1)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    return {
        "errors": errors,
        "same": [r.same_buckets for r in tuning.rows],
        "measurable": tuning.measurable,
        "rows": [(r.bucket_mb, r.max_params_per_bucket, r.buckets, r.median_ms) for r in tuning.rows],
        "best": (tuning.best.bucket_mb, tuning.best.max_params_per_bucket),
        "text": str(tuning),
        "untouched": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        and not any(hasattr(p, "_tfuse_wrapped") for p in model.parameters())
        and type(model) is torch.nn.Sequential,
        "grads": [p.grad is None for p in model.parameters()],
    }


SUITE = {"default": default, "knobs": knobs, "sharded": sharded, "local_sgd": local_sgd, "torch_ddp": torch_ddp,
         "tune": tune}


def run_suite(rank: int, world: int, names: list[str]) -> dict:
    return run_named(SUITE, rank, world, names)


__all__ = ["SUITE", "FusedDataParallel", "copy", "run_suite"]
