"""ShardedOptimizer: a fused optimizer whose state is split across ranks (ZeRO stage 1).

Every flat parameter buffer is cut into world-size equal, aligned shards
(:meth:`tfuse.flat.FlatParams.shards`); rank ``r`` owns shard ``r`` of each
buffer and keeps optimizer state for those elements only, so state memory
per rank is about ``1/world_size`` of the unsharded optimizer's. A step:

1. ranks agree which parameters have a gradient (one small all-reduce);
2. each gradient buffer is averaged into its owners (divided by the world
   size, then a reduce-scatter on NCCL, one reduce per shard elsewhere);
3. each owner steps its shard with the span engine
   (:class:`tfuse.optim.span.SpanStepper`), the same step the unsharded
   optimizer runs over whole buffers; a parameter straddling two shards is
   updated piecewise by both owners (LAMB, LARS: with its norms summed over both). FusedMuon orthogonalises
   whole matrices: its buffers are laid out in shards of whole parameters (consecutive parameters per rank,
   balanced by size, each shard padded to the largest), so no matrix is split and no collective is added;
4. every buffer's updated shards are gathered back into every rank's
   parameter buffer (one all-gather per buffer), in the same order everywhere.

Checkpoints are in :mod:`tfuse.distributed._sharded_state_dict`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tfuse.distributed import _sharded_state_dict as checkpoint
from tfuse.distributed._checks import require_process_group
from tfuse.distributed._reducer import GradientReducer, reducer_of
from tfuse.distributed._replica_check import check_replicas_match, describe_replica
from tfuse.distributed._shard_comm import check_modes, gather_from_owners, reduce_to_owners, resolve_modes, sums_group
from tfuse.distributed._sharded_buffer import ShardedBuffer, not_ahead, one_per_buffer
from tfuse.distributed._sharded_clip import check_grad_edits, clip_sharded
from tfuse.distributed._wrapping import uses_default_group
from tfuse.distributed.data_parallel import FusedDataParallel
from tfuse.flat import FlatParams
from tfuse.optim import FlatOptimizer
from tfuse.optim.span import SpanMember, SpanStepper, closure_and_amp

logger = logging.getLogger(__name__)


class ShardedOptimizer(torch.optim.Optimizer):
    """A tfuse fused optimizer whose state and update work are split across ranks (ZeRO stage 1).

    Shaped like torch's ``ZeroRedundancyOptimizer``: give it the parameters,
    the fused optimizer class and that class's arguments. Every rank must
    hold the same model (same values; e.g. build it from the same seed or
    broadcast it) and call :meth:`step` together.

    Args:
        params: parameters or parameter groups, as for torch.optim, or a
            :class:`~tfuse.flat.FlatParams` (e.g. ``FusedDataParallel.flat``).
        optimizer_class: a tfuse fused optimizer class (FusedSGD, FusedMomentum, FusedAdam, FusedAdamW,
            FusedAdagrad, FusedLion, FusedLAMB, FusedLARS, FusedMuon; LAMB's and LARS's per-parameter norms
            are summed across the ranks, one small all-reduce per step on a process group of their own;
            FusedMuon's buffers are cut into shards of whole parameters, each matrix orthogonalised by its owner).
        process_group: the ranks to shard over (None: the default group).
        reduce: how gradients reach their owners: ``"auto"`` (reduce-scatter
            on NCCL, one reduce per shard elsewhere), ``"reduce_scatter"``,
            ``"reduce"`` or ``"all_reduce"``. Under FusedDataParallel the
            wrapper reduces each bucket to its owners in backward (one reduce
            per bucket and shard it meets, for ``reduce_scatter`` too), or
            all-reduces its buckets with ``"all_reduce"``.
        gather: how updated parameters come back: ``"auto"`` (one all-gather
            per buffer on NCCL, one broadcast per shard elsewhere: faster on
            gloo), ``"all_gather"`` or ``"broadcast"``.
        **defaults: the optimizer class's arguments (``lr``, ``betas``, ...).

    How gradients reach the owners (on a plain model, or during backward
    under :class:`~tfuse.distributed.FusedDataParallel`, which the optimizer
    puts into sharded mode), clipping, GradScaler and master weights are
    described in docs/architecture.md ("ShardedOptimizer").

    Example (on each of ``world_size`` ranks, after ``dist.init_process_group``):
        >>> import torch
        >>> from tfuse.distributed import ShardedOptimizer
        >>> from tfuse.optim import FusedAdam
        >>> torch.manual_seed(0); model = torch.nn.Linear(4, 2)  # doctest: +SKIP
        >>> optimizer = ShardedOptimizer(model.parameters(), FusedAdam, lr=1e-3)  # doctest: +SKIP
        >>> model(torch.randn(8, 4)).sum().backward()  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
        >>> optimizer.state_bytes()  # this rank's share of the Adam moments  # doctest: +SKIP
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf

    def __init__(
        self,
        params: Any,
        optimizer_class: type[FlatOptimizer],
        process_group: dist.ProcessGroup | None = None,
        *,
        reduce: str = "auto",
        gather: str = "auto",
        **defaults: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, FlatOptimizer)):
            raise TypeError(
                "ShardedOptimizer: optimizer_class must be a tfuse fused optimizer class (FusedSGD, FusedMomentum, "
                "FusedAdam, FusedAdamW, FusedAdagrad, FusedLion, FusedLAMB, FusedLARS, FusedMuon), got "
                f"{optimizer_class!r}"
            )
        check_modes(reduce, gather)
        if defaults.get("capturable"):
            raise ValueError(
                "ShardedOptimizer: capturable=True is not supported: the sharded step agrees on GradScaler's "
                "found_inf and on which gradients exist across ranks with collectives driven by the host, so it "
                "cannot be captured in a CUDA graph. Pass capturable=False (the default)."
            )
        require_process_group("ShardedOptimizer", process_group)
        self.process_group = process_group
        self.reduce_mode, self.gather_mode = resolve_modes(reduce, gather, process_group)
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ValueError("ShardedOptimizer: this process is not a member of process_group")
        self.world_size = dist.get_world_size(process_group)
        self._sums_group: dist.ProcessGroup | None = None  # (LAMB, LARS: see sums_group)
        if isinstance(params, FusedDataParallel):
            params = params.flat
        # The fused optimizer checks the arguments, binds the parameters to flat buffers, holds the groups and
        # is the update rule of the shards' span engines; its own whole-buffer spans never step, so they
        # allocate no state (state is created at a parameter's first step).
        with FlatOptimizer.as_update_rule():
            self.optim = optimizer_class(params, **defaults)
        self._constructing = True
        super().__init__(self.optim.param_groups, self.optim.defaults)
        self._constructing = False
        self.param_groups = self.optim.param_groups  # one set of groups: LR schedulers change the inner one
        self._check_replicas(optimizer_class)
        self._buffers = self._shard_buffers()
        if self.optim.creates_state_eagerly:  # (Adagrad) this rank's part of every parameter's state, now
            for buffer in self._buffers:
                buffer.span.start(list(buffer.span.members), self.param_groups)
        for flat in self.optim.flat_params:
            flat.set_sharded_by(self)  # tfuse.optim.clip_grad_norm_ on these parameters comes here
        self._layouts = [b.flat.layout_version for b in self._buffers]
        self._reducers = self._take_over_reducers()
        self._pending: list[tuple[bool, ...]] | None = None  # gradients already reduced (by clip_grad_norm_)
        self._ahead = 0  # members stepped by step_ahead since the last step (FusedDataParallel.overlap_step)
        logger.info(
            "ShardedOptimizer: %s over %d ranks, %d flat buffer(s), reduce=%s, gather=%s",
            optimizer_class.__name__,
            self.world_size,
            len(self._buffers),
            self.reduce_mode,
            self.gather_mode,
        )

    def _check_replicas(self, optimizer_class: type) -> None:
        """Every rank holds the same parameters in the same flat layout (before any collective: else a hang)."""
        options: dict[str, object] = {"optimizer": optimizer_class.__name__}
        for index, flat in enumerate(self.optim.flat_params):
            names = {p: flat.name_of(p) or f"#{i} of flat params {index}" for i, p in enumerate(flat.params)}
            device = flat.groups[0].device if flat.groups else torch.device("cpu")
            entries = describe_replica(None, flat, names, options)
            check_replicas_match(entries, self.process_group, device, owner="ShardedOptimizer")

    def _shard_buffers(self) -> list[ShardedBuffer]:
        """One ShardedBuffer per span of the optimizer (FusedMuon's two kinds in one buffer: two, sharing state)."""
        rules = {id(s): self.optim.rule_for(self.param_groups[s.members[0].group]) for s in self.optim.spans}
        whole_flats = {id(s.flat) for s in self.optim.spans if getattr(rules[id(s)].family, "whole_parameters", False)}
        for flat in self.optim.flat_params:
            # Pads (lays out again) first if the buffers do not split evenly yet, or into whole-parameter shards.
            flat.shards(self.world_size, whole_params=id(flat) in whole_flats)
        result, states = [], {}
        for whole in self.optim.spans:
            flat = whole.flat
            index = next(i for i, g in enumerate(flat.groups) if g.device == whole.device and g.dtype == whole.dtype)
            shards = flat.shards(self.world_size)[index]
            if not shards:
                continue  # no trainable parameter in this buffer: nothing to update
            mine, rule = shards[self.rank], rules[id(whole)]
            span = SpanStepper(
                flat,
                flat.groups[index],
                rule,
                span=(mine.start, mine.end),
                master_weights=whole.master_weights,
                state=states.get((id(flat), index)),
            )
            states[(id(flat), index)] = span.state
            span.set_members([SpanMember(m.param, m.group) for m in whole.members])
            if rule.family.per_parameter and rule.family.sums_across_ranks:  # (LAMB, LARS) split parameters' norms
                self._sums_group = self._sums_group or sums_group(self.process_group)
                span.reduce_sums = functools.partial(dist.all_reduce, group=self._sums_group)
            result.append(ShardedBuffer(span, index, shards, self.rank))
        return result

    def _take_over_reducers(self) -> list[GradientReducer]:
        """Puts the FusedDataParallel wrappers of these parameters into sharded mode (reduce to owners in backward).

        Their gradients then reach the owners while backward runs, and
        :meth:`step` reduces nothing. Refused when the wrapper averages over
        another process group, or when this optimizer does not hold all of
        the wrapper's trainable parameters (the others' gradients would only
        be complete on their owners).
        """
        reducers = []
        for flat in self.optim.flat_params:
            reducer = reducer_of(flat)
            if reducer is None or reducer.retired:
                continue
            same_group = reducer.group is self.process_group or (
                uses_default_group(reducer.group) and uses_default_group(self.process_group)
            )
            if not same_group:
                raise ValueError(
                    "ShardedOptimizer: the parameters are wrapped by a FusedDataParallel over another process group; "
                    "pass the same process_group to both"
                )
            mine = {id(m.param) for b in self._buffers for m in b.span.members}
            left = [p for p in flat.params if p.requires_grad and id(p) not in mine]
            if left:
                name = flat.name_of(left[0]) or f"a parameter of shape {tuple(left[0].shape)}"
                raise ValueError(
                    f"ShardedOptimizer: the FusedDataParallel wrapper of these parameters also holds {name!r} "
                    f"({len(left)} trainable parameter{'' if len(left) == 1 else 's'} in all) that this optimizer "
                    "does not; under FusedDataParallel a ShardedOptimizer takes all of the model's trainable "
                    "parameters (e.g. ShardedOptimizer(model.parameters(), ...)), since each rank ends backward "
                    "with the gradients of its shards only"
                )
            reducer.reduce_to_owners(self, all_reduce=self.reduce_mode == "all_reduce")
            reducers.append(reducer)
        return reducers

    def _sharded_backward(self) -> bool:
        """Whether a FusedDataParallel wrapper reduces the gradients to their owners during backward."""
        return any(reducer.sharded_by is self for reducer in self._reducers)

    def _reduced_by_backward(self, found_inf: torch.Tensor | None) -> tuple[list[tuple[bool, ...]], bool]:
        """Step set-up in sharded backward mode: which members have gradients, and whether to skip.

        Every rank holds the same set of gradients after a synchronizing
        backward (FusedDataParallel completed the missing ones or raised), and
        a non-finite gradient was made visible on every rank, so both answers
        agree across ranks without a collective.
        """
        self._check_layout()
        active = [tuple(m.param.grad is not None for m in b.span.members) for b in self._buffers]
        if any(any(on) for on in active):
            unsynced = [r for r in self._reducers if r.sharded_by is self and not r.synchronized]
            if unsynced:
                raise RuntimeError(
                    "ShardedOptimizer: the last backward pass did not reduce the gradients to their owners (it ran "
                    "inside no_sync() or was a gradient-merge micro-batch); step when model.gradients_synchronized "
                    "is True"
                )
        skip = found_inf is not None and bool(found_inf.detach().float().sum() > 0)
        return active, skip

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the shards are laid out once (create a new ShardedOptimizer)."""
        if getattr(self, "_constructing", False):
            super().add_param_group(param_group)
            return
        raise RuntimeError("ShardedOptimizer: add_param_group is not supported; create the optimizer with every group")

    @property
    def flat_params(self) -> tuple[FlatParams, ...]:
        """The FlatParams whose buffers are sharded."""
        return self.optim.flat_params

    @property
    def buffers(self) -> tuple[ShardedBuffer, ...]:
        """This rank's view of each sharded flat buffer: its shards and the span engine over its own shard."""
        return tuple(self._buffers)

    @property
    def sums_across_ranks(self) -> bool:
        """Whether a step sums per-parameter norms across the ranks (LAMB, LARS; FusedDataParallel's overlapped
        step then steps the buckets when backward ends, see tfuse.distributed._overlap)."""
        return any(b.span.reduce_sums is not None for b in self._buffers)

    @property
    def spans(self) -> tuple[SpanStepper, ...]:
        """The span engines stepping this rank's shard of each flat buffer."""
        return tuple(b.span for b in self._buffers)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its shards of the state buffers and of the float32 masters."""
        states = {id(b.span.state): b.span.state for b in self._buffers}.values()  # (FusedMuon's kinds share one)
        tensors = {id(t): t for state in states for t in (*state.buffers.values(), state.master) if t is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's ``Optimizer.zero_grad`` (one op per flat buffer)."""
        self._pending = None
        self.optim.zero_grad(set_to_none)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Reduces gradients to their owners, updates this rank's shards, gathers the parameters back.

        Args:
            closure: reevaluates the model and returns the loss (as in torch.optim).
        """
        loss, grad_scale, found_inf = closure_and_amp(self, closure)
        if self._pending is None and self._sharded_backward():
            # Reduced during backward, still scaled (every rank's GradScaler has the same scale): the update unscales.
            active, skip = self._reduced_by_backward(found_inf)
            check_grad_edits(self)  # a per-rank clip of the shards (torch's clip_grad_norm_) raises here
        elif self._pending is None:
            active, skip = self._reduce_grads(grad_scale, found_inf)
            grad_scale = None  # unscaled before the reduction
        else:  # clip_grad_norm_ reduced them already (after GradScaler.unscale_, grad_scale is None)
            active, skip = self._pending, found_inf is not None and self._agree_on_inf(found_inf)
        self._pending = None
        if skip:
            return loss  # inf/NaN in some rank's gradients: every rank skips the step, nothing changes
        if self._ahead:  # stepped and gathered during backward (every rank stepped the same members ahead)
            self._ahead = 0
            active = [not_ahead(b.span, on) for b, on in zip(self._buffers, active)]
        stepped = []
        for sharded, on in zip(self._buffers, active):
            if any(on):  # (agreed on every rank)
                self._update(sharded, on, grad_scale)
                stepped.append(sharded)
        self._gather(stepped)
        return loss

    def _gather(self, stepped: list[ShardedBuffer]) -> None:
        """Every rank's shards of the ``stepped`` buffers into every rank (once per flat buffer, in order)."""
        current = [(sharded.span, sharded.span.current_members()) for sharded in stepped]
        for sharded in one_per_buffer(stepped):  # the same buffers, in the same order, on every rank
            gather_from_owners(sharded.group.data, sharded.shards, self.gather_mode, self.process_group)
        for span, members in current:
            span.note_versions(members)  # the gather wrote the parameters, not the user

    def _reduce_grads(
        self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
    ) -> tuple[list[tuple[bool, ...]], bool]:
        """Averages every gradient buffer into its shards' owners.

        Returns which members have a gradient (per buffer), and whether some
        rank found inf/NaN (GradScaler's ``found_inf``; nothing is reduced then).
        Each rank divides out its own ``grad_scale`` before the sum, so ranks
        whose scalers drifted apart still add unscaled gradients.
        """
        for flat in self.flat_params:
            flat.sync_grads()
        self._check_layout()
        active, adopted, skip = self._agree_on_grads(found_inf)
        if skip:
            return active, True
        # No collective for a buffer where no parameter has a gradient on any rank (agreed).
        with_grads = [sharded for sharded, on in zip(self._buffers, active) if any(on)]
        for sharded in one_per_buffer(with_grads):
            grad = sharded.group.grad
            grad.div_(self.world_size)  # average: divide before summing, as DDP does
            if grad_scale is not None:
                grad.div_(grad_scale.to(grad.device, grad.dtype))
            reduce_to_owners(grad, sharded.shards, self.reduce_mode, self.process_group)
            sharded.flat.note_synchronized()  # the whole buffer was divided and reduced, slots without gradients too
        for sharded, missing in zip(self._buffers, adopted):
            for param in missing:
                # Its slot now holds the reduction's result, not zeros: the parameter gets it as its gradient
                # (as DDP gives an unused parameter the average), and FlatParams knows the slot is written.
                sharded.flat.bring_home(param, filled=True)
        return active, False

    def _agree_on_inf(self, found_inf: torch.Tensor) -> bool:
        """Whether any rank's GradScaler found inf/NaN (one scalar all-reduce)."""
        flag = (found_inf.detach().float().sum() > 0).to(torch.int32).reshape(1).cpu()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(flag.item())

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clips the averaged gradients by their total norm, as ``torch.nn.utils.clip_grad_norm_`` would.

        Call it on every rank between backward and :meth:`step`: it reduces
        the gradients to their owners now (:meth:`step` then does not again),
        each owner takes the norm of its shard, and one scalar all-reduce
        makes the total. Returns the total norm (of the averaged gradients).

        Example (every rank):
            >>> optimizer.clip_grad_norm_(1.0)  # doctest: +SKIP
            >>> optimizer.step()  # doctest: +SKIP
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"ShardedOptimizer.clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
        if self._pending is None and self._sharded_backward():
            self._pending, _ = self._reduced_by_backward(None)
        elif self._pending is None:
            self._pending, _ = self._reduce_grads()  # (no GradScaler flag here: step agrees on it)
        return clip_sharded(self, self._pending, max_norm, norm_type, error_if_nonfinite)

    def _check_layout(self) -> None:
        for sharded, version in zip(self._buffers, self._layouts):
            if sharded.flat.layout_version != version:
                raise RuntimeError(
                    "ShardedOptimizer: the flat buffers were laid out again (a parameter's requires_grad changed); "
                    "create a new ShardedOptimizer"
                )

    def _agree_on_grads(
        self, found_inf: torch.Tensor | None = None
    ) -> tuple[list[tuple[bool, ...]], list[list[torch.nn.Parameter]], bool]:
        """Per buffer, per member: whether the parameter has a gradient on some rank (one all-reduce).

        Also returns, per buffer, the parameters with a gradient elsewhere but not here (their slots
        are zeroed, so that this rank adds nothing), and whether some rank found inf/NaN (the same
        all-reduce carries the flag).
        """
        local = [p.grad is not None for b in self._buffers for p in b.span.params]
        inf = found_inf is not None and bool(found_inf.detach().float().sum() > 0)
        flags = torch.tensor([*local, inf], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        agreed = flags.bool().tolist()
        skip = agreed.pop()
        result: list[tuple[bool, ...]] = []
        adopted: list[list[torch.nn.Parameter]] = []
        at = 0
        for sharded in self._buffers:
            members = sharded.span.members
            on = tuple(agreed[at : at + len(members)])
            here = local[at : at + len(members)]
            at += len(members)
            adopted.append([m.param for m, mine, anywhere in zip(members, here, on) if anywhere and not mine])
            for param in adopted[-1]:
                sharded.flat.bring_home(param, final=True)  # no gradient here: its slot counts as zeros
            result.append(on)
        return result, adopted, skip

    def _update(self, sharded: ShardedBuffer, on: tuple[bool, ...], grad_scale: torch.Tensor | None) -> None:
        """One step of this rank's shard (step counts and first steps are kept on every rank for every member)."""
        owner = f"ShardedOptimizer({type(self.optim).__name__})"
        sharded.span.step(self.param_groups, on, grad_scale=grad_scale, owner=owner)

    @torch.no_grad()
    def step_ahead(self, span: SpanStepper, members: tuple[bool, ...]) -> None:
        """Steps this rank's shard of the flagged members of ``span`` (one of :attr:`spans`) now, ahead of
        :meth:`step`: FusedDataParallel's overlapped step calls it for each bucket whose reduce to the owners
        has landed, and :meth:`gather_ahead` when backward ends. Every rank must step the same members."""
        self._check_layout()
        params, ahead = span.params, [m.ahead for m in span.members]
        active = tuple(on and p.grad is not None and not a for on, p, a in zip(members, params, ahead))
        for member, on in zip(span.members, active):
            if on:
                member.ahead = True
                self._ahead += 1
        span.step(self.param_groups, active, owner=f"ShardedOptimizer({type(self.optim).__name__})")

    @torch.no_grad()
    def gather_ahead(self) -> None:
        """Brings the parameters stepped by :meth:`step_ahead` to every rank (one gather per buffer, in order)."""
        self._gather([sharded for sharded in self._buffers if any(m.ahead for m in sharded.span.members)])

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state, with the layout it belongs to.

        The format is written and read by ``tfuse.distributed._sharded_checkpoint``.
        """
        return checkpoint.sharded_state_dict(self)

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole state in torch.optim's format on rank ``to`` (None on the others); every rank must call it.

        Gathers one state buffer at a time, so rank ``to`` needs one buffer's
        worth of memory besides the result. The result loads into the
        unsharded fused optimizer, the torch.optim class it replaces, or a
        ShardedOptimizer of any world size.
        """
        return checkpoint.consolidated_state_dict(self, to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a consolidated (torch.optim format, any world size) or sharded (same layout) state dict.

        A sharded state dict saved with another world size, rank or layout
        raises ValueError naming the difference (nothing is changed then).
        """
        checkpoint.load_state_dict(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Refused: a ShardedOptimizer holds one rank's shard and a process group, which a copy cannot share."""
        raise TypeError(
            "ShardedOptimizer cannot be pickled or deep-copied (it holds this rank's shard of the state and a "
            "process group); save state_dict() (this rank's shard) or consolidated_state_dict() (the whole state, "
            "torch.optim format) and load it into a new ShardedOptimizer"
        )

    def __repr__(self) -> str:
        return f"ShardedOptimizer(rank {self.rank} of {self.world_size}, {self.optim!r})"
