"""What each rank runs in the multi-process FusedDataParallel tests (see test_distributed.py).

Every scenario is a module-level function ``(rank, world_size) -> dict`` so
that spawned ranks can import it. References are independent of tfuse: one
process training an uncoalesced copy on the whole (concatenated) batch, and
torch's DistributedDataParallel on the same shards. Models are float64 so
that the comparisons can be tight.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from dist_helpers import run_named

from tfuse.distributed import FusedDataParallel, LocalSGD, ShardedOptimizer
from tfuse.flat import flat_params_of
from tfuse.optim import FusedAdam, FusedMomentum

BATCH = 4  # rows per rank per micro-batch
STEPS = 3


def net(hidden: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    ).double()


def reference_net() -> torch.nn.Module:
    """Rank 0's initial model (rank r builds its model after manual_seed(r))."""
    torch.manual_seed(0)
    return net()


def rank_net(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)  # different on every rank: the wrapper must broadcast rank 0's
    return net()


def global_batches(world: int, steps: int, micro: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same data on every rank: per step, ``micro`` micro-batches of world * BATCH rows."""
    generator = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(world * BATCH, 6, generator=generator, dtype=torch.float64),
         torch.randn(world * BATCH, 3, generator=generator, dtype=torch.float64))
        for _ in range(steps * micro)
    ]


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    return x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def grads_of(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def recorded_all_reduces():
    """Records (data_ptr, numel) of every torch.distributed.all_reduce call made from Python."""
    calls: list[tuple[int, int]] = []
    original = dist.all_reduce

    def recorder(tensor, *args, **kwargs):
        calls.append((tensor.data_ptr(), tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recorder
    try:
        yield calls
    finally:
        dist.all_reduce = original


def bucket_indices(model: FusedDataParallel, calls: list[tuple[int, int]]) -> list[int]:
    """Which bucket each recorded all-reduce was (-1: not a bucket)."""
    buffers = model.flat.grad_buffers
    starts = {
        (buffers[b.buffer_index].data_ptr() + b.start * buffers[b.buffer_index].element_size(), b.numel): index
        for index, b in enumerate(model.buckets)
    }
    return [starts.get(call, -1) for call in calls]


class CountedOps(TorchDispatchMode):
    """Counts the named aten ops run inside (e.g. during a backward)."""

    NAMES = ("copy_", "div_", "zero_")

    def __init__(self) -> None:
        super().__init__()
        self.counts = dict.fromkeys(self.NAMES, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- scenarios


def train(rank: int, world: int, optimizer: str = "sgd") -> dict:
    """Several steps on shards == one process on the whole batch == DDP; one all-reduce per bucket, in order."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("tfuse.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    model = rank_net(rank)
    reference = reference_net()
    ddp = DDP(copy.deepcopy(reference))
    if optimizer == "fused_adam":
        # Created BEFORE wrapping: the wrapper must reuse its flat buffers, not copy them.
        fused = FusedAdam(model.parameters(), lr=0.01, weight_decay=0.01)
        wrapped = FusedDataParallel(model, bucket_mb=None, max_params_per_bucket=2)
        optimizers = [fused, torch.optim.Adam(reference.parameters(), lr=0.01, weight_decay=0.01),
                      torch.optim.Adam(ddp.parameters(), lr=0.01, weight_decay=0.01)]
    else:
        wrapped = FusedDataParallel(model, bucket_mb=None, max_params_per_bucket=2)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (wrapped, reference, ddp)]
    logger.removeHandler(handler)
    initial = params_of(wrapped)
    issued, grads_in_buffers, backward_ops = [], True, []
    for batch in global_batches(world, STEPS):
        for opt in optimizers:
            opt.zero_grad()
        with recorded_all_reduces() as calls, CountedOps() as ops:
            loss_of(wrapped, shard(batch, rank)).backward()
        backward_ops.append(ops.counts)
        issued.append(bucket_indices(wrapped, calls))
        grads_in_buffers &= all(flat_params_of(p) is wrapped.flat and p.grad.data_ptr() == wrapped.flat.grad_view(p).data_ptr()
                                for p in wrapped.parameters())
        loss_of(reference, batch).backward()
        loss_of(ddp, shard(batch, rank)).backward()
        for opt in optimizers:
            opt.step()
    return {
        "initial": initial, "reference_initial": params_of(reference_net()),
        "fdp": params_of(wrapped), "reference": params_of(reference), "ddp": params_of(ddp),
        "issued": issued, "n_buckets": len(wrapped.buckets), "num_allreduce_calls": wrapped.num_allreduce_calls,
        "num_grad_tensors": wrapped.num_grad_tensors, "grads_in_buffers": grads_in_buffers,
        "optimizer_shares_flat": optimizer != "fused_adam" or all(flat_params_of(p) is wrapped.flat for p in model.parameters()),
        "log": records, "synchronized": wrapped.gradients_synchronized, "backward_ops": backward_ops,
    }


def gradient_merge(rank: int, world: int) -> dict:
    """k micro-batches merged == one step on the concatenation; one all-reduce per bucket every k passes."""
    k, steps = 3, 2
    wrapped = FusedDataParallel(rank_net(rank), bucket_mb=None, max_params_per_bucket=3, gradient_merge_steps=k)
    reference = reference_net()
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    batches = global_batches(world, steps, micro=k)
    synchronized, calls_per_pass = [], []
    for step in range(steps):
        micro = batches[step * k : (step + 1) * k]
        for batch in micro:
            with recorded_all_reduces() as calls:
                loss_of(wrapped, shard(batch, rank)).backward()
            calls_per_pass.append(len(calls))
            synchronized.append(wrapped.gradients_synchronized)
            if wrapped.gradients_synchronized:
                opt.step()
                opt.zero_grad()
        whole = (torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro]))
        ref_opt.zero_grad()
        loss_of(reference, whole).backward()
        ref_opt.step()
    # gradient_merge_avg=False: the k micro-batch gradients are summed (still averaged over ranks).
    summed = FusedDataParallel(rank_net(rank), bucket_mb=1, gradient_merge_steps=k, gradient_merge_avg=False)
    plain = reference_net()
    for batch in batches[:k]:
        loss_of(summed, shard(batch, rank)).backward()
        loss_of(plain, batch).backward()
    return {
        "fdp": params_of(wrapped), "reference": params_of(reference), "synchronized": synchronized,
        "calls_per_pass": calls_per_pass, "n_buckets": len(wrapped.buckets),
        "summed_grads": grads_of(summed), "summed_reference": grads_of(plain),
    }


def no_sync(rank: int, world: int) -> dict:
    """no_sync() accumulates locally like DDP's; the next synced backward averages the sum."""
    wrapped = FusedDataParallel(rank_net(rank), bucket_mb=None, max_params_per_bucket=2)
    ddp = DDP(reference_net())
    local = reference_net()
    first, second = global_batches(world, 2)
    with wrapped.no_sync(), ddp.no_sync():
        with recorded_all_reduces() as inside_calls:
            loss_of(wrapped, shard(first, rank)).backward()
        loss_of(ddp, shard(first, rank)).backward()
    loss_of(local, shard(first, rank)).backward()
    inside = {"fdp": grads_of(wrapped), "ddp": grads_of(ddp), "local": grads_of(local),
              "synchronized": wrapped.gradients_synchronized, "calls": len(inside_calls)}
    loss_of(wrapped, shard(second, rank)).backward()
    loss_of(ddp, shard(second, rank)).backward()
    whole = reference_net()
    loss_of(whole, first).backward()
    loss_of(whole, second).backward()
    after = {"fdp": grads_of(wrapped), "ddp": grads_of(ddp), "reference": grads_of(whole),
             "synchronized": wrapped.gradients_synchronized}
    # Forward inside, backward outside: still local (the forward decides, as in DDP).
    wrapped.zero_grad()
    with wrapped.no_sync():
        out = loss_of(wrapped, shard(first, rank))
    with recorded_all_reduces() as late_calls:
        out.backward()
    return {"inside": inside, "after": after, "forward_inside_calls": len(late_calls),
            "forward_inside_grads": grads_of(wrapped), "local_first": inside["local"]}


class WithAux(torch.nn.Module):
    """A body and head, plus an auxiliary head used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 3)
        self.aux = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        hidden = torch.tanh(self.body(x))
        out = self.head(hidden)
        return out + self.aux(hidden) if use_aux else out


def _aux_models(find_unused: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(5)
    base = WithAux().double()
    return FusedDataParallel(copy.deepcopy(base), bucket_mb=None, max_params_per_bucket=2,
                             find_unused_parameters=find_unused), DDP(copy.deepcopy(base), find_unused_parameters=find_unused)


def unused_parameters(rank: int, world: int) -> dict:
    """find_unused_parameters=True: unused everywhere -> grad None; used on rank 0 only -> like DDP."""
    results = {}
    for case, uses_aux in (("unused_everywhere", lambda step: False), ("rank0_only", lambda step: rank == 0)):
        wrapped, ddp = _aux_models(True)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (wrapped, ddp)]
        grads = []
        for batch in global_batches(world, 2):
            x, y = shard(batch, rank)
            for model, opt in zip((wrapped, ddp), opts):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x, use_aux=uses_aux(0)), y).backward()
            grads.append({"fdp": grads_of(wrapped), "ddp": grads_of(ddp)})
            for opt in opts:
                opt.step()
        results[case] = {"grads": grads, "fdp": params_of(wrapped), "ddp": params_of(ddp),
                         "names": [n for n, _ in wrapped.module.named_parameters()]}
    # Without the flag: a clear error on every rank, after completing the collectives.
    strict, _ = _aux_models(False)
    x, y = shard(global_batches(world, 1)[0], rank)
    try:
        torch.nn.functional.mse_loss(strict(x), y).backward()
        results["strict_error"] = None
    except RuntimeError as error:
        results["strict_error"] = str(error)
    dist.barrier()  # the group still works: nothing was left half-issued
    results["group_alive"] = True
    return results


def mismatch(rank: int, world: int) -> dict:
    """A different model, or different options, on the last rank: the same error on every rank."""
    errors = {}
    last = rank == world - 1
    try:
        FusedDataParallel(net(hidden=11 if last else 10), bucket_mb=1)
        errors["shape"] = None
    except RuntimeError as error:
        errors["shape"] = str(error)
    try:
        FusedDataParallel(net(), bucket_mb=2 if last else 1)
        errors["option"] = None
    except RuntimeError as error:
        errors["option"] = str(error)
    # One more parameter on the last rank, for every class that communicates over the model's parameters:
    # each must name it before its first collective (a broadcast over buffers of different sizes aborts or hangs).
    builders = {
        "count_fdp": lambda model: FusedDataParallel(model),
        "count_sharded": lambda model: ShardedOptimizer(model.parameters(), FusedAdam, lr=0.1),
        "count_local_sgd_fused": lambda model: LocalSGD(model, FusedMomentum(model.parameters(), lr=0.1), 2),
        "count_local_sgd_torch": lambda model: LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), 2),
    }
    for name, build in builders.items():
        model = net()
        if last:
            model.add_module("extra", torch.nn.Linear(2, 2))
        try:
            build(model)
            errors[name] = None
        except RuntimeError as error:
            errors[name] = str(error)
    dist.barrier()
    return errors


class TwoBranches(torch.nn.Module):
    """Two parallel branches whose creation order (hence backward order) the caller picks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, a_first: bool = True) -> torch.Tensor:
        if a_first:
            a = self.a(x)
            b = self.b(x)
        else:
            b = self.b(x)
            a = self.a(x)
        return self.head(torch.cat([torch.tanh(a), torch.tanh(b)], dim=1))


def hook_order(rank: int, world: int) -> dict:
    """Hooks fire in a different order on odd ranks; buckets still go out in bucket order, gradients right."""
    torch.manual_seed(3)
    base = TwoBranches().double()
    reference = copy.deepcopy(base)
    wrapped = FusedDataParallel(copy.deepcopy(base), bucket_mb=None, max_params_per_bucket=1)
    names = {p: n for n, p in wrapped.module.named_parameters()}
    fired: list[str] = []
    for param in wrapped.parameters():
        param.register_post_accumulate_grad_hook(lambda p: fired.append(names[p]))
    batch = global_batches(world, 1)[0]
    x, y = shard(batch, rank)
    with recorded_all_reduces() as calls:
        torch.nn.functional.mse_loss(wrapped(x, a_first=rank % 2 == 0), y).backward()
    full_x, full_y = batch
    torch.nn.functional.mse_loss(reference(full_x), full_y).backward()
    return {"fired": fired, "issued": bucket_indices(wrapped, calls), "n_buckets": len(wrapped.buckets),
            "fdp": grads_of(wrapped), "reference": grads_of(reference)}


class MixedDtypes(torch.nn.Module):
    """Two layers, possibly of different dtypes (casts between them)."""

    def __init__(self, first: torch.dtype, second: torch.dtype) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5).to(first)
        self.b = torch.nn.Linear(5, 3).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        return self.b(hidden.to(self.b.weight.dtype)).double()


def dtypes(rank: int, world: int) -> dict:
    """float32 + float64 layers (two flat buffers), bfloat16 and float16 models: the mean of every rank's gradient."""
    results = {}
    for name, (first, second) in {
        "float32+float64": (torch.float32, torch.float64),
        "bfloat16": (torch.bfloat16, torch.bfloat16),
        "float16": (torch.float16, torch.float16),
    }.items():
        torch.manual_seed(11)
        model = MixedDtypes(first, second)
        local = copy.deepcopy(model)
        wrapped = FusedDataParallel(model, bucket_mb=None, max_params_per_bucket=1)
        batch = shard(global_batches(world, 1)[0], rank)
        loss_of(wrapped, batch).backward()
        loss_of(local, batch).backward()
        # Independent reference: every rank's local gradient, gathered in float64 and averaged.
        expected = []
        for p in local.parameters():
            gathered = [torch.empty_like(p.grad, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(gathered, p.grad.double())
            expected.append(torch.stack(gathered).mean(0))
        results[name] = {"fdp": grads_of(wrapped), "expected": expected, "buffers": len(wrapped.flat.grad_buffers),
                         "dtypes": [p.grad.dtype for p in wrapped.parameters()]}
    return results


def buffers(rank: int, world: int) -> dict:
    """Module buffers: broadcast at wrapping and before each training forward, like DDP; no collective in eval."""
    def build() -> torch.nn.Module:
        torch.manual_seed(2)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        with torch.no_grad():
            model[1].running_mean.fill_(float(rank))  # differs per rank until broadcast
        return model

    wrapped = FusedDataParallel(build(), bucket_mb=None)
    after_wrap = wrapped.module[1].running_mean.clone()
    ddp = DDP(build())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, ddp)]
    for batch in global_batches(world, 2):
        for model, opt in zip((wrapped, ddp), opts):
            opt.zero_grad()
            loss_of(model, shard(batch, rank)).backward()
            opt.step()
    state = {"fdp": [t.clone() for t in wrapped.module.state_dict().values()],
             "ddp": [t.clone() for t in ddp.module.state_dict().values()]}
    # Gradient accumulation: inside no_sync() no buffer broadcast either (each rank's statistics until the
    # synchronising step), and the forward after it neither: DDP's rule, statistics compared after each pass.
    accumulated = {"fdp": [], "ddp": []}
    first, second = global_batches(world, 2)
    for name, model, opt in (("fdp", wrapped, opts[0]), ("ddp", ddp, opts[1])):
        opt.zero_grad()
        with model.no_sync():
            loss_of(model, shard(first, rank)).backward()
        accumulated[name].append(model.module[1].running_mean.clone())
        loss_of(model, shard(second, rank)).backward()
        accumulated[name].append(model.module[1].running_mean.clone())
        opt.step()
        loss_of(model, shard(first, rank)).backward()  # after a synced pass: broadcast again
        accumulated[name].append(model.module[1].running_mean.clone())
    state["accumulated"] = accumulated
    if rank == 0:  # evaluation on one rank alone: must not issue a collective (it would hang)
        wrapped.eval()
        with torch.no_grad():
            wrapped(torch.zeros(2, 6, dtype=torch.float64))
    dist.barrier()
    return {"after_wrap": after_wrap, **state}


def rewrap(rank: int, world: int) -> dict:
    """Unfreezing after wrapping is refused in forward; wrapping model.module again works and retires the old wrapper."""
    model = rank_net(rank)
    model[0].weight.requires_grad_(False)
    reference = reference_net()
    reference[0].weight.requires_grad_(False)
    wrapped = FusedDataParallel(model, bucket_mb=None, max_params_per_bucket=2)
    batches = global_batches(world, 2)
    loss_of(wrapped, shard(batches[0], rank)).backward()
    loss_of(reference, batches[0]).backward()
    first_grads = (grads_of(wrapped), grads_of(reference))
    model[0].weight.requires_grad_(True)
    reference[0].weight.requires_grad_(True)
    errors = {}
    try:
        wrapped(torch.zeros(1, 6, dtype=torch.float64))
        errors["changed"] = None
    except RuntimeError as error:
        errors["changed"] = str(error)
    again = FusedDataParallel(wrapped.module, bucket_mb=None, max_params_per_bucket=2)
    try:
        wrapped(torch.zeros(1, 6, dtype=torch.float64))
        errors["retired"] = None
    except RuntimeError as error:
        errors["retired"] = str(error)
    again.zero_grad()
    reference.zero_grad()
    loss_of(again, shard(batches[1], rank)).backward()
    loss_of(reference, batches[1]).backward()
    # An optimizer over part of the model, made before wrapping, owns a FlatParams of other parameters.
    other = net()
    partial_optimizer = FusedAdam(list(other.parameters())[:2], lr=0.1)  # kept alive: it holds its FlatParams
    try:
        FusedDataParallel(other)
        errors["partial"] = None
    except ValueError as error:
        errors["partial"] = str(error)
    del partial_optimizer
    return {"first": first_grads, "second": (grads_of(again), grads_of(reference)), "errors": errors,
            "same_flat": again.flat is wrapped.flat}


def killed_rank(rank: int, world: int) -> dict:
    """The last rank dies in the middle of training; the others must raise, not hang."""
    wrapped = FusedDataParallel(rank_net(rank), bucket_mb=None, max_params_per_bucket=2)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step, batch in enumerate(global_batches(world, 4)):
        if step == 2 and rank == world - 1:
            os._exit(17)  # no clean-up, like a crash
        opt.zero_grad()
        loss_of(wrapped, shard(batch, rank)).backward()
        opt.step()
    return {"finished": True}


def stalled_rank(rank: int, world: int) -> dict:
    """The last rank stalls; the others must raise once the process group's timeout expires."""
    wrapped = FusedDataParallel(rank_net(rank), bucket_mb=None, max_params_per_bucket=2)
    for step, batch in enumerate(global_batches(world, 3)):
        if step == 1 and rank == world - 1:
            time.sleep(600)  # killed by the test harness
        wrapped.zero_grad()
        loss_of(wrapped, shard(batch, rank)).backward()
    return {"finished": True}


def conv_net(channels_last: bool = False) -> torch.nn.Module:
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(4, 3, 1), torch.nn.Flatten(),
        torch.nn.Linear(3 * 2 * 2, 3),
    ).double()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def image_batches(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(99)
    return [(torch.randn(world * BATCH, 3, 2, 2, generator=generator, dtype=torch.float64),
             torch.randn(world * BATCH, 3, generator=generator, dtype=torch.float64)) for _ in range(steps)]


def _train_pair(fdp_side, ddp_side, batches, rank) -> None:
    """One step per batch on each (model, optimizer) side, each on this rank's shard."""
    for batch in batches:
        for model, opt in (fdp_side, ddp_side):
            opt.zero_grad()
            loss_of(model, shard(batch, rank)).backward()
            opt.step()


def storage(rank: int, world: int) -> dict:
    """Replaced storage under FusedDataParallel: taken back (trains like DDP), refused before any collective,
    memory formats kept and checked across ranks."""
    out = {}
    # .data = new values on every rank: the wrapper's forward takes them back; training matches DDP.
    wrapped = FusedDataParallel(conv_net(), bucket_mb=None, max_params_per_bucket=2)
    ddp = DDP(conv_net())
    fused = FusedMomentum(wrapped.parameters(), lr=0.05)
    plain = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    batches = image_batches(world, 4)
    _train_pair((wrapped, fused), (ddp, plain), batches[:2], rank)
    values = torch.randn(wrapped.module[2].weight.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    wrapped.module[2].weight.data = values.clone()
    ddp.module[2].weight.data = values.clone()
    _train_pair((wrapped, fused), (ddp, plain), batches[2:], rank)
    (buffer,) = wrapped.flat.param_buffers
    offset = (wrapped.module[2].weight.data_ptr() - buffer.data_ptr()) // buffer.element_size()
    out["replaced"] = {"fdp": params_of(wrapped), "ddp": params_of(ddp), "in_flat": 0 <= offset < buffer.numel()}
    # model.double() after wrapping (here: float32 -> float64): the same error on every rank, from forward,
    # before any collective; the group is still usable afterwards.
    single = FusedDataParallel(net().float(), bucket_mb=None)
    single.module.double()
    with recorded_all_reduces() as calls:
        try:
            single(torch.zeros(2, 6, dtype=torch.float64))
            out["double_error"] = None
        except RuntimeError as error:
            out["double_error"] = str(error)
    out["double_calls"] = len(calls)
    dist.barrier()
    # A channels_last model stays channels_last and trains like DDP.
    last = FusedDataParallel(conv_net(channels_last=True), bucket_mb=None)
    ddp_last = DDP(conv_net(channels_last=True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (last, ddp_last)]
    for batch in image_batches(world, 2):
        x, y = shard(batch, rank)
        x = x.contiguous(memory_format=torch.channels_last)
        for model, opt in zip((last, ddp_last), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    out["channels_last"] = {"fdp": params_of(last), "ddp": params_of(ddp_last),
                            "strides": [p.stride() for p in last.parameters()],
                            "ddp_strides": [p.stride() for p in ddp_last.parameters()]}
    # One rank converts its memory format, the others do not: refused at wrapping, on every rank.
    try:
        FusedDataParallel(conv_net(channels_last=rank == world - 1), bucket_mb=None)
        out["format_mismatch"] = None
    except RuntimeError as error:
        out["format_mismatch"] = str(error)
    dist.barrier()
    return out


def copies(rank: int, world: int) -> dict:
    """deepcopy and pickling of a wrapper, like DDP's: the copy trains on its own, the original is untouched."""
    import io

    out = {}
    batches = global_batches(world, 4)
    wrapped = FusedDataParallel(rank_net(rank), bucket_mb=None, max_params_per_bucket=2)
    ddp = DDP(reference_net())
    opts = (torch.optim.SGD(wrapped.parameters(), lr=0.1), torch.optim.SGD(ddp.parameters(), lr=0.1))
    _train_pair((wrapped, opts[0]), (ddp, opts[1]), batches[:1], rank)
    before = params_of(wrapped)
    clone = copy.deepcopy(wrapped)
    ddp_clone = copy.deepcopy(ddp)
    out["clone_is_fdp"] = type(clone) is FusedDataParallel and clone.flat is not wrapped.flat
    out["clone_params_in_clone_flat"] = all(flat_params_of(p) is clone.flat for p in clone.parameters())
    clone_opts = (torch.optim.SGD(clone.parameters(), lr=0.1), torch.optim.SGD(ddp_clone.parameters(), lr=0.1))
    with recorded_all_reduces() as calls:
        _train_pair((clone, clone_opts[0]), (ddp_clone, clone_opts[1]), batches[1:3], rank)
    out["clone_calls"] = len(calls)
    out["clone"] = {"fdp": params_of(clone), "ddp": params_of(ddp_clone)}
    out["original_untouched"] = all(torch.equal(a, b) for a, b in zip(params_of(wrapped), before))
    _train_pair((wrapped, opts[0]), (ddp, opts[1]), batches[3:], rank)  # the original still trains
    out["original"] = {"fdp": params_of(wrapped), "ddp": params_of(ddp)}
    # torch.save / torch.load of the whole wrapper, as DDP allows it with the default group.
    stream = io.BytesIO()
    torch.save(wrapped, stream)
    pickled = stream.getvalue()
    loaded = torch.load(io.BytesIO(pickled), weights_only=False)
    loaded_opt = torch.optim.SGD(loaded.parameters(), lr=0.1)
    ddp_loaded = copy.deepcopy(ddp)
    ddp_opt = torch.optim.SGD(ddp_loaded.parameters(), lr=0.1)
    _train_pair((loaded, loaded_opt), (ddp_loaded, ddp_opt), batches[:2], rank)
    out["loaded"] = {"fdp": params_of(loaded), "ddp": params_of(ddp_loaded)}
    out["loaded_in_own_flat"] = all(flat_params_of(p) is loaded.flat for p in loaded.parameters()) and loaded.flat is not wrapped.flat
    stream = io.BytesIO()
    torch.save(ddp, stream)
    out["ddp_pickles"] = len(stream.getvalue()) > 0
    out["pickled"] = pickled if rank == 0 else None
    # A wrapper over another process group cannot be pickled (DDP refuses too).
    group = dist.new_group(list(range(world)))
    other = FusedDataParallel(net(), bucket_mb=None, process_group=group)
    try:
        copy.deepcopy(other)
        out["group_error"] = None
    except RuntimeError as error:
        out["group_error"] = str(error)
    # One layer's state_dict serialises its own elements only.
    big = FusedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]), bucket_mb=None)
    stream = io.BytesIO()
    torch.save(big.module[1].state_dict(), stream)
    plain = io.BytesIO()
    torch.save(torch.nn.Linear(64, 64).state_dict(), plain)
    out["one_layer_bytes"] = (len(stream.getvalue()), len(plain.getvalue()))
    dist.barrier()
    return out


def one_parameter(rank: int, world: int) -> dict:
    """Singular nouns in the fusion log line and the repr."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("tfuse.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        wrapped = FusedDataParallel(torch.nn.Linear(6, 3, bias=False).double(), bucket_mb=None)
    finally:
        logger.removeHandler(handler)
    with torch.device("meta"):
        on_meta = torch.nn.Linear(6, 3)
    try:
        FusedDataParallel(on_meta)
        meta_error = None
    except ValueError as error:
        meta_error = str(error)
    return {"log": records, "repr": repr(wrapped), "flat": repr(wrapped.flat), "meta_error": meta_error}


def compiled(rank: int, world: int) -> dict:
    """torch.compile around the wrapped module, and around the wrapper: both train like DDP."""
    out = {}
    for where in ("inner", "outer"):
        if where == "inner":
            wrapped = FusedDataParallel(torch.compile(conv_net(), fullgraph=True))
            model = wrapped
        else:
            wrapped = FusedDataParallel(conv_net())
            model = torch.compile(wrapped)
        ddp = DDP(conv_net())
        fused = FusedMomentum(wrapped.parameters(), lr=0.05)
        plain = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        _train_pair((model, fused), (ddp, plain), image_batches(world, 3), rank)
        out[where] = {"fdp": params_of(wrapped), "ddp": params_of(ddp)}
    return out


SUITE = {
    "train_sgd": train,
    "train_fused_adam": lambda rank, world: train(rank, world, optimizer="fused_adam"),
    "gradient_merge": gradient_merge,
    "no_sync": no_sync,
    "unused_parameters": unused_parameters,
    "mismatch": mismatch,
    "hook_order": hook_order,
    "dtypes": dtypes,
    "buffers": buffers,
    "rewrap": rewrap,
    "storage": storage,
    "copies": copies,
    "one_parameter": one_parameter,
    "compiled": compiled,
}


def run_suite(rank: int, world: int, names: list[str]) -> dict:
    """Runs the named scenarios one after another in one process group (ranks start once)."""
    return run_named(SUITE, rank, world, names, barrier=False)
