"""What each rank runs in the multi-process LocalSGD tests (see test_local_sgd.py).

Every scenario is a module-level function ``(rank, world_size) -> dict`` so
that spawned ranks can import it. References are independent of tfuse:
``world_size`` replicas of the model trained in one process with torch.optim,
each on one rank's rows, averaged (or outer-stepped) by hand in float64.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from dist_helpers import run_named

from tfuse.distributed import AdaptiveInterval, FusedDataParallel, LocalSGD, OuterSGD
from tfuse.optim import FusedMomentum

BATCH = 4  # rows per rank


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def batches(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(world * BATCH, 6, generator=generator, dtype=torch.float64),
             torch.randn(world * BATCH, 3, generator=generator, dtype=torch.float64)) for _ in range(steps)]


def rows(batch, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0][rank * BATCH : (rank + 1) * BATCH], batch[1][rank * BATCH : (rank + 1) * BATCH]


def loss_of(net: torch.nn.Module, batch, rank: int) -> torch.Tensor:
    x, y = rows(batch, rank)
    return torch.nn.functional.mse_loss(net(x), y)


def params_of(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def step_replicas(copies: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], batch,
                  skip: int | None = None) -> None:
    """Each replica takes its own step on its rank's rows (replica ``skip`` sits this one out)."""
    for r, (replica, optimizer) in enumerate(zip(copies, optimizers)):
        if r == skip:
            continue
        optimizer.zero_grad()
        loss_of(replica, batch, r).backward()
        optimizer.step()


def average_into(replicas: list[torch.nn.Module]) -> None:
    """Every replica takes the mean of their parameters (their optimizer state stays their own)."""
    with torch.no_grad():
        for group in zip(*(r.parameters() for r in replicas)):
            mean = sum(p.detach() for p in group) / len(group)
            for p in group:
                p.copy_(mean)


class _AllReduceCounter:
    """Counts dist.all_reduce calls while installed."""

    def __init__(self) -> None:
        self.calls, self._original = 0, dist.all_reduce

    def __enter__(self) -> _AllReduceCounter:
        def counting(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original


def every_step(rank: int, world: int) -> dict:
    """sync_every=1 with plain SGD is synchronous data parallelism: the whole batch's step, every step."""
    net, reference = model(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    local = LocalSGD(net, opt, sync_every=1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    trajectory, expected = [], []
    for batch in batches(world, 3):
        opt.zero_grad()
        loss_of(net, batch, rank).backward()
        local.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(batch[0]), batch[1]).backward()
        ref_opt.step()
        trajectory.append(params_of(net))
        expected.append(params_of(reference))
    return {"trajectory": trajectory, "expected": expected, "syncs": local.syncs}


def replicas(rank: int, world: int) -> dict:
    """k=3 with a tfuse fused momentum optimizer: every iteration equals this rank's replica, trained alone
    between syncs and averaged with the others at each sync; nothing is communicated between syncs."""
    net = model()
    opt = FusedMomentum(net.parameters(), lr=0.1, momentum=0.9)
    local = LocalSGD(net, opt, sync_every=3)
    copies = [model() for _ in range(world)]
    ref_opts = [torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9) for c in copies]
    trajectory, expected, calls, syncs = [], [], [], []
    for iteration, batch in enumerate(batches(world, 6), start=1):
        with _AllReduceCounter() as counter:
            opt.zero_grad()
            loss_of(net, batch, rank).backward()
            local.step()
        calls.append(counter.calls)
        syncs.append(local.syncs)
        step_replicas(copies, ref_opts, batch)
        if iteration % 3 == 0:
            average_into(copies)
        trajectory.append(params_of(net))
        expected.append(params_of(copies[rank]))
    return {"trajectory": trajectory, "expected": expected, "calls": calls, "syncs": syncs,
            "collectives_per_sync": local.collectives_per_sync, "bytes_per_sync": local.bytes_per_sync,
            "numel": sum(p.numel() for p in net.parameters()),
            "flat_numel": sum(g.trainable_numel for g in local.flat.groups)}


def outer(rank: int, world: int) -> dict:
    """k=2 with an outer Nesterov step: the snapshot moves by torch SGD's Nesterov maths on the pseudo-gradient
    mean(snapshot - replica), computed here by hand in float64."""
    spec = OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    local = LocalSGD(net, opt, sync_every=2, outer_optimizer=spec)
    copies = [model() for _ in range(world)]
    ref_opts = [torch.optim.SGD(c.parameters(), lr=0.1) for c in copies]
    snapshot = params_of(copies[0])
    momentum: list[torch.Tensor] | None = None
    trajectory, expected = [], []
    for iteration, batch in enumerate(batches(world, 4), start=1):
        opt.zero_grad()
        loss_of(net, batch, rank).backward()
        local.step()
        step_replicas(copies, ref_opts, batch)
        if iteration % 2 == 0:
            pseudo = [s - sum(ps) / world for s, ps in zip(snapshot, zip(*(params_of(c) for c in copies)))]
            momentum = pseudo if momentum is None else [spec.momentum * m + g for m, g in zip(momentum, pseudo)]
            snapshot = [s - spec.lr * (g + spec.momentum * m) for s, g, m in zip(snapshot, pseudo, momentum)]
            with torch.no_grad():
                for replica in copies:
                    for p, s in zip(replica.parameters(), snapshot):
                        p.copy_(s)
        trajectory.append(params_of(net))
        expected.append(params_of(copies[rank]))
    return {"trajectory": trajectory, "expected": expected}


def warmup(rank: int, world: int) -> dict:
    """FusedDataParallel for 2 warm-up iterations, then local steps synced every 2, under a GradScaler whose step
    the last rank skips at iteration 4 (an inf in its input): the syncs stay aligned, no all-reduce runs between
    syncs, and every iteration equals the reference replicas."""
    wrapped = FusedDataParallel(model(), bucket_mb=None)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    local = LocalSGD(wrapped, opt, sync_every=2, warmup_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    copies = [model() for _ in range(world)]
    ref_opts = [torch.optim.SGD(c.parameters(), lr=0.1) for c in copies]
    trajectory, expected, calls, synced = [], [], [], []
    for iteration, batch in enumerate(batches(world, 6), start=1):
        with _AllReduceCounter() as counter:
            opt.zero_grad()
            x, y = rows(batch, rank)
            if iteration == 4 and rank == world - 1:
                x = x.clone()
                x[0, 0] = float("inf")
            scaler.scale(torch.nn.functional.mse_loss(wrapped(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            synced.append(local.tick())
        calls.append(counter.calls)
        if iteration <= 2:  # synchronous data parallelism: every replica takes the whole batch's step
            grads = []
            for r, replica in enumerate(copies):
                replica.zero_grad()
                loss_of(replica, batch, r).backward()
                grads.append([p.grad.clone() for p in replica.parameters()])
            with torch.no_grad():
                for replica in copies:
                    for p, *gs in zip(replica.parameters(), *grads):
                        p.sub_(0.1 * sum(gs) / world)
        else:
            step_replicas(copies, ref_opts, batch, skip=world - 1 if iteration == 4 else None)  # its scaler skipped
            if iteration % 2 == 0:
                average_into(copies)
        trajectory.append(params_of(wrapped))
        expected.append(params_of(copies[rank]))
    return {"trajectory": trajectory, "expected": expected, "calls": calls, "synced": synced,
            "scale": float(scaler.get_scale())}


def buffers(rank: int, world: int) -> dict:
    """Batch-norm statistics are averaged at a sync (the floating ones; num_batches_tracked from rank 0)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.BatchNorm1d(3)).double()
    alone = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    local = LocalSGD(net, opt, sync_every=1)
    batch = batches(world, 1)[0]
    alone(rows(batch, rank)[0])  # this rank's statistics before the sync
    mine = [alone[1].running_mean.clone(), alone[1].running_var.clone()]
    gathered = [[torch.empty_like(t) for _ in range(world)] for t in mine]
    for out, t in zip(gathered, mine):
        dist.all_gather(out, t)
    opt.zero_grad()
    loss_of(net, batch, rank).backward()
    local.step()
    return {"mean": net[1].running_mean.clone(), "var": net[1].running_var.clone(),
            "expected_mean": sum(gathered[0]) / world, "expected_var": sum(gathered[1]) / world,
            "tracked": int(net[1].num_batches_tracked), "collectives_per_sync": local.collectives_per_sync}


def adaptive(rank: int, world: int) -> dict:
    """The adaptive interval: the divergence each sync measures equals sqrt(mean_r |p_r - p_mean|^2) / |p_mean|
    computed here from the gathered replicas, and the interval doubles (target far above it) or halves (target far
    below it) after each sync."""
    runs = {}
    for name, rule, start in (("doubling", AdaptiveInterval(target=1.0, max_every=8), 1),
                              ("halving", AdaptiveInterval(target=1e-12, min_every=1), 4)):
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        local = LocalSGD(net, opt, sync_every=start, adaptive=rule)
        synced_at, measured, expected = [], [], []
        for iteration, batch in enumerate(batches(world, 7), start=1):
            opt.zero_grad()
            loss_of(net, batch, rank).backward()
            opt.step()
            mine = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            if local.tick():
                mean = sum(everyone) / world
                spread = sum((p - mean).pow(2).sum() for p in everyone) / world
                synced_at.append(iteration)
                measured.append(local.divergence)
                expected.append(float((spread / mean.pow(2).sum()).sqrt()))
        runs[name] = {"synced_at": synced_at, "measured": measured, "expected": expected,
                      "sync_every": local.sync_every}
    return runs


def _train(net, opt, local, data, rank):
    for batch in data:
        opt.zero_grad()
        loss_of(net, batch, rank).backward()
        local.step()


def resume(rank: int, world: int) -> dict:
    """A checkpoint taken mid-interval (iteration 2 of k=3, outer Nesterov) resumes exactly where it stopped."""
    spec = OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    data = batches(world, 5)

    def fresh():
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
        return net, opt, LocalSGD(net, opt, sync_every=3, outer_optimizer=spec)

    net, opt, local = fresh()
    _train(net, opt, local, data, rank)
    straight = params_of(net)
    net, opt, local = fresh()
    _train(net, opt, local, data[:2], rank)
    saved = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "local": local.state_dict()})
    net, opt, local = fresh()
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    # Bad checkpoints first: each must raise ValueError naming the problem and change nothing.
    before = copy.deepcopy(local.state_dict())
    refusals = []
    for broken in ({k: v for k, v in saved["local"].items() if k != "iterations"},
                   {**saved["local"], "snapshots": [t[:-1] for t in saved["local"]["snapshots"]]},
                   {**saved["local"], "sync_every": 4}):
        try:
            local.load_state_dict(broken)
            refusals.append(None)
        except ValueError as error:
            refusals.append(str(error))
    after = local.state_dict()
    unchanged = all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for key in before for a, b in (zip(before[key], after[key]) if isinstance(before[key], list)
                                       else [(before[key], after[key])])
    )
    local.load_state_dict(saved["local"])
    _train(net, opt, local, data[2:], rank)
    return {"resumed": params_of(net), "straight": straight, "syncs": local.syncs, "iterations": local.iterations,
            "refusals": refusals, "unchanged": unchanged}


def killed_rank(rank: int, world: int) -> dict:
    """The last rank dies before the first sync; the others must raise, not hang."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    local = LocalSGD(net, opt, sync_every=2)
    for iteration, batch in enumerate(batches(world, 4), start=1):
        if iteration == 2 and rank == world - 1:
            os._exit(17)  # no clean-up, like a crash
        opt.zero_grad()
        loss_of(net, batch, rank).backward()
        local.step()
    return {"finished": True}


def layout_changes(rank: int, world: int) -> dict:
    """k=2 through a layout change of every kind, for a fused and a torch.optim inner optimizer: a weight frozen
    mid-interval (its replicas differ, so the next sync averages it once more), a bias re-initialised with
    ``.data =``, and a weight unfrozen; every iteration equals the replicas trained alone and averaged at syncs."""
    runs = {}
    for name, make_opt in (("fused", lambda ps: FusedMomentum(ps, lr=0.1, momentum=0.9)),
                           ("torch", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))):
        net = model()
        net[2].weight.requires_grad_(False)  # frozen from the start: unfrozen at iteration 5
        opt = make_opt(net.parameters())
        local = LocalSGD(net, opt, sync_every=2)
        copies = [model() for _ in range(world)]
        for replica in copies:
            replica[2].weight.requires_grad_(False)
        ref_opts = [torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9) for c in copies]
        trajectory, expected = [], []
        for iteration, batch in enumerate(batches(world, 6), start=1):
            for m in (net, *copies):
                if iteration == 4:  # after iteration 3's local step: the replicas of this weight differ
                    m[0].weight.requires_grad_(False)
                if iteration == 5:
                    m[2].weight.requires_grad_(True)
                    m[2].bias.data = torch.full_like(m[2].bias, 0.25)  # re-initialised (new storage)
            opt.zero_grad()
            loss_of(net, batch, rank).backward()
            local.step()
            step_replicas(copies, ref_opts, batch)
            if iteration % 2 == 0:
                average_into(copies)
            trajectory.append(params_of(net))
            expected.append(params_of(copies[rank]))
        runs[name] = {"trajectory": trajectory, "expected": expected, "syncs": local.syncs}
    # A parameter replaced by a new nn.Parameter: the flat buffers and the optimizer hold the old one.
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    local = LocalSGD(net, opt, sync_every=1)
    net[0].bias = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))
    try:
        local.sync()
        runs["replaced"] = "no error"
    except RuntimeError as error:
        runs["replaced"] = str(error)
    return runs


SUITE = {
    "layout_changes": layout_changes,
    "every_step": every_step, "replicas": replicas, "outer": outer, "warmup": warmup, "buffers": buffers,
    "resume": resume, "adaptive": adaptive,
}


def run_suite(rank: int, world: int, names: list[str]) -> dict:
    """Runs the named scenarios one after another in one process group (ranks start once)."""
    return run_named(SUITE, rank, world, names)
