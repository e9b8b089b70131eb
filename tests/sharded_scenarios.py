"""What each rank runs in the multi-process ShardedOptimizer tests (see test_sharded.py).

Every scenario is a module-level function ``(rank, world_size, **kwargs) -> dict``
so that spawned ranks can import it. References are independent of tfuse:
torch.optim's own classes stepping an uncoalesced copy of the model in one
process on the whole batch (the ranks' losses averaged). Models are float64
so that the comparisons can be tight.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import traceback

import torch
import torch.distributed as dist

import tfuse

from tfuse.distributed import FusedDataParallel, ShardedOptimizer
from optim_references import ReferenceLAMB, ReferenceLARS, ReferenceLion
from tfuse.optim import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedLARS, FusedLion, FusedMomentum,
                         FusedMuon)

BATCH = 4  # rows per rank
STEPS = 3

# name -> (fused class, torch class, arguments, ShardedOptimizer's collective modes)
OPTIMIZERS = {
    "momentum": (FusedMomentum, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                 dict(reduce="reduce_scatter", gather="broadcast")),
    "adam": (FusedAdam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.01, amsgrad=True), dict()),
    "adamw": (FusedAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1),
              dict(reduce="all_reduce", gather="all_gather")),
    # Adagrad creates every parameter's state in its constructor (torch's): the unused layer's too.
    "adagrad": (FusedAdagrad, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.1, initial_accumulator_value=0.2,
                                                        weight_decay=0.01), dict()),
    "lion": (FusedLion, ReferenceLion, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1), dict()),
    # Per-parameter trust ratios: a parameter split across two shards takes its norms summed over both ranks.
    "lamb": (FusedLAMB, ReferenceLAMB, dict(lr=0.01, weight_decay=0.1, trust_clip=True), dict()),
    "lars": (FusedLARS, ReferenceLARS, dict(lr=0.5, weight_decay=0.01, nesterov=True, trust_coefficient=0.02),
             dict(reduce="all_reduce")),
}


def model() -> torch.nn.ModuleDict:
    """The same model on every rank: a body used everywhere, and layers whose gradients are sometimes None."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict(dict(
        body=torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 7), torch.nn.Tanh(),
                                 torch.nn.Linear(7, 3)),
        late=torch.nn.Linear(6, 5),  # used from the second step on: its state starts late
        rank0=torch.nn.Linear(6, 4),  # used on rank 0 only: a gradient on some ranks
        unused=torch.nn.Linear(6, 2),  # never used: None on every rank, skipped
    )).double()


def batches(world: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(world * BATCH, 6, generator=generator, dtype=torch.float64),
             torch.randn(world * BATCH, 3, generator=generator, dtype=torch.float64)) for _ in range(steps)]


def rank_loss(net: torch.nn.ModuleDict, batch, rank: int, step: int) -> torch.Tensor:
    x, y = batch[0][rank * BATCH : (rank + 1) * BATCH], batch[1][rank * BATCH : (rank + 1) * BATCH]
    loss = torch.nn.functional.mse_loss(net["body"](x), y)
    if step >= 1:
        loss = loss + net["late"](x).pow(2).mean()
    if rank == 0:
        loss = loss + net["rank0"](x).pow(2).mean()
    return loss


def params_of(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _updates_here(opt: ShardedOptimizer) -> bool:
    """Whether this rank's shard holds a part of a parameter that gets a gradient (the body's first layer)."""
    flat = opt.flat_params[0]
    shard = flat.shards(opt.world_size)[0][opt.rank]
    return any(p is not None and p.grad is not None for p, _, _ in shard.ranges)


def straddles(opt: ShardedOptimizer, matrices_only: bool = False) -> int:
    """How many parameters cross a shard boundary (the test wants some; of Muon's matrices, none)."""
    count = 0
    for flat in opt.flat_params:
        for shards in flat.shards(opt.world_size):
            bounds = {s.start for s in shards[1:]}
            ranges = [flat.range_of(p) for p in flat.params if p.requires_grad and (p.dim() >= 2 or not matrices_only)]
            count += sum(any(r.start < b < r.end for b in bounds) for r in ranges)
    return count


# --------------------------------------------------------------------------- scenarios


def trajectory(rank: int, world: int, name: str, clip: float | None = None, backend: str | None = None) -> dict:
    """Several steps sharded == torch.optim on one process over the whole batch: parameters and state.

    ``clip``: gradients clipped to that total norm first (ShardedOptimizer.clip_grad_norm_ against torch's).
    ``backend``: forces the update's path (default: the Triton kernel, through the interpreter on CPU).
    """
    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(tfuse.use_backend(backend))
        return _trajectory(rank, world, name, clip)


def _trajectory(rank: int, world: int, name: str, clip: float | None) -> dict:
    fused, torch_class, args, modes = OPTIMIZERS[name]
    net, reference = model(), model()
    opt = ShardedOptimizer(net.parameters(), fused, **modes, **args)
    ref_opt = torch_class(reference.parameters(), foreach=False, **args)
    sharded_steps, reference_steps, norms, launches = [], [], [], []
    for step, batch in enumerate(batches(world)):
        opt.zero_grad()
        rank_loss(net, batch, rank, step).backward()
        ref_opt.zero_grad()
        (sum(rank_loss(reference, batch, r, step) for r in range(world)) / world).backward()
        if clip is not None:
            norms.append((opt.clip_grad_norm_(clip), torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        with tfuse.count_launches() as launched:
            opt.step()
        launches.append(launched.total)
        ref_opt.step()
        sharded_steps.append(params_of(net))
        reference_steps.append(params_of(reference))
    consolidated = opt.consolidated_state_dict(to=0)
    return {
        "params": sharded_steps, "reference": reference_steps,
        "state": None if consolidated is None else consolidated["state"],
        "reference_state": ref_opt.state_dict()["state"],
        "modes": (opt.reduce_mode, opt.gather_mode), "straddles": straddles(opt), "norms": norms,
        "launches": launches, "updates_here": _updates_here(opt),
    }


def grad_scaler(rank: int, world: int) -> dict:
    """GradScaler: inf on the last rank only at step 1 makes every rank skip it; the others match torch."""
    net, reference = model(), model()
    opt = ShardedOptimizer(net.parameters(), FusedAdam, lr=0.01)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    skipped = []
    for step, batch in enumerate(batches(world)):
        opt.zero_grad()
        scaler.scale(rank_loss(net, batch, rank, step)).backward()
        if step == 1 and rank == world - 1:
            net["body"][0].weight.grad[0, 0] = float("inf")
        before = params_of(net)
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, params_of(net))))
        if step != 1:
            ref_opt.zero_grad()
            (sum(rank_loss(reference, batch, r, step) for r in range(world)) / world).backward()
            ref_opt.step()
    return {"skipped": skipped, "params": params_of(net), "reference": params_of(reference)}


class _CollectiveCounter:
    """Counts dist.all_reduce / dist.reduce calls (and the all-reduced sizes) while ``counting`` is set."""

    def __init__(self) -> None:
        self.counting, self.reduces, self.all_reduce_sizes = False, 0, []
        self._all_reduce, self._reduce = dist.all_reduce, dist.reduce

    def __enter__(self) -> _CollectiveCounter:
        def all_reduce(tensor, *args, **kwargs):
            if self.counting:
                self.all_reduce_sizes.append(tensor.numel())
            return self._all_reduce(tensor, *args, **kwargs)

        def reduce(tensor, *args, **kwargs):
            self.reduces += self.counting
            return self._reduce(tensor, *args, **kwargs)

        dist.all_reduce, dist.reduce = all_reduce, reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce, dist.reduce = self._all_reduce, self._reduce


def _halves(batch, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the batch as two equal micro-batches."""
    x, y = batch[0][rank * BATCH : (rank + 1) * BATCH], batch[1][rank * BATCH : (rank + 1) * BATCH]
    half = BATCH // 2
    return [(x[:half], y[:half]), (x[half:], y[half:])]


def data_parallel(rank: int, world: int) -> dict:
    """Sharded mode under FusedDataParallel (the wrapper passed as params): backward reduces each bucket to its
    owners (no gradient all-reduce), no_sync accumulates, and training still follows torch.optim on the whole
    batch; stepping after a no_sync backward raises; deleting the optimizer brings the all-reduce back."""
    wrapped = FusedDataParallel(model()["body"], bucket_mb=0.001)  # 1 KB buckets: several, some across shards
    reference = model()["body"]
    opt = ShardedOptimizer(wrapped, FusedAdam, lr=0.01, weight_decay=0.01)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01, weight_decay=0.01, foreach=False)
    counts = []
    with _CollectiveCounter() as counter:
        for batch in batches(world):
            opt.zero_grad()
            (first_x, first_y), (second_x, second_y) = _halves(batch, rank)
            with wrapped.no_sync():  # (the rank's loss is the mean of its two halves')
                (torch.nn.functional.mse_loss(wrapped(first_x), first_y) / 2).backward()
            synced_after_first = wrapped.gradients_synchronized
            counter.counting, counter.reduces, counter.all_reduce_sizes = True, 0, []
            (torch.nn.functional.mse_loss(wrapped(second_x), second_y) / 2).backward()
            counter.counting = False
            counts.append((synced_after_first, wrapped.gradients_synchronized, counter.reduces,
                           list(counter.all_reduce_sizes)))
            opt.step()
            ref_opt.zero_grad()
            x, y = batch
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
    with wrapped.no_sync():
        wrapped(first_x).sum().backward()
    try:
        opt.step()
        unsynced_step = None
    except RuntimeError as error:
        unsynced_step = str(error)
    result = {"params": params_of(wrapped), "reference": params_of(reference),
              "same_flat": opt.flat_params == (wrapped.flat,), "counts": counts,
              "num_reduce_calls": wrapped.num_reduce_calls, "num_allreduce_calls": wrapped.num_allreduce_calls,
              "n_buckets": len(wrapped.buckets), "unsynced_step": unsynced_step}
    try:
        ShardedOptimizer(list(wrapped.parameters())[:2], FusedAdam, lr=0.01)
        result["subset"] = None
    except ValueError as error:
        result["subset"] = str(error)
    del opt
    gc.collect()
    wrapped.zero_grad()
    wrapped(first_x).sum().backward()
    result["after_delete"] = (wrapped.num_allreduce_calls, wrapped.num_reduce_calls)
    return result


def data_parallel_scaler(rank: int, world: int) -> dict:
    """Both sharded-backward modes (reduce to owners; all-reduce) with gradient merge (2 micro-batches) and
    GradScaler: an inf in the last rank's input at step 1 makes every rank skip that step and halve its scale
    alike; the other steps follow torch.optim."""
    return {mode: _data_parallel_scaler(rank, world, mode) for mode in ("reduce", "all_reduce")}


def _data_parallel_scaler(rank: int, world: int, reduce: str) -> dict:
    wrapped = FusedDataParallel(model()["body"], bucket_mb=0.001, gradient_merge_steps=2)
    reference = model()["body"]
    opt = ShardedOptimizer(wrapped.parameters(), FusedAdam, lr=0.01, reduce=reduce)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    skipped, scales, synced = [], [], []
    for step, batch in enumerate(batches(world)):
        opt.zero_grad()
        for micro, (x, y) in enumerate(_halves(batch, rank)):
            if step == 1 and micro == 1 and rank == world - 1:
                x = x.clone()
                x[0, 0] = float("inf")
            scaler.scale(torch.nn.functional.mse_loss(wrapped(x), y)).backward()
            synced.append(wrapped.gradients_synchronized)
        before = params_of(wrapped)
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, params_of(wrapped))))
        if step != 1:
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(batch[0]), batch[1]).backward()
            ref_opt.step()
    return {"params": params_of(wrapped), "reference": params_of(reference), "skipped": skipped, "scales": scales,
            "synced": synced, "calls": (wrapped.num_allreduce_calls, wrapped.num_reduce_calls)}


CLIP = 0.05  # below the gradients' norm at every step: the clip scales them


def _clip_run(rank: int, world: int, idiom: str, wrap: bool) -> dict:
    """Three momentum steps of the body with one clipping idiom, against torch on the whole batch + torch's clip."""
    body = model()["body"]
    net = FusedDataParallel(body, bucket_mb=0.001) if wrap else body
    reference = model()["body"]
    opt = ShardedOptimizer(net if wrap else net.parameters(), FusedMomentum, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, foreach=False)
    result = {"error": None, "steps": 0}
    for batch in batches(world):
        x, y = batch[0][rank * BATCH : (rank + 1) * BATCH], batch[1][rank * BATCH : (rank + 1) * BATCH]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        if idiom == "optimizer_method":
            opt.clip_grad_norm_(CLIP)
        elif idiom == "tfuse_on_parameters":
            tfuse.optim.clip_grad_norm_(net.parameters(), CLIP)
        elif idiom == "tfuse_on_optimizer":
            tfuse.optim.clip_grad_norm_(opt, CLIP)
        elif idiom == "torch_on_parameters":
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        elif idiom == "uniform_edit":  # every rank halves its gradients alike: not a clip, must step
            for param in net.parameters():
                param.grad.mul_(0.5)
        before = params_of(net)
        try:
            opt.step()
        except RuntimeError as error:
            result["error"] = str(error)
            result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params_of(net)))
            return result
        result["steps"] += 1
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(batch[0]), batch[1]).backward()
        if idiom == "uniform_edit":
            for param in reference.parameters():
                param.grad.mul_(0.5)
        else:
            result["reference_norm"] = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP))
        ref_opt.step()
    result.update(params=params_of(net), reference=params_of(reference))
    return result


def clip_idioms(rank: int, world: int) -> dict:
    """Every way a user clips under ShardedOptimizer, with and without FusedDataParallel: right or a clear error."""
    results = {}
    for wrap in (True, False):
        for idiom in ("optimizer_method", "tfuse_on_parameters", "tfuse_on_optimizer", "torch_on_parameters",
                      "uniform_edit"):
            results[(idiom, wrap)] = _clip_run(rank, world, idiom, wrap)
    body = FusedDataParallel(model()["body"], bucket_mb=0.001)
    opt = ShardedOptimizer(body, FusedMomentum, lr=0.1)
    body(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    try:
        tfuse.optim.clip_grad_norm_(list(body.parameters())[:2], CLIP)
        results["subset"] = None
    except ValueError as error:
        results["subset"] = str(error)
    del opt
    return results


def masters(rank: int, world: int) -> dict:
    """master_weights=True on bfloat16 parameters: every rank feeds the same gradients (their average is exact), so
    the sharded trajectory, masters included, must equal the unsharded FusedAdam's bit for bit; each rank keeps the
    masters of its shard only, and the consolidated state dict carries the whole masters."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).bfloat16()
    reference = copy.deepcopy(net)
    opt = ShardedOptimizer(net.parameters(), FusedAdam, lr=0.01, weight_decay=0.01, master_weights=True)
    ref_opt = FusedAdam(reference.parameters(), lr=0.01, weight_decay=0.01, master_weights=True)
    generator = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=generator).bfloat16() for p in net.parameters()]
        for mine, theirs, grad in zip(net.parameters(), reference.parameters(), grads):
            mine.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    consolidated = opt.consolidated_state_dict(0)
    flat = opt.flat_params[0]
    try:
        copy.deepcopy(opt)
        copy_error = None
    except TypeError as error:
        copy_error = str(error)
    return {"params": params_of(net), "reference": params_of(reference),
            "master_bytes": opt._buffers[0].span.state.master.numel() * 4,
            "padded_numel": flat.shards(world)[0][-1].end, "copy_error": copy_error,
            "consolidated": None if consolidated is None else {
                i: entry["master_param"] for i, entry in consolidated["state"].items()},
            "reference_masters": {i: entry["master_param"] for i, entry in ref_opt.state_dict()["state"].items()}}


def memory(rank: int, world: int) -> dict:
    """Optimizer-state bytes per rank against the unsharded fused optimizer's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 33), torch.nn.Linear(33, 5))
    whole = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 33), torch.nn.Linear(33, 5))
    opt = ShardedOptimizer(net.parameters(), FusedAdam, lr=1e-3)
    unsharded = FusedAdam(whole.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    for module, optimizer in ((net, opt), (whole, unsharded)):
        module(x).sum().backward()
        optimizer.step()
    unsharded_bytes = sum(t.numel() * t.element_size() for b in unsharded.spans for t in b.state.buffers.values())
    shard = opt.flat_params[0].shards(world)[0][rank]
    return {"sharded": opt.state_bytes(), "unsharded": unsharded_bytes, "shard_numel": shard.numel}


def save(rank: int, world: int) -> dict:
    """Trains Adam (amsgrad) a few steps; returns the consolidated (rank 0) and sharded state dicts."""
    net = model()
    opt = ShardedOptimizer(net.parameters(), FusedAdam, lr=0.01, amsgrad=True)
    for step, batch in enumerate(batches(world)):
        opt.zero_grad()
        rank_loss(net, batch, rank, step).backward()
        opt.step()
    return {"consolidated": opt.consolidated_state_dict(to=0), "sharded": opt.state_dict(), "params": params_of(net)}


MUON = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float64, adamw_lr=0.01, adamw_weight_decay=0.01)


def muon(rank: int, world: int) -> dict:
    """FusedMuon sharded by whole matrices == FusedMuon on one process over the whole batch, parameters and state:
    on the loose model (matrices and the AdamW kind in FlatParams of their own; gradients None on some ranks or
    all), and under FusedDataParallel (both kinds in the wrapper's one buffer, reduced to owners in backward).
    Then the consolidated state dict loads into a new ShardedOptimizer, which steps on alike (the reshard path)."""
    result = {}
    for wrapped in (False, True):
        net, reference = (model()["body"], model()["body"]) if wrapped else (model(), model())
        params = FusedDataParallel(net, bucket_mb=0.001) if wrapped else net.parameters()
        opt = ShardedOptimizer(params, FusedMuon, **MUON)
        ref_opt = FusedMuon(reference.parameters(), **MUON)
        sharded_steps, reference_steps = [], []
        for step, batch in enumerate(batches(world)):
            for optimizer, loss in ((opt, lambda: _muon_loss(net, batch, rank, step, wrapped)),
                                    (ref_opt, lambda: sum(_muon_loss(reference, batch, r, step, wrapped)
                                                          for r in range(world)) / world)):
                optimizer.zero_grad()
                loss().backward()
                optimizer.step()
            sharded_steps.append(params_of(net))
            reference_steps.append(params_of(reference))
        consolidated = opt.consolidated_state_dict(to=0)
        entry = {"params": sharded_steps, "reference": reference_steps, "straddles": straddles(opt, matrices_only=True),
                 "buffers": sum(len(f.groups) for f in opt.flat_params), "state_bytes": opt.state_bytes(),
                 "state": None if consolidated is None else consolidated["state"],
                 "reference_state": ref_opt.state_dict()["state"]}
        if not wrapped:  # the whole state back on every rank, into a new sharded optimizer: one more step alike
            state = [consolidated]
            dist.broadcast_object_list(state, src=0)
            again_net = copy.deepcopy(net)
            again = ShardedOptimizer(again_net.parameters(), FusedMuon, **MUON)
            again.load_state_dict(state[0])
            batch = batches(world)[0]
            for optimizer, module in ((opt, net), (again, again_net)):
                optimizer.zero_grad()
                _muon_loss(module, batch, rank, 2, False).backward()
                optimizer.step()
            entry["resumed"], entry["continued"] = params_of(again_net), params_of(net)
        result["data_parallel" if wrapped else "loose"] = entry
    return result


def _muon_loss(net: torch.nn.Module, batch, rank: int, step: int, body_only: bool) -> torch.Tensor:
    if not body_only:
        return rank_loss(net, batch, rank, step)
    x, y = batch[0][rank * BATCH : (rank + 1) * BATCH], batch[1][rank * BATCH : (rank + 1) * BATCH]
    return torch.nn.functional.mse_loss(net(x), y)


def adagrad_checkpoint(rank: int, world: int) -> dict:
    """Sharded Adagrad's consolidated checkpoint (every parameter's state, from the constructor on) loads into a
    new ShardedOptimizer and into torch.optim.Adagrad, and both continue like the original."""
    fused, torch_class, args, _ = OPTIMIZERS["adagrad"]
    net = model()
    opt = ShardedOptimizer(net.parameters(), fused, **args)
    fresh = opt.consolidated_state_dict(to=0)  # before any step: step 0 and the initial sums, as torch's
    all_batches = batches(world, STEPS + 2)
    for step, batch in enumerate(all_batches[:STEPS]):
        opt.zero_grad()
        rank_loss(net, batch, rank, step).backward()
        opt.step()
    saved = opt.consolidated_state_dict(to=0)
    broadcast = [saved]
    torch.distributed.broadcast_object_list(broadcast, src=0)
    again_net = model()
    again_net.load_state_dict(net.state_dict())
    again = ShardedOptimizer(again_net.parameters(), fused, **args)
    again.load_state_dict(broadcast[0])
    reference = model()
    reference.load_state_dict(net.state_dict())
    ref_opt = torch_class(reference.parameters(), foreach=False, **args)
    ref_opt.load_state_dict(broadcast[0])
    for step, batch in enumerate(all_batches[STEPS:], start=STEPS):
        for network, optimizer in ((net, opt), (again_net, again)):
            optimizer.zero_grad()
            rank_loss(network, batch, rank, step).backward()
            optimizer.step()
        ref_opt.zero_grad()
        (sum(rank_loss(reference, batch, r, step) for r in range(world)) / world).backward()
        ref_opt.step()
    return {"fresh": None if fresh is None else fresh["state"], "params": params_of(net),
            "again": params_of(again_net), "reference": params_of(reference)}


def reload(rank: int, world: int, consolidated: dict, sharded: list[dict]) -> dict:
    """Loads a consolidated dict saved at another world size; a sharded one of that world size must fail."""
    net = model()
    opt = ShardedOptimizer(net.parameters(), FusedAdam, lr=0.5, amsgrad=True)
    opt.load_state_dict(consolidated)
    again = opt.consolidated_state_dict(to=0)
    error = None
    try:
        opt.load_state_dict(sharded[rank % len(sharded)])
    except ValueError as caught:
        error = str(caught)
    net2 = model()  # another layout at the same world size (a layer fewer)
    del net2["unused"]
    other = ShardedOptimizer(net2.parameters(), FusedAdam, lr=0.01, amsgrad=True)
    layout_error = None
    try:
        other.load_state_dict(_rank_dict(opt))
    except ValueError as caught:
        layout_error = str(caught)
    # Another optimizer family's state (torch SGD with momentum): refused at load, nothing changed.
    sgd_net = model()
    sgd = torch.optim.SGD(sgd_net.parameters(), lr=0.1, momentum=0.9)
    rank_loss(sgd_net, batches(world, 1)[0], 0, 1).backward()
    sgd.step()
    before = opt.consolidated_state_dict(to=0)
    try:
        opt.load_state_dict(sgd.state_dict())
        family_error = None
    except ValueError as caught:
        family_error = str(caught)
    after_refusal = opt.consolidated_state_dict(to=0)  # (every rank takes part in the gather; rank 0 gets it)
    family_unchanged = before is None or _same_state(before, after_refusal)
    # Training goes on from the loaded state (the lr comes from the checkpoint, as in torch).
    for step, batch in enumerate(batches(world, 1)):
        opt.zero_grad()
        rank_loss(net, batch, rank, step + 1).backward()
        opt.step()
    return {"again": again, "error": error, "layout_error": layout_error, "lr": opt.param_groups[0]["lr"],
            "after": opt.consolidated_state_dict(to=0), "params": params_of(net), "family_error": family_error,
            "family_unchanged": family_unchanged}


def _same_state(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][key][name]))
        for key, entry in a["state"].items() for name, v in entry.items()
    )


def _rank_dict(opt: ShardedOptimizer) -> dict:
    return opt.state_dict()


def killed_rank(rank: int, world: int) -> dict:
    """The last rank dies in the middle of training; the others must raise, not hang."""
    net = model()
    opt = ShardedOptimizer(net.parameters(), FusedAdam, lr=0.01)
    for step, batch in enumerate(batches(world, 4)):
        if step == 2 and rank == world - 1:
            os._exit(17)  # no clean-up, like a crash
        opt.zero_grad()
        rank_loss(net, batch, rank, step).backward()
        opt.step()
    return {"finished": True}


SUITE = {
    "momentum": lambda rank, world: trajectory(rank, world, "momentum"),
    "adam": lambda rank, world: trajectory(rank, world, "adam"),
    "adamw": lambda rank, world: trajectory(rank, world, "adamw"),
    "adagrad": lambda rank, world: trajectory(rank, world, "adagrad"),
    "lion": lambda rank, world: trajectory(rank, world, "lion"),
    "lamb": lambda rank, world: trajectory(rank, world, "lamb"),
    "lars": lambda rank, world: trajectory(rank, world, "lars"),
    "lamb_torch_path": lambda rank, world: trajectory(rank, world, "lamb", backend="torch"),
    "muon": muon,
    "adagrad_checkpoint": adagrad_checkpoint,
    "adam_torch_path": lambda rank, world: trajectory(rank, world, "adam", backend="torch"),
    "clip": lambda rank, world: trajectory(rank, world, "adam", clip=0.05),
    "grad_scaler": grad_scaler,
    "data_parallel": data_parallel,
    "data_parallel_scaler": data_parallel_scaler,
    "masters": masters,
    "clip_idioms": clip_idioms,
    "memory": memory,
    "save": save,
}


def run_suite(rank: int, world: int, names: list[str], reload_from: dict | None = None) -> dict:
    """Runs the named scenarios one after another in one process group (ranks start once)."""
    results = {}
    calls = {name: (lambda r, w, n=name: SUITE[n](r, w)) for name in names}
    if reload_from is not None:
        calls["reload"] = lambda r, w: reload(r, w, **reload_from)
    for name, call in calls.items():
        try:
            results[name] = {"value": call(rank, world)}
        except Exception as error:  # noqa: BLE001 - reported by the test of that scenario
            results[name] = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
        dist.barrier()  # a scenario that failed on one rank must not pair its collectives with the next one's
    return results
