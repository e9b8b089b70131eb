"""What each rank runs in the overlapped-step tests (see test_overlap.py).

Each scenario trains two replicas of one float64 model side by side on the
same batches: one wrapped in FusedDataParallel with a plain fused optimizer,
one with ``overlap_step`` (the optimizer stepped bucket by bucket during
backward). The overlapped run must end bit for bit where the plain one does
(parameters and ``state_dict``). A torch.optim run on the whole batch in one
process anchors the plain run to an independent reference.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from dist_helpers import run_named

from tfuse.distributed import FusedDataParallel, ShardedOptimizer
from optim_references import ReferenceLAMB, ReferenceLARS, ReferenceLion, ReferenceMuon
from tfuse.optim import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedLARS, FusedLion, FusedMomentum, FusedMuon,
                         FusedSGD)

BATCH = 3  # rows per rank
STEPS = 4

# name -> (fused class, torch class, arguments)
FAMILIES = {
    "sgd": (FusedSGD, torch.optim.SGD, dict(lr=0.1)),
    "momentum": (FusedMomentum, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (FusedAdam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.01, amsgrad=True)),
    "adamw": (FusedAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adagrad": (FusedAdagrad, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.1, initial_accumulator_value=0.1)),
    "lion": (FusedLion, ReferenceLion, dict(lr=0.01, weight_decay=0.1)),
    "lamb": (FusedLAMB, ReferenceLAMB, dict(lr=0.01, weight_decay=0.1)),
    "lars": (FusedLARS, ReferenceLARS, dict(lr=0.5, weight_decay=0.01)),
    "muon": (FusedMuon, ReferenceMuon, dict(lr=0.02, adamw_lr=0.01)),
}


class Net(torch.nn.Module):
    """A body in several buckets, a frozen layer, and a branch used at odd steps only (or frozen)."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6),
                                        torch.nn.Tanh(), torch.nn.Linear(6, 3))
        self.frozen = torch.nn.Linear(5, 3).requires_grad_(False)
        self.sometimes = torch.nn.Linear(5, 3).requires_grad_(unused)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        out = self.body(x) + self.frozen(x)
        return out + self.sometimes(x) if use_sometimes else out


def model(unused: bool = False) -> Net:
    """The same model on every rank (float64)."""
    torch.manual_seed(0)
    return Net(unused).double()


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(world * BATCH, 5, generator=generator, dtype=torch.float64),
            torch.randn(world * BATCH, 3, generator=generator, dtype=torch.float64))


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, unused: bool) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x, unused and step % 2 == 1), y)


def _pair(family: str, unused: bool = False, merge: int = 1, **wrapper):
    """Two wrapped replicas and their optimizers: (plain, overlapped)."""
    fused, _, options = FAMILIES[family]
    runs = []
    for overlap in (False, True):
        net = FusedDataParallel(model(unused), max_params_per_bucket=2, find_unused_parameters=unused,
                                gradient_merge_steps=merge, **wrapper)
        optimizer = fused(net.parameters(), **options)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if overlap:
            net.overlap_step(optimizer)
        runs.append((net, optimizer, schedule))
    return runs


def _rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * BATCH : (rank + 1) * BATCH]


def _same(plain, overlapped) -> dict:
    """Bit-for-bit comparison of parameters and optimizer state dicts."""
    params = all(torch.equal(a, b) for a, b in zip(plain[0].parameters(), overlapped[0].parameters()))
    ours, theirs = plain[1].state_dict(), overlapped[1].state_dict()
    state = ours["param_groups"] == theirs["param_groups"] and sorted(ours["state"]) == sorted(theirs["state"])
    for key, entry in ours["state"].items():
        state = state and sorted(entry) == sorted(theirs["state"][key])
        state = state and all(torch.equal(v, theirs["state"][key][k]) for k, v in entry.items())
    return {"params": params, "state": state}


def trajectory(rank: int, world: int, family: str, unused: bool = False) -> dict:
    """STEPS steps plain and overlapped, with an LR schedule; after each backward the overlapped replica has
    stepped already. Also the plain run against torch.optim on the whole batch."""
    plain, overlapped = _pair(family, unused=unused)
    _, torch_class, options = FAMILIES[family]
    reference = model(unused)
    ref_opt = torch_class([p for p in reference.parameters() if p.requires_grad], foreach=False, **options)
    ref_schedule = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    stepped_in_backward, buckets = [], []
    for step in range(STEPS):
        x, y = batch(step, world)
        for net, optimizer, schedule in (plain, overlapped):
            before = [p.detach().clone() for p in net.parameters()]
            loss_of(net, _rows(x, rank), _rows(y, rank), step, unused).backward()
            if net is overlapped[0]:
                changed = [not torch.equal(a, p) for a, p in zip(before, net.parameters()) if p.requires_grad]
                stepped_in_backward.append(any(changed))
                buckets.append(net._reducer.overlap.stepped_buckets)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        ref_opt.zero_grad()
        loss_of(reference, x, y, step, unused).backward()
        ref_opt.step()
        ref_schedule.step()
    reference_gap = max((a - b).abs().max().item() for a, b in zip(plain[0].module.parameters(),
                                                                     reference.parameters()))
    return {**_same(plain, overlapped), "stepped_in_backward": stepped_in_backward, "buckets": buckets,
            "total_buckets": len(overlapped[0].buckets), "reference_gap": reference_gap,
            "mode": overlapped[0]._reducer.overlap.mode,
            "communication": [overlapped[0].communication, plain[0].communication]}


def accumulation(rank: int, world: int) -> dict:
    """no_sync micro-batches and gradient_merge_steps: no step until the synchronizing pass."""
    results = {}
    for how in ("no_sync", "merge"):
        plain, overlapped = _pair("adam", merge=2 if how == "merge" else 1)
        untouched = True
        for step in range(STEPS):
            x, y = batch(step, world)
            for net, optimizer, schedule in (plain, overlapped):
                before = [p.detach().clone() for p in net.parameters()]
                with net.no_sync() if how == "no_sync" else contextlib.nullcontext():
                    local = net.communication
                    loss_of(net, _rows(x, rank), _rows(y, rank), step, False).backward()
                untouched &= all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
                x2, y2 = batch(step + 50, world)
                loss_of(net, _rows(x2, rank), _rows(y2, rank), step, False).backward()
                assert net.gradients_synchronized
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        results[how] = {**_same(plain, overlapped), "untouched": untouched, "local": local}
    return results


def grad_scaler(rank: int, world: int) -> dict:
    """Under a GradScaler the first step finds it and turns the overlap off; an inf on the last rank at step 2
    skips the step on every rank, as without overlap."""
    plain, overlapped = _pair("momentum")
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    for step in range(STEPS):
        x, y = batch(step, world)
        if step == 2 and rank == world - 1:
            x = x.clone()
            x[rank * BATCH] = float("inf")
        for (net, optimizer, schedule), scaler in zip((plain, overlapped), scalers):
            scaler.scale(loss_of(net, _rows(x, rank), _rows(y, rank), step, False)).backward()
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            optimizer.zero_grad()
    return {**_same(plain, overlapped), "mode": overlapped[0]._reducer.overlap.mode,
            "scales": [s.get_scale() for s in scalers], "communication": overlapped[0].communication}


def clipping(rank: int, world: int) -> dict:
    """A global-norm clip between backward and step: the first step refuses it before stepping anything; once
    overlapping, the next step refuses it too (after the fact)."""
    net, optimizer, _ = _pair("adam")[1]
    x, y = batch(0, world)
    initial = [p.detach().clone() for p in net.parameters()]
    loss_of(net, _rows(x, rank), _rows(y, rank), 0, False).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
    first = None
    try:
        optimizer.step()
    except RuntimeError as error:
        first = str(error)
    unchanged = all(torch.equal(a, p) for a, p in zip(initial, net.parameters()))
    optimizer.zero_grad()
    loss_of(net, _rows(x, rank), _rows(y, rank), 0, False).backward()
    optimizer.step()  # no clip: the overlap turns on
    optimizer.zero_grad()
    loss_of(net, _rows(x, rank), _rows(y, rank), 1, False).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
    later = None
    try:
        optimizer.step()
    except RuntimeError as error:
        later = str(error)
    return {"first": first, "unchanged": unchanged, "later": later, "mode": net._reducer.overlap.mode}


def misuse(rank: int, world: int) -> dict:
    """Two synchronizing backward passes without a step between them; a GradScaler that appears late."""
    net, optimizer, schedule = _pair("sgd")[1]
    x, y = batch(0, world)
    for _ in range(2):  # the first step decides: overlap on
        loss_of(net, _rows(x, rank), _rows(y, rank), 0, False).backward()
        optimizer.step()
        optimizer.zero_grad()
    loss_of(net, _rows(x, rank), _rows(y, rank), 0, False).backward()
    twice = None
    try:
        loss_of(net, _rows(x, rank), _rows(y, rank), 0, False).backward()
    except RuntimeError as error:
        twice = str(error)
    optimizer.step()
    optimizer.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(loss_of(net, _rows(x, rank), _rows(y, rank), 0, False)).backward()
    late = None
    try:
        scaler.step(optimizer)
    except RuntimeError as error:
        late = str(error)
    del optimizer, scaler, schedule
    gc.collect()
    before = [p.detach().clone() for p in net.parameters()]
    loss_of(net, _rows(x, rank), _rows(y, rank), 0, False).backward()  # its optimizer is gone: nothing steps
    untouched = all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    return {"twice": twice, "late": late, "untouched": untouched, "mode": net._reducer.overlap.mode}


def sharded(rank: int, world: int) -> dict:
    """ShardedOptimizer under FusedDataParallel, plain and overlapped (owners step their shard of each bucket when
    its reduce lands; the shards are gathered when backward ends), with each reduce mode."""
    results = {}
    # (Muon: shards of whole parameters, two span steppers over the one buffer, the owner steps whole matrices;
    # LAMB, LARS: each parameter's norms summed across the ranks, so the buckets step when backward ends)
    for family, reduce in (("adam", "auto"), ("momentum", "all_reduce"), ("muon", "auto"), ("lamb", "auto"),
                           ("lars", "all_reduce")):
        fused, _, options = FAMILIES[family]
        runs = []
        for overlap in (False, True):
            net = FusedDataParallel(model(), max_params_per_bucket=2)
            optimizer = ShardedOptimizer(net.parameters(), fused, reduce=reduce, **options)
            if overlap:
                net.overlap_step(optimizer)
            runs.append((net, optimizer))
        stepped_in_backward, while_running = [], []
        for step in range(STEPS):
            x, y = batch(step, world)
            for net, optimizer in runs:
                before = [p.detach().clone() for p in net.parameters()]
                loss_of(net, _rows(x, rank), _rows(y, rank), step, False).backward()
                if optimizer is runs[1][1]:
                    stepped_in_backward.append(any(not torch.equal(a, p) for a, p in zip(before, net.parameters())))
                    while_running.append(net._reducer.overlap.stepped_in_backward)
                optimizer.step()
                optimizer.zero_grad()
        (plain, plain_opt), (overlapped, overlapped_opt) = runs
        ours, theirs = plain_opt.state_dict(), overlapped_opt.state_dict()
        state = all(
            a["steps"] == b["steps"] and sorted(a["state"]) == sorted(b["state"])
            and all(torch.equal(v, b["state"][k]) for k, v in a["state"].items())
            for a, b in zip(ours["buffers"], theirs["buffers"])
        )
        params = all(torch.equal(a, b) for a, b in zip(plain.parameters(), overlapped.parameters()))
        results[family] = {"params": params, "state": state, "stepped_in_backward": stepped_in_backward,
                           "while_running": while_running,
                           "communication": overlapped.communication,
                           "values": [p.detach().clone() for p in overlapped.parameters()]}
    return results


def sharded_scaler(rank: int, world: int) -> dict:
    """ShardedOptimizer under a GradScaler with overlap_step: the first step finds the scaler and the overlap
    turns off; an inf on the last rank skips the step everywhere, as the plain sharded run does."""
    fused, _, options = FAMILIES["adam"]
    runs = []
    for overlap in (False, True):
        net = FusedDataParallel(model(), max_params_per_bucket=2)
        optimizer = ShardedOptimizer(net.parameters(), fused, **options)
        if overlap:
            net.overlap_step(optimizer)
        runs.append((net, optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**10)))
    for step in range(STEPS):
        x, y = batch(step, world)
        if step == 2 and rank == world - 1:
            x = x.clone()
            x[rank * BATCH] = float("inf")
        for net, optimizer, scaler in runs:
            scaler.scale(loss_of(net, _rows(x, rank), _rows(y, rank), step, False)).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    (plain, _, plain_scaler), (overlapped, _, overlapped_scaler) = runs
    return {"params": all(torch.equal(a, b) for a, b in zip(plain.parameters(), overlapped.parameters())),
            "mode": overlapped._reducer.overlap.mode,
            "scales": [plain_scaler.get_scale(), overlapped_scaler.get_scale()]}


SUITE = {
    **{f"trajectory_{name}": (lambda rank, world, name=name: trajectory(rank, world, name)) for name in FAMILIES},
    "trajectory_unused": lambda rank, world: trajectory(rank, world, "adamw", unused=True),
    "accumulation": accumulation,
    "grad_scaler": grad_scaler,
    "clipping": clipping,
    "misuse": misuse,
    "sharded": sharded,
    "sharded_scaler": sharded_scaler,
}


def run_suite(rank: int, world: int, names: list[str]) -> dict:
    torch.manual_seed(0)
    return run_named(SUITE, rank, world, names)
