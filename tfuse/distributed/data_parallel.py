"""FusedDataParallel: data-parallel training with bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tfuse.distributed._overlap import OverlappedStep
from tfuse.distributed._reducer import GradientReducer, reducer_of
from tfuse.distributed._replica_check import check_replicas_match, describe_replica
from tfuse.distributed._state_sync import broadcast_parameters, broadcast_tensors
from tfuse.distributed._wrapping import flat_params_for, parameter_names, plural, single_device, uses_default_group
from tfuse.flat import Bucket, FlatParams, register_compact_state_dict
from tfuse.optim import FlatOptimizer

logger = logging.getLogger(__name__)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# What a copy or a pickle does not keep: _build makes it again (or the process group: the default one).
_REBUILT = (
    "_flat_ref",
    "_reducer",
    "process_group",
    "_params",
    "_param_names",
    "_requires_grad",
    "_paused",
    "_submodules",
)


class FusedDataParallel(torch.nn.Module):
    """Data-parallel training with gradients all-reduced in a few fused buckets.

    Used like :class:`torch.nn.parallel.DistributedDataParallel`: every
    process (rank) wraps the same model, feeds it its own share of the batch,
    and after ``loss.backward()`` every rank holds the gradient averaged over
    all ranks. The parameters and gradients are coalesced into
    :class:`tfuse.flat.FlatParams` buffers, so gradients are views of the
    all-reduce buckets (no copies), and a tfuse optimizer created afterwards
    updates the same buffers (one flat buffer feeds both). Any
    ``torch.optim`` optimizer works as well.

    At construction every rank checks its layout (parameter names, shapes,
    dtypes, offsets, buckets, options, module buffers) against rank 0's with
    one small all-gather and raises the same error naming the first
    difference on every rank; then parameters and buffers are broadcast from
    rank 0.

    In backward, autograd accumulates each gradient in place into its slot of
    the flat buffer (nothing is copied, see :mod:`tfuse.flat`), and the
    FlatParams' pre-accumulation hook of each parameter, the only Python
    hook per parameter, tells the reducer, which marks the gradient before it
    ready; a bucket whose gradients are all ready is all-reduced
    asynchronously while backward goes on. Buckets are issued in the same
    order on every rank (a bucket that fills early waits for those before
    it), and the wrapper waits for all of them **at the end of backward**:
    when ``loss.backward()`` returns, the gradients are averaged and the
    optimizer can step. Averaging divides each bucket by the world size
    *before* the sum (one op per bucket), so float16/bfloat16 sums do not
    overflow (at the cost of underflow for tiny values).

    Args:
        module: the model; all its parameters on one device (a GPU per process
            with NCCL, the CPU with gloo).
        bucket_mb: largest all-reduce message in MB (10**6 bytes); None: one
            bucket per flat buffer. Smaller buckets start earlier in backward,
            larger ones pay the per-call latency fewer times.
        max_params_per_bucket: most gradient tensors per bucket; None: no cap.
        process_group: the group to average over (None: the default group).
        broadcast_buffers: broadcast module buffers (e.g. batch-norm running
            statistics) from rank 0 at the start of every forward run with
            gradients enabled. Forwards under ``torch.no_grad()`` run without
            any collective, so evaluating on one rank alone is safe.
        gradient_merge_steps: accumulate gradients locally for this many
            backward passes, then all-reduce once (PaddlePaddle's gradient merge pass).
        gradient_merge_avg: divide the merged gradient by
            ``gradient_merge_steps`` too (an average over micro-batches).
        find_unused_parameters: parameters that get no gradient in a backward
            pass contribute zeros (a parameter unused on every rank keeps
            ``grad=None``, as with DDP); without it such parameters raise an
            error naming them. Buckets holding them are sent when backward ends.

    Attributes:
        flat: the :class:`~tfuse.flat.FlatParams` holding parameters and gradients.
        num_grad_tensors: gradient tensors per step (trainable parameters).
        num_allreduce_calls: all-reduce calls per step after fusion (buckets;
            0 in sharded mode, unless its optimizer asked for ``reduce="all_reduce"``).
        num_reduce_calls: in sharded mode (a :class:`~tfuse.distributed.ShardedOptimizer`
            over the wrapped model), reduce-to-owner calls per step: one per
            bucket and shard it meets, issued during backward.
        gradients_synchronized: True after a backward pass that averaged the
            gradients, False after one that only accumulated (``no_sync()``, or
            a gradient-merge step that is not the last).

    Example (``torchrun --nproc_per_node=2 train.py``)::

        device = tfuse.distributed.init_process_group_from_env()
        model = FusedDataParallel(build_model().to(device), bucket_mb=25)
        optimizer = tfuse.optim.FusedAdam(model.parameters(), lr=1e-3)
        for inputs, targets in loader:  # each rank its own shard
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()  # returns with gradients averaged over ranks
            optimizer.step()
            optimizer.zero_grad()

    With ``gradient_merge_steps=k``, step the optimizer when
    ``model.gradients_synchronized`` is True (every k-th backward).

    Parameters may not change ``requires_grad`` after wrapping (their flat
    layout is fixed); to freeze or unfreeze, wrap again:
    ``model = FusedDataParallel(model.module, ...)``. Nor may they change
    dtype, device or memory format (``model.double()``,
    ``model.to(memory_format=torch.channels_last)``): convert the model
    before wrapping; the next training forward raises a clear error on every
    rank, before any collective, if it was done after. A parameter whose
    storage is replaced with same-kind values (``layer.weight.data = t``) is
    taken back into the flat buffer by that forward (see
    :meth:`tfuse.flat.FlatParams.check_storage`).

    Copies: as with DDP, a wrapper that uses the default process group can be
    pickled (``torch.save(model)``) and deep-copied; the copy (or the loaded
    model) gets its own flat buffers and reducer over its own parameters, in
    the default process group, without any collective (the replicas were
    checked when the original was built). ``model.module.state_dict()`` (or
    any submodule's) serialises each parameter's own elements only.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_mb: float | None = 16,
        max_params_per_bucket: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        gradient_merge_steps: int = 1,
        gradient_merge_avg: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        _check_arguments(
            module,
            bucket_mb,
            max_params_per_bucket,
            process_group,
            gradient_merge_steps,
            gradient_merge_avg,
            broadcast_buffers,
            find_unused_parameters,
        )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FusedDataParallel: torch.distributed is not initialized; call torch.distributed.init_process_group "
                "(or tfuse.distributed.init_process_group_from_env under torchrun) before wrapping the model"
            )
        self.module = module
        self.bucket_mb = bucket_mb
        self.max_params_per_bucket = max_params_per_bucket
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.gradient_merge_steps = gradient_merge_steps
        self.gradient_merge_avg = gradient_merge_avg
        self.find_unused_parameters = find_unused_parameters
        self._sync_buffers_next = True  # whether the next training forward broadcasts buffers (see forward)
        self._build(synchronize=True)

    def _build(self, synchronize: bool) -> None:
        """Flat buffers, reducer and state-dict hooks for ``self.module``; with ``synchronize``, also the
        cross-rank model check and the broadcast of rank 0's parameters and buffers (collectives)."""
        module, process_group = self.module, self.process_group
        names = parameter_names(module)
        params = list(names)
        device = single_device(params, names)
        flat = flat_params_for(params, names, self.bucket_mb, self.max_params_per_bucket)
        self._flat_ref = flat  # a plain attribute: not a submodule, not in state_dict
        self._params = params
        self._param_names = [names[p] for p in params]
        self._requires_grad = [p.requires_grad for p in params]
        if synchronize:
            options = {
                "bucket_mb": self.bucket_mb,
                "max_params_per_bucket": self.max_params_per_bucket,
                "broadcast_buffers": self.broadcast_buffers,
                "gradient_merge_steps": self.gradient_merge_steps,
                "gradient_merge_avg": self.gradient_merge_avg,
                "find_unused_parameters": self.find_unused_parameters,
            }
            check_replicas_match(describe_replica(module, flat, names, options), process_group, device)
            broadcast_parameters(flat, process_group)
            broadcast_tensors(list(module.buffers()), process_group)
        # Wrapping the same parameters again (after changing requires_grad, say) retires the reducer attached now.
        previous = reducer_of(flat)
        if previous is not None:
            previous.remove_hooks()
        self._reducer = GradientReducer(
            flat, names, process_group, self.gradient_merge_steps, self.gradient_merge_avg, self.find_unused_parameters
        )
        register_compact_state_dict(module)
        # The module tree as wrapped (as DDP, which keeps its buffers from wrapping; the buffers themselves are
        # read at every forward, so a buffer assigned anew is the one broadcast): walking it per forward cost
        # ~60 us for 65 modules on a 2-core CPU.
        self._submodules = list(module.modules())
        self.num_grad_tensors = sum(len(bucket.params) for bucket in flat.buckets)
        rank = dist.get_rank(process_group)
        logger.log(
            logging.INFO if rank == 0 and synchronize else logging.DEBUG,
            "FusedDataParallel: %s, %s per step after fusion (bucket_mb=%s, max_params_per_bucket=%s); "
            "world size %d, %s",
            plural(self.num_grad_tensors, "gradient tensor"),
            plural(len(flat.buckets), "all-reduce call"),
            self.bucket_mb,
            self.max_params_per_bucket,
            dist.get_world_size(process_group),
            flat.describe(),
        )

    # ------------------------------------------------------------------ copies and pickling

    def __getstate__(self) -> dict[str, Any]:
        """What pickling and ``copy.deepcopy`` keep: the module and the options (as DDP, not the process group).

        Raises RuntimeError when the wrapper uses a process group other than
        the default one (a process group cannot be pickled; DDP raises too).
        """
        if not uses_default_group(self.process_group):
            raise RuntimeError(
                "FusedDataParallel: only a wrapper that uses the default process group (process_group=None) can be "
                "pickled or deep-copied, as with DDP; a process group cannot be pickled. Save model.module (or its "
                "state_dict) instead"
            )
        state = dict(self.__dict__)
        for key in _REBUILT:
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuilds flat buffers and reducer over the (copied or loaded) module, in the default process group.

        No collective runs: every rank may load or copy on its own.
        """
        super().__setstate__(state)
        self.process_group = None
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FusedDataParallel: unpickling or deep-copying a FusedDataParallel needs torch.distributed initialized "
                "(its reducer joins the default process group), as with DDP; call torch.distributed.init_process_group "
                "first, or save and load model.module (or its state_dict) instead"
            )
        self._build(synchronize=False)

    # ------------------------------------------------------------------ properties

    @property
    def flat(self) -> FlatParams:
        """The flat buffers holding the parameters and their gradients."""
        return self._flat_ref

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The all-reduce buckets, in the order they are issued."""
        return self._reducer.buckets

    @property
    def num_allreduce_calls(self) -> int:
        """All-reduce calls per synchronizing backward (one per bucket; 0 when a ShardedOptimizer took it over)."""
        return 0 if self._reducer.reduces_to_owners else len(self._reducer.buckets)

    @property
    def num_reduce_calls(self) -> int:
        """Reduce-to-owner calls per synchronizing backward in sharded mode (0 otherwise)."""
        return self._reducer.calls_per_step if self._reducer.reduces_to_owners else 0

    @property
    def communication(self) -> str:
        """What the next backward does with the gradients: ``"all_reduce"``, ``"local"`` (inside ``no_sync()``,
        or LocalSGD's local phase), ``"sharded"`` (reduced to a ShardedOptimizer's owners) or ``"overlapped"``
        (all-reduced, the optimizer stepped per bucket: :meth:`overlap_step`)."""
        reducer = self._reducer
        if reducer.no_sync_depth:
            return "local"
        if reducer.sharded_by is not None:
            return "sharded"
        return "all_reduce" if reducer.overlap is None or reducer.overlap.mode == "off" else "overlapped"

    @property
    def gradients_synchronized(self) -> bool:
        """Whether the last backward pass averaged the gradients over the ranks."""
        return self._reducer.synchronized

    # ------------------------------------------------------------------ training

    def overlap_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Steps ``optimizer`` bucket by bucket during backward, each bucket as soon as its all-reduce has landed.

        The update of the first buckets then runs while later buckets are
        still being computed and all-reduced, instead of after the whole
        backward; ``optimizer.step()`` afterwards steps only what is left
        (parameters outside this wrapper). The parameters, state and
        ``state_dict`` after each step are bit for bit those of the plain
        step. Call ``optimizer.step()`` after every synchronizing backward,
        as usual; LR schedulers, ``no_sync()`` and gradient merge work as
        without overlap. The first iteration is stepped plainly and decides:
        under a GradScaler the step waits for the whole backward (an inf/NaN
        in a late bucket must skip every bucket), and gradients edited
        between backward and ``step()`` (a global-norm clip) raise
        RuntimeError, since the update ran before the edit (see
        :mod:`tfuse.distributed._overlap`). ``None`` turns the overlap off.

        Args:
            optimizer: a tfuse fused optimizer over this wrapper's parameters
                (built from ``model.parameters()``, not capturable), or the
                :class:`~tfuse.distributed.ShardedOptimizer` of this wrapper:
                each owner steps its shard of a bucket when the bucket's
                reduce lands, and the updated shards are gathered when
                backward ends.

        Example (on each rank)::

            model = FusedDataParallel(net, bucket_mb=25)
            optimizer = tfuse.optim.FusedAdamW(model.parameters(), lr=1e-3)
            model.overlap_step(optimizer)
            loss_fn(model(x), y).backward()  # steps each bucket as its all-reduce lands
            optimizer.step()  # the rest (here nothing)
            optimizer.zero_grad()
        """
        from tfuse.distributed.sharded import ShardedOptimizer  # (it imports this module)

        reducer = self._reducer
        if reducer.overlap is not None:
            reducer.overlap.remove()
            reducer.overlap = None
        if optimizer is None:
            return
        sharded = isinstance(optimizer, ShardedOptimizer)
        if not (sharded or isinstance(optimizer, FlatOptimizer)):
            raise TypeError(
                "FusedDataParallel.overlap_step: optimizer must be a tfuse fused optimizer (FusedSGD, FusedMomentum, "
                f"FusedAdam, FusedAdamW) or a ShardedOptimizer, got {type(optimizer).__name__}"
            )
        if not sharded and optimizer.capturable:
            raise ValueError(
                "FusedDataParallel.overlap_step: a capturable optimizer steps from device-side step counts inside a "
                "captured graph; capture the whole step instead (tfuse.capture_step), or pass capturable=False"
            )
        if reducer.sharded_by is not (optimizer if sharded else None):
            raise ValueError(
                "FusedDataParallel.overlap_step: this model's gradients are reduced to the shards of "
                f"{'another' if sharded else 'a'} ShardedOptimizer; overlap that optimizer's step"
                if reducer.sharded_by is not None
                else "FusedDataParallel.overlap_step: this ShardedOptimizer does not shard this wrapper's parameters"
            )
        if not any(span.flat is self.flat for span in optimizer.spans):
            raise ValueError(
                "FusedDataParallel.overlap_step: the optimizer holds none of this wrapper's parameters; build it "
                "from model.parameters() after wrapping"
            )
        reducer.overlap = OverlappedStep(self.flat, optimizer, finish=optimizer.gather_ahead if sharded else None)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module; with gradients on, first checks the parameters and broadcasts rank 0's buffers.

        The check (before any collective): parameters whose storage was
        replaced are taken back into the flat buffers, or a clear error is
        raised (see :meth:`tfuse.flat.FlatParams.check_storage`), and
        ``requires_grad`` must not have changed since wrapping.
        """
        if self._reducer.retired:
            raise RuntimeError(
                "FusedDataParallel: this wrapper was replaced by a newer FusedDataParallel of the same parameters; "
                "use the new one"
            )
        if torch.is_grad_enabled():
            self.flat.check_storage()
            self._check_requires_grad()
            self._reducer.check_idle()
            self._reducer.prepare_for_backward()
            # DDP's rule: buffers are broadcast before a training forward that follows one whose backward
            # all-reduced (not one run inside no_sync(): during gradient accumulation each rank keeps its own
            # statistics until the synchronising step). Unlike DDP, a forward without gradients (evaluation)
            # broadcasts nothing: evaluating on one rank only does not hang.
            if self.broadcast_buffers and self._sync_buffers_next and not getattr(self, "_paused", False):
                buffers = self._module_buffers()
                if buffers:
                    broadcast_tensors(buffers, self.process_group)
            self._sync_buffers_next = self._reducer.no_sync_depth == 0
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes whose forward runs inside only accumulate gradients locally.

        As with DDP, the forward decides: run the forward inside the context
        (the backward may be inside or after it); the first backward of a
        forward outside the context all-reduces the accumulated gradients. Passes inside do
        not count toward ``gradient_merge_steps`` and are not divided by it.

        Example::

            with model.no_sync():
                loss_fn(model(x1), y1).backward()  # local only
            loss_fn(model(x2), y2).backward()  # all-reduces the sum of both
        """
        self._reducer.no_sync_depth += 1
        try:
            yield
        finally:
            self._reducer.no_sync_depth -= 1

    def _pause_communication(self, paused: bool) -> None:
        """LocalSGD's local phase: backward passes accumulate locally (as inside ``no_sync()``) and
        forward broadcasts no buffers; LocalSGD averages parameters and buffers at its syncs instead."""
        if paused == getattr(self, "_paused", False):
            return
        self._paused = paused
        self._reducer.no_sync_depth += 1 if paused else -1

    def _module_buffers(self) -> list[torch.Tensor]:
        """The wrapped module's buffers, in ``module.buffers()`` order, each once."""
        buffers = [b for m in self._submodules for b in m._buffers.values() if b is not None]
        return list({id(b): b for b in buffers}.values()) if len(buffers) > 1 else buffers

    def _check_requires_grad(self) -> None:
        if list(map(_REQUIRES_GRAD, self._params)) == self._requires_grad:  # (vectorised: every training forward)
            return
        changed = [
            self._param_names[i] for i, p in enumerate(self._params) if p.requires_grad != self._requires_grad[i]
        ]
        raise RuntimeError(
            f"FusedDataParallel: requires_grad changed after wrapping for {', '.join(repr(n) for n in changed[:10])}"
            f"{' and more' if len(changed) > 10 else ''}; the flat gradient layout is fixed at wrapping, so wrap "
            "again: model = FusedDataParallel(model.module, ...)"
        )

    def extra_repr(self) -> str:
        return (
            f"{plural(self.num_grad_tensors, 'gradient tensor')} in "
            f"{plural(self.num_allreduce_calls, 'all-reduce bucket')}, "
            f"gradient_merge_steps={self.gradient_merge_steps}, find_unused_parameters={self.find_unused_parameters}"
        )


def _check_arguments(
    module: Any,
    bucket_mb: Any,
    max_params: Any,
    process_group: Any,
    merge_steps: Any,
    merge_avg: Any,
    broadcast_buffers: Any,
    find_unused: Any,
) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"FusedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, FusedDataParallel):
        raise TypeError("FusedDataParallel: the module is already a FusedDataParallel; wrap its .module instead")
    if bucket_mb is not None and (
        isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0
    ):
        raise ValueError(f"FusedDataParallel: bucket_mb must be a positive number or None, got {bucket_mb!r}")
    if max_params is not None and (isinstance(max_params, bool) or not isinstance(max_params, int) or max_params < 1):
        raise ValueError(f"FusedDataParallel: max_params_per_bucket must be a positive int or None, got {max_params!r}")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"FusedDataParallel: process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    if isinstance(merge_steps, bool) or not isinstance(merge_steps, int) or merge_steps < 1:
        raise ValueError(f"FusedDataParallel: gradient_merge_steps must be a positive int, got {merge_steps!r}")
    for name, value in (
        ("gradient_merge_avg", merge_avg),
        ("broadcast_buffers", broadcast_buffers),
        ("find_unused_parameters", find_unused),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"FusedDataParallel: {name} must be a bool, got {value!r}")
