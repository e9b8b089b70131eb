"""All-reduce of gradient buckets during backward, in a fixed order on every rank.

The reducer is the gradient receiver of a :class:`~tfuse.flat.FlatParams`
(:meth:`~tfuse.flat.FlatParams.set_grad_receiver`): in backward, the
FlatParams' one pre-accumulation hook per parameter, the one that attaches
the parameter's view of the flat buffer, announces each parameter just before
autograd adds its gradient into that view in place (nothing is copied).
Autograd runs one device's nodes one at a time, so an announcement means the
parameter announced before it is complete: the reducer marks that one ready
(bringing a gradient set by hand, living elsewhere, into its slot first), and
the last one when backward ends. No hook runs after accumulation. When every
parameter of a bucket is ready, the bucket is divided by the averaging
divisor (one op per bucket, before the sum so that float16/bfloat16 sums stay
in range) and issued with ``async_op=True``, strictly in bucket order (a
bucket that fills early waits for the ones before it), so every rank issues
the same collectives in the same order whatever order its hooks fire in. A
callback queued on the autograd engine runs when backward ends: it marks the
last parameter ready, issues what is left, waits for every all-reduce and
checks that every parameter got a gradient.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tfuse.distributed._overlap import OverlappedStep
from tfuse.distributed._shard_comm import global_rank
from tfuse.flat import Bucket, FlatParams, GradHome

logger = logging.getLogger(__name__)

_MAX_NAMES = 10


class GradientReducer:
    """Averages the gradients of a FlatParams over a process group, bucket by bucket.

    Args:
        flat: the parameters and their flat gradient buffers; its
            :attr:`~tfuse.flat.FlatParams.buckets` are the all-reduce messages.
        names: a readable name per parameter, for error messages.
        group: the process group (None: the default group).
        merge_steps: backward passes accumulated locally before one all-reduce.
        merge_avg: divide the merged gradient by ``merge_steps`` as well.
        find_unused: parameters without a gradient contribute zeros instead of being an error.

    ``no_sync_depth`` is kept by the owning wrapper's ``no_sync()`` context,
    and the wrapper's forward calls :meth:`prepare_for_backward`: as in DDP,
    whether a backward pass all-reduces is decided by the forward before it.
    """

    def __init__(
        self,
        flat: FlatParams,
        names: dict[torch.nn.Parameter, str],
        group: dist.ProcessGroup | None,
        merge_steps: int,
        merge_avg: bool,
        find_unused: bool,
    ) -> None:
        self.flat = flat
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.merge_steps = merge_steps
        self.merge_avg = merge_avg
        self.find_unused = find_unused
        self._names = names
        self._owners: _Owners | None = None  # set by a ShardedOptimizer: reduce to shard owners, no all-reduce
        self.divisor = float(self.world_size * (merge_steps if merge_avg else 1))  # carried by each bucket record
        self._read_layout()
        self.no_sync_depth = 0
        self.forward_skipped = False
        self.merged_passes = 0
        self.synchronized = False
        self.allreduce_calls = 0  # issued by the last synchronizing backward
        self._reset_pass()
        self._in_backward = False
        self._syncing = False
        self.retired = False  # a newer reducer took the parameters over
        self.overlap: OverlappedStep | None = None  # steps the optimizer per bucket (FusedDataParallel.overlap_step)
        flat.set_grad_receiver(self.on_grad_arrival)  # (held weakly by the FlatParams)

    def _read_layout(self) -> None:
        """The bucket tables, from the FlatParams' current layout (and the owners' shards, if sharded)."""
        flat = self.flat
        self.layout_version = flat.layout_version
        # The FlatParams' buckets, each carrying this reducer's averaging divisor.
        self.buckets: tuple[Bucket, ...] = tuple(dataclasses.replace(b, divisor=self.divisor) for b in flat.buckets)
        self._regions = [bucket.grad for bucket in self.buckets]
        self._params = [p for bucket in self.buckets for p in bucket.params]
        self._bucket_of = {id(param): index for index, bucket in enumerate(self.buckets) for param in bucket.params}
        # id(param) -> (its bucket, its gradient view): what the per-gradient receiver reads
        self._homes = {id(p): (self._bucket_of[id(p)], flat._view(p)) for p in self._params}
        self._sizes = [len(bucket.params) for bucket in self.buckets]
        if self._owners is not None:
            self._owners.read_layout(flat, self.buckets, self.group)

    # ------------------------------------------------------------------ sharded mode

    @property
    def sharded_by(self):
        """The ShardedOptimizer gradients are reduced to (None: buckets are all-reduced)."""
        return None if self._owners is None else self._owners.optimizer()

    @property
    def owners(self) -> _Owners | None:
        """Sharded mode's shard tables and end-of-pass records (None: buckets are all-reduced)."""
        return self._owners

    @property
    def calls_per_step(self) -> int:
        """Gradient collectives per synchronizing backward: all-reduces, or reduces to owners when sharded."""
        if self._owners is None or self._owners.all_reduce:
            return len(self.buckets)
        return sum(len(pieces) for pieces in self._owners.pieces)

    @property
    def reduces_to_owners(self) -> bool:
        """Whether backward reduces buckets to shard owners (sharded mode with ``reduce`` other than all-reduce)."""
        return self._owners is not None and not self._owners.all_reduce

    def reduce_to_owners(self, optimizer: Any, all_reduce: bool = False) -> None:
        """Sharded mode: each bucket is reduced to the ranks that own its shards, instead of all-reduced.

        Called by :class:`~tfuse.distributed.ShardedOptimizer` once the flat
        buffers are padded for the world size. Afterwards a synchronizing
        backward leaves, on every rank, the averaged gradient in that rank's
        shards and zeros elsewhere. ``optimizer`` is held weakly: once it is
        gone, the next backward all-reduces again. With ``all_reduce`` the
        buckets are still all-reduced (every rank gets every averaged
        gradient; the optimizer then reduces nothing itself), for backends
        whose all-reduce beats their reduce.
        """
        if self._in_backward:
            raise RuntimeError("FusedDataParallel: cannot switch to sharded gradients in the middle of a backward pass")
        current = self.sharded_by
        if current is not None and current is not optimizer:
            raise RuntimeError(
                "FusedDataParallel: this model's gradients already go to the shards of another ShardedOptimizer; "
                "one ShardedOptimizer per wrapped model"
            )
        self._owners = _Owners(weakref.ref(optimizer), all_reduce)
        self._read_layout()
        calls = self.calls_per_step
        logger.log(
            logging.INFO if dist.get_rank(self.group) == 0 else logging.DEBUG,
            "FusedDataParallel: gradients %s during backward (%d %s call%s per step) for %s",
            "are all-reduced" if all_reduce else "are reduced to their shard owners, no all-reduce,",
            calls,
            "all-reduce" if all_reduce else "reduce",
            "" if calls == 1 else "s",
            type(optimizer).__name__,
        )

    def _check_owners(self) -> None:
        """At the start of a pass: a sharded mode whose optimizer is gone reverts to all-reduce."""
        if self._owners is not None and self._owners.optimizer() is None:
            self._owners = None
            logger.warning(
                "FusedDataParallel: its ShardedOptimizer was deleted; gradients are all-reduced again from this "
                "backward pass on"
            )

    # ------------------------------------------------------------------ lifecycle

    def remove_hooks(self) -> None:
        """Detaches the reducer from the parameters (a newer wrapper took them over)."""
        if self.flat.grad_receiver == self.on_grad_arrival:
            self.flat.set_grad_receiver(None)
        self.retired = True

    def prepare_for_backward(self) -> None:
        """Called by the wrapper's forward (grad enabled): decides whether the next backward may all-reduce.

        As in DDP, a forward run inside ``no_sync()`` makes its backward accumulate locally.
        """
        self.forward_skipped = self.no_sync_depth > 0

    def check_idle(self) -> None:
        """Raises if the last backward pass broke off after issuing collectives.

        Called by the wrapper's forward. A backward pass that raised before
        issuing anything is forgotten; one that raised after issuing an
        all-reduce leaves this rank out of step with the others.
        """
        if not self._in_backward:
            return
        issued = self._next
        self._in_backward = False
        self._reset_pass()
        if issued:
            total = len(self.buckets)
            raise RuntimeError(
                f"FusedDataParallel: the previous backward pass stopped (it raised) after issuing {issued} of "
                f"{total} gradient all-reduce{'' if total == 1 else 's'}; this rank is out of step with the others and "
                "cannot go on"
            )
        logger.warning("FusedDataParallel: the previous backward pass stopped before issuing any all-reduce; forgotten")

    def _reset_pass(self) -> None:
        self._ready_counts = [0] * len(self.buckets)
        self._seen: set[int] = set()  # id(param) of the gradients ready in this pass
        self._pending: torch.nn.Parameter | None = None  # announced, its accumulation maybe still running
        self._next = 0
        self._works: list = []

    # ------------------------------------------------------------------ backward

    def on_grad_arrival(self, param: torch.nn.Parameter) -> None:
        """Receiver body: autograd is about to accumulate ``param``'s gradient of this backward pass.

        In a pass that synchronizes, the parameter announced before it is
        complete now: it is marked ready (see :meth:`_mark_ready`); the last
        one is marked when backward ends. A pass that only accumulates does nothing.
        """
        if not self._in_backward:
            self._start_pass()
        if not self._syncing:
            return
        previous = self._pending
        self._pending = param
        if previous is None:
            return
        # _mark_ready's common case inline (one call per gradient): in its slot, announced once.
        key = id(previous)
        index, view = self._homes[key]
        seen = self._seen
        if previous.grad is not view or key in seen:
            self._mark_ready(previous)
            return
        seen.add(key)
        counts = self._ready_counts
        counts[index] += 1
        if index == self._next and counts[index] == self._sizes[index]:
            self._issue_ready()

    def _mark_ready(self, param: torch.nn.Parameter) -> None:
        """``param.grad`` is final for this pass: counts it, and issues every bucket whose turn has come."""
        key = id(param)
        index, view = self._homes[key]
        if param.grad is not view and self.flat.bring_home(param) is not GradHome.IN_BUFFER:
            return  # create_graph=True keeps the gradient (and its graph) outside until the end of backward
        if key in self._seen:
            raise RuntimeError(
                f"FusedDataParallel: parameter {self._names[param]!r} received its gradient twice in one backward "
                "pass (reentrant activation checkpointing? use torch.utils.checkpoint(..., use_reentrant=False))"
            )
        self._seen.add(key)
        counts = self._ready_counts
        counts[index] += 1
        if index == self._next and counts[index] == self._sizes[index]:
            self._issue_ready()

    def _issue_ready(self) -> None:
        """Issues every bucket, in order, whose gradients are all ready."""
        counts, sizes, total = self._ready_counts, self._sizes, len(self.buckets)
        while self._next < total and counts[self._next] == sizes[self._next]:
            self._issue(self._next)

    def _start_pass(self) -> None:
        if self.flat.layout_version != self.layout_version:
            raise RuntimeError(
                "FusedDataParallel: the parameters' flat layout changed after wrapping (requires_grad changed?); "
                "wrap the module again: model = FusedDataParallel(model.module, ...)"
            )
        self._check_owners()
        self._in_backward = True
        self._reset_pass()
        if not self.forward_skipped:
            self.merged_passes += 1
        self._syncing = not self.forward_skipped and self.merged_passes >= self.merge_steps
        self.synchronized = False
        if self._syncing and self.overlap is not None:
            self.overlap.start_pass(self.buckets, self.find_unused)
        # Runs once backward has finished every node; it waits for the all-reduces.
        torch.autograd.Variable._execution_engine.queue_callback(_make_finish(weakref.ref(self)))

    def _issue(self, index: int) -> None:
        region, divisor = self._regions[index], self.buckets[index].divisor
        if divisor != 1:
            # One op per bucket, before the sum so that float16/bfloat16 sums stay in range. (Slots of
            # parameters without a gradient hold zeros here: find_unused adopted them as zeros.)
            with torch.no_grad():
                region.div_(divisor)
        issued = len(self._works)
        if not self.reduces_to_owners:
            self._works.append(dist.all_reduce(region, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        else:
            for piece, owner in self._owners.pieces[index]:
                self._works.append(dist.reduce(piece, dst=owner, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        self._next = index + 1
        if self.overlap is not None:
            self.overlap.issued(index, self._works[issued:])

    def finish_pass(self) -> None:
        """End-of-backward callback: issues what is left, waits for everything, checks for missing gradients."""
        self._in_backward = False
        if not self._syncing:
            return
        last, self._pending = self._pending, None
        if last is not None:
            self._mark_ready(last)
        self.merged_passes = 0
        missing = []
        for index in range(self._next, len(self.buckets)):
            for param in self.buckets[index].params:
                if id(param) not in self._seen:
                    missing.append(param)
                    # It may still hold a gradient from an earlier merged pass (divided when issued); none: zeros.
                    self.flat.bring_home(param, final=True)
        for index in range(self._next, len(self.buckets)):
            self._issue(index)
        used_counts = self._all_reduce_used_flags() if self.find_unused else None
        for work in self._works:
            work.wait()
        self.allreduce_calls = len(self._works)
        self._reset_pass()
        if self.reduces_to_owners:
            self._owners.settle(self.group)
            self.flat.note_synchronized()  # a reduce leaves partial sums (zeroed) and maybe a NaN flag in slots
        if used_counts is not None:
            for param, count in zip(self._params, used_counts):
                if count > 0 and param.grad is None:
                    self.flat.bring_home(param, filled=True)  # used on another rank: it holds the average now
        elif missing:
            self.flat.note_synchronized(missing)  # their slots hold what the other ranks sent
            self._raise_missing(missing)
        self.synchronized = True
        if self.overlap is not None:
            self.overlap.finish_pass()

    def _all_reduce_used_flags(self) -> list[int]:
        flags = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32)
        device = self._regions[0].device
        on_device = flags.to(device)
        self._works.append(dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        self._works[-1].wait()
        return on_device.tolist()

    def _raise_missing(self, missing: Sequence[torch.nn.Parameter]) -> None:
        names = [repr(self._names[p]) for p in missing]
        shown = ", ".join(names[:_MAX_NAMES]) + (
            f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
        )
        raise RuntimeError(
            f"FusedDataParallel: {len(missing)} parameter{'' if len(missing) == 1 else 's'} received no gradient in "
            f"this backward pass: {shown}. "
            "If parts of the model are skipped in some iterations, pass find_unused_parameters=True (they then "
            "contribute zeros); otherwise make every parameter take part in the loss or set requires_grad=False. "
            "The all-reduces were completed with zeros for them so that other ranks do not hang."
        )


class _Owners:
    """Sharded mode of a reducer: which piece of each bucket goes to which owner, and the end-of-pass epilogue.

    A bucket (a contiguous range of a gradient buffer) meets one or a few
    shards; each intersection is reduced to that shard's owner. When every
    reduce has completed, :meth:`settle` zeroes the elements this rank does
    not own (they held partial sums) and makes a non-finite gradient seen by
    every rank, as an all-reduce would have (a NaN in one parameter element
    of each buffer): ``torch.amp.GradScaler`` then
    finds inf/NaN, skips the step and lowers its scale alike on every rank,
    so the ranks' scales never drift apart (the reduction summed gradients
    scaled by them).
    """

    def __init__(self, optimizer: weakref.ref, all_reduce: bool) -> None:
        self.optimizer = optimizer
        self.all_reduce = all_reduce  # buckets all-reduced (no pieces, nothing to settle)
        self.pieces: list[list[tuple[torch.Tensor, int]]] = []  # per bucket: (gradient view, owner's global rank)
        self._mine: list[torch.Tensor] = []  # this rank's shard of each gradient buffer
        self._others: list[torch.Tensor] = []  # the rest of each buffer's trainable (padded) range
        self._sentinels: list[torch.Tensor] = []  # one gradient element of a parameter per buffer (never padding)
        # Recorded when a reduction settles, read at step to see whether the shards were rescaled since (see
        # tfuse.distributed._sharded_clip): the buffers' version counters and the norm of this rank's shards.
        self._versions: list[int] = []
        self._norm: torch.Tensor | None = None
        self.eps = 0.0  # the machine epsilon of the least precise gradient buffer

    def read_layout(self, flat: FlatParams, buckets: Sequence[Bucket], group: dist.ProcessGroup | None) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        shards = flat.shards(world)  # (padded already: the ShardedOptimizer asked for these shards)
        with_grad = [index for index, g in enumerate(flat.groups) if g.grad is not None]
        self.pieces = []
        for bucket in buckets:
            buffer = with_grad[bucket.buffer_index]
            grad = flat.groups[buffer].grad
            self.pieces.append(
                [
                    (grad[max(s.start, bucket.start) : min(s.end, bucket.end)], global_rank(group, s.rank))
                    for s in shards[buffer]
                    if s.start < bucket.end and bucket.start < s.end
                ]
            )
        self._mine, self._others, self._sentinels = [], [], []
        self._norm, self.eps = None, 0.0
        for buffer in with_grad:
            grad, mine = flat.groups[buffer].grad, shards[buffer][rank]
            self._mine.append(grad[mine.start : mine.end])
            self.eps = max(self.eps, torch.finfo(grad.dtype).eps)
            self._others += [grad[: mine.start], grad[mine.end : shards[buffer][-1].end]]
            first = min(start for s in shards[buffer] for _, start, _ in s.ranges)
            self._sentinels.append(grad[first : first + 1])

    def settle(self, group: dist.ProcessGroup | None) -> None:
        others = [t for t in self._others if t.numel()]
        if others:
            torch._foreach_zero_(others)
        mine = [t for t in self._mine if t.numel()]
        device = (mine or others or [torch.empty(0)])[0].device
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for shard in mine:
            flag = torch.maximum(flag, (~torch.isfinite(shard)).any().float())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # one scalar; no host sync
        # One NaN in a parameter's gradient is enough for GradScaler (it checks them all); padding stays zero.
        poisoned = flag.bool()
        for sentinel in self._sentinels:
            sentinel.masked_fill_(poisoned, float("nan"))
        self._norm = _total_norm(mine)  # (one norm launch per step, on the device: no host sync)
        self._versions = [t._version for t in self._mine]

    def edited(self) -> bool:
        """Whether this rank's gradients were written in place since the last reduction settled."""
        return self._norm is not None and any(t._version != v for t, v in zip(self._mine, self._versions))

    def scale_since_settle(self) -> torch.Tensor | None:
        """Norm of this rank's shards now over their norm when the reduction settled (None: no finite nonzero norm).

        A float64 scalar on the device, or None (read on the host: only called once an edit was seen).
        """
        then = self._norm
        if then is None or not bool(torch.isfinite(then) & (then > 0)):
            return None
        return (_total_norm([t for t in self._mine if t.numel()]) / then).double()


def _total_norm(shards: list[torch.Tensor]) -> torch.Tensor | None:
    """The 2-norm of all ``shards`` together, in float32 (None: no shard)."""
    if not shards:
        return None
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in shards) else torch.float32
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(shards, 2, dtype=dtype)))


def reducer_of(flat: FlatParams) -> GradientReducer | None:
    """The live reducer that receives ``flat``'s gradients, if any."""
    receiver = flat.grad_receiver
    owner = getattr(receiver, "__self__", None)
    return owner if isinstance(owner, GradientReducer) else None


def _make_finish(reducer: weakref.ref):
    def finish() -> None:
        target = reducer()
        if target is not None:
            target.finish_pass()

    return finish
