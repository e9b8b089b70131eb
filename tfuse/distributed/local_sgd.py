"""LocalSGD and DiLoCo-style outer steps over tfuse's flat parameter buffers (PaddlePaddle's LocalSGD transpiler).

Every rank trains on its own for ``sync_every`` iterations, then the ranks
average their models: one all-reduce per flat parameter buffer, in place
(the trainable range only; frozen parameters never differ). With an outer
optimizer the average becomes a pseudo-gradient instead: each rank keeps a
snapshot of the parameters at the last sync, and a sync computes
``G = mean(snapshot - param)`` in the parameters' own storage, steps the
snapshot with ``G`` (one fused SGD/Nesterov update per buffer, state in flat
buffers) and copies the snapshot back into the parameters. No temporary
full-size buffer exists besides the snapshot and the outer momentum.

Iterations, not optimizer steps, are counted: a step that a GradScaler skips
on one rank still counts there, so every rank syncs at the same iteration.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from tfuse.distributed._checks import require_process_group
from tfuse.distributed._outer_step import outer_group, outer_span
from tfuse.distributed._replica_check import check_replicas_match, describe_replica
from tfuse.distributed._state_sync import broadcast_tensors
from tfuse.distributed.data_parallel import FusedDataParallel
from tfuse.distributed.local_sgd_options import AdaptiveInterval, OuterSGD
from tfuse.distributed.sharded import ShardedOptimizer
from tfuse.flat import FlatParams, flat_params_of, register_compact_state_dict

logger = logging.getLogger(__name__)

FORMAT = "tfuse.local_sgd/1"
_STATE_KEYS = ("iterations", "syncs", "next_sync", "sync_every", "adaptive", "warmup_steps", "outer_optimizer",
               "outer_started", "snapshots", "momenta")  # fmt: skip
_NORM_PIECE = 1 << 20  # elements per temporary when measuring the divergence of an outer step
BUFFER_MODES = ("average", "broadcast", "none")


class LocalSGD:
    """Local steps with a model average (or an outer step) every ``sync_every`` iterations.

    Args:
        model: the model every rank trains (the same values on every rank at
            the start), or a :class:`~tfuse.distributed.FusedDataParallel`
            wrapping it. The wrapper is needed for ``warmup_steps``: during
            warm-up it averages the gradients every step as usual; afterwards
            LocalSGD pauses it (no gradient all-reduce, no buffer broadcast),
            so nothing is communicated twice.
        optimizer: the inner optimizer over the model's parameters (a tfuse
            fused optimizer or any torch.optim one). Its state stays local.
        sync_every: iterations between syncs (``k``), at least 1.
        warmup_steps: iterations of every-step data parallelism first.
        process_group: the ranks to average over (None: the default group).
        outer_optimizer: None (syncs average the parameters) or an
            :class:`OuterSGD` (syncs step a snapshot with the averaged change).
        buffers: module buffers (batch-norm statistics) at a sync:
            ``"average"`` (floating buffers averaged, others taken from rank
            0), ``"broadcast"`` (all taken from rank 0) or ``"none"``.
        adaptive: None (a fixed interval) or an :class:`AdaptiveInterval`
            that doubles or halves ``sync_every`` after each sync from the
            measured parameter divergence (attribute ``divergence``).

    Attributes:
        iterations: iterations counted so far (:meth:`step` / :meth:`tick`).
        sync_every: the current interval (changes only with ``adaptive``).
        syncs: syncs done so far.
        collectives_per_sync: the collectives one sync launches (parameters
            and buffers), known from construction.
        bytes_per_sync: the bytes one sync sends, known from construction.

    Example (every rank, after ``dist.init_process_group``)::

        model = FusedDataParallel(build_model().to(device))
        optimizer = tfuse.optim.FusedMomentum(model.parameters(), lr=0.1, momentum=0.9)
        local = LocalSGD(model, optimizer, sync_every=16, warmup_steps=100,
                         outer_optimizer=OuterSGD(lr=0.7, momentum=0.9, nesterov=True))
        for x, y in loader:
            loss_fn(model(x), y).backward()
            local.step()  # optimizer.step(), then a sync when one is due
            optimizer.zero_grad()

    With a GradScaler, call ``scaler.step(optimizer); scaler.update();
    local.tick()``: :meth:`tick` counts the iteration whether or not the
    scaler skipped the step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        outer_optimizer: OuterSGD | None = None,
        buffers: str = "average",
        adaptive: AdaptiveInterval | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"LocalSGD: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LocalSGD: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, ShardedOptimizer):
            raise ValueError(
                "LocalSGD: the optimizer is a ShardedOptimizer, which communicates at every step (each rank updates "
                "only its shard); LocalSGD needs an optimizer that steps each rank's whole model on its own "
                "(e.g. FusedAdam or FusedMomentum)"
            )
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"LocalSGD: sync_every must be an int >= 1, got {sync_every!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"LocalSGD: warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if outer_optimizer is not None and not isinstance(outer_optimizer, OuterSGD):
            raise TypeError(
                f"LocalSGD: outer_optimizer must be None or an OuterSGD, got {type(outer_optimizer).__name__}"
            )
        if adaptive is not None and not isinstance(adaptive, AdaptiveInterval):
            raise TypeError(f"LocalSGD: adaptive must be None or an AdaptiveInterval, got {type(adaptive).__name__}")
        if buffers not in BUFFER_MODES:
            raise ValueError(f"LocalSGD: buffers must be one of {BUFFER_MODES}, got {buffers!r}")
        require_process_group("LocalSGD", process_group)
        self.wrapper = model if isinstance(model, FusedDataParallel) else None
        if warmup_steps and self.wrapper is None:
            raise ValueError(
                "LocalSGD: warmup_steps > 0 averages gradients every step during warm-up: wrap the model in "
                "FusedDataParallel and pass the wrapper (LocalSGD pauses it once warm-up ends)"
            )
        if self.wrapper is not None and self.wrapper.process_group is not process_group:
            raise ValueError("LocalSGD: pass the FusedDataParallel wrapper's process_group to LocalSGD too")
        self.module = model.module if self.wrapper is not None else model
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.outer_optimizer = outer_optimizer
        self.buffers = buffers
        self.adaptive = adaptive
        self.divergence: float | None = None  # measured at the last sync (with adaptive)
        self.world_size = dist.get_world_size(process_group)
        self.flat = self._flat_params(model)
        register_compact_state_dict(model)  # a part's state dict, deep-copied, holds only its elements
        self._check_optimizer()
        if self.wrapper is None:  # (the wrapper checked its replicas already)
            # Before the first collective: models of different shapes would hang or abort in the broadcast.
            names = {p: n for n, p in self.module.named_parameters()}
            options: dict[str, object] = {"sync_every": sync_every, "buffers": buffers}
            entries = describe_replica(self.module, self.flat, names, options)
            check_replicas_match(entries, process_group, self.flat.groups[0].device, owner="LocalSGD")
        self.iterations = 0
        self.syncs = 0
        self._next_sync = warmup_steps + sync_every  # the iteration of the next sync
        self._paused = False
        # Per flat buffer with trainable parameters: its trainable range (what a sync moves), and where each
        # trainable parameter sits in them; followed when the buffers are laid out again (see _follow_layout).
        self._ranges, self._places = self._trainable_ranges()
        self._layout_version = self.flat.layout_version
        self._params = [id(p) for p in self.flat.params]
        self._snapshots: list[torch.Tensor] = []
        self._momenta: list[torch.Tensor] = []
        self._outer_started = False
        if outer_optimizer is not None:
            self._snapshots = [r.detach().clone() for r in self._ranges]
            if outer_optimizer.momentum:
                self._momenta = [torch.zeros_like(r) for r in self._ranges]
        self.collectives_per_sync, self.bytes_per_sync = self._traffic()
        if warmup_steps == 0:
            self._pause()
        rank = dist.get_rank(process_group)
        logger.log(
            logging.INFO if rank == 0 else logging.DEBUG,
            "LocalSGD: sync every %d iteration%s after %d warm-up iteration%s; a sync is %d collective%s, %d bytes "
            "(%s%s)",
            sync_every,
            "" if sync_every == 1 else "s",
            warmup_steps,
            "" if warmup_steps == 1 else "s",
            self.collectives_per_sync,
            "" if self.collectives_per_sync == 1 else "s",
            self.bytes_per_sync,
            "parameter average" if outer_optimizer is None else f"outer step {outer_optimizer}",
            f", buffers: {buffers}",
        )

    # ------------------------------------------------------------------ set-up

    def _flat_params(self, model: torch.nn.Module) -> FlatParams:
        if self.wrapper is not None:
            return self.wrapper.flat
        params = list(model.parameters())
        if not params:
            raise ValueError("LocalSGD: the model has no parameters")
        owners = {flat_params_of(p) for p in params}
        if len(owners) == 1 and None not in owners:
            flat = owners.pop()
            if set(flat.params) == set(params):
                return flat
        if owners != {None}:
            raise ValueError(
                "LocalSGD: some of the model's parameters already live in a FlatParams that does not hold exactly "
                "the model's parameters (a fused optimizer over a subset?); create the optimizer over "
                "model.parameters()"
            )
        return FlatParams(model.named_parameters(), bucket_mb=None)

    def _trainable_ranges(self) -> tuple[list[torch.Tensor], dict[int, tuple[int, int, int]]]:
        """The trainable range of each flat buffer that has one, and id(parameter) -> (range, start, end)."""
        ranges, places = [], {}
        self._groups = [group for group in self.flat.groups if group.trainable_numel]
        for group in self._groups:
            for param, offset in zip(group.params[: group.n_trainable], group.offsets):
                places[id(param)] = (len(ranges), offset, offset + param.numel())
            ranges.append(group.data[: group.trainable_numel])
        return ranges, places

    def _follow_layout(self) -> list[torch.Tensor]:
        """Before a sync: the flat buffers as the model holds its parameters now; returns the parameters that
        left the trainable ranges since the last sync (frozen since: trained locally, so they differ).

        A storage replaced behind the buffers' back (``param.data = t``) is taken back into its slot; a change
        of the trainable set lays the buffers out again (as a fused optimizer's step does; with a torch.optim
        inner optimizer nothing else would), and the ranges, snapshots and momenta follow each parameter.
        """
        current = [id(p) for p in self.module.parameters()]
        if sorted(current) != sorted(self._params):
            raise RuntimeError(
                "LocalSGD: the model's parameters are not the ones LocalSGD was created with (a parameter replaced "
                "by a new nn.Parameter, added or removed): the flat buffers and the optimizer hold the old ones; "
                "create the optimizer and LocalSGD again"
            )
        self.flat.sync_grads()  # takes replaced storage back; lays out again if the trainable set changed
        if self.flat.layout_version == self._layout_version:
            return []
        old_places, old_snapshots, old_momenta = self._places, self._snapshots, self._momenta
        self._ranges, self._places = self._trainable_ranges()
        self._layout_version = self.flat.layout_version
        if self.outer_optimizer is not None:
            self._snapshots = [self._carried(r, old_places, old_snapshots, fresh=r) for r in self._ranges]
            if self.outer_optimizer.momentum:
                self._momenta = [self._carried(r, old_places, old_momenta, fresh=None) for r in self._ranges]
        self.collectives_per_sync, self.bytes_per_sync = self._traffic()
        logger.info("LocalSGD: the flat buffers were laid out again; the sync follows them")
        return [p for p in self.flat.params if id(p) in old_places and id(p) not in self._places]

    def _carried(self, new_range: torch.Tensor, old_places: dict, old: list[torch.Tensor], fresh) -> torch.Tensor:
        """A snapshot (or momentum) for ``new_range``: each parameter's old values where it had them, else the
        parameter's current values (``fresh``, a snapshot) or zeros (a momentum)."""
        index = next(i for i, r in enumerate(self._ranges) if r is new_range)
        carried = new_range.detach().clone() if fresh is not None else torch.zeros_like(new_range)
        for param_id, (at, start, end) in self._places.items():
            if at == index and param_id in old_places:
                was, old_start, old_end = old_places[param_id]
                carried[start:end] = old[was][old_start:old_end]
        return carried

    def _average_left(self, params: list[torch.Tensor]) -> None:
        """Parameters frozen since the last sync, averaged once more (they were trained locally until then)."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in params:
            by_kind.setdefault((param.device, param.dtype), []).append(param.detach())
        for tensors in by_kind.values():
            self._average_in_place(tensors)

    def _check_optimizer(self) -> None:
        mine = {id(p) for p in self.flat.params}
        theirs = [p for group in self.optimizer.param_groups for p in group["params"]]
        strangers = [p for p in theirs if id(p) not in mine]
        if strangers:
            raise ValueError(
                f"LocalSGD: the optimizer holds {len(strangers)} parameter{'' if len(strangers) == 1 else 's'} "
                "that are not the model's"
            )

    def _traffic(self) -> tuple[int, int]:
        calls = len(self._ranges)
        size = sum(r.numel() * r.element_size() for r in self._ranges)
        for tensors in self._buffer_batches().values():
            calls += 1
            size += sum(t.numel() * t.element_size() for t in tensors)
        return calls, size

    def _buffer_batches(self) -> dict[tuple[str, torch.device, torch.dtype], list[torch.Tensor]]:
        """Module buffers by (averaged or broadcast, device, dtype): one collective per batch."""
        batches: dict[tuple[str, torch.device, torch.dtype], list[torch.Tensor]] = {}
        if self.buffers == "none":
            return batches
        for tensor in self.module.buffers():
            how = "average" if self.buffers == "average" and tensor.dtype.is_floating_point else "broadcast"
            batches.setdefault((how, tensor.device, tensor.dtype), []).append(tensor)
        return batches

    # ------------------------------------------------------------------ the loop

    def step(self, closure: Any = None) -> Any:
        """``optimizer.step(closure)``, then :meth:`tick`. Returns what the optimizer's step returned."""
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.tick()
        return result

    def tick(self) -> bool:
        """Counts one iteration; syncs when one is due. Returns whether this iteration synced.

        Call it once per iteration on every rank (after the optimizer's step,
        skipped by a GradScaler or not).
        """
        self.iterations += 1
        if self.iterations <= self.warmup_steps:
            if self.iterations == self.warmup_steps:
                self._pause()  # warm-up over: from the next backward on, nothing is communicated per step
            return False
        if self.iterations < self._next_sync:
            return False
        self.sync()
        self._next_sync = self.iterations + self.sync_every
        return True

    def _pause(self) -> None:
        if self.wrapper is not None and not self._paused:
            self.wrapper._pause_communication(True)
        self._paused = True
        if self.outer_optimizer is not None:
            for snapshot, current in zip(self._snapshots, self._ranges):
                snapshot.copy_(current)  # the local phase starts from here (warm-up moved the parameters)

    @torch.no_grad()
    def sync(self) -> None:
        """Averages the models now (or takes an outer step): every rank must call it at the same iteration.

        With ``adaptive``, also measures the divergence and sets ``sync_every`` for the next interval.
        """
        left = self._follow_layout()
        if left:
            self._average_left(left)
        if not self._ranges:  # everything frozen: nothing is trained, nothing differs
            self._sync_buffers()
            self.syncs += 1
            return
        before = self._squared_norm() if self.adaptive is not None else None
        self._mean_squared = torch.zeros((), dtype=torch.float64, device=self._ranges[0].device)
        for index, flat_range in enumerate(self._ranges):
            if self.outer_optimizer is None:
                flat_range.div_(self.world_size)  # average: divide before summing
                dist.all_reduce(flat_range, group=self.process_group)
            else:
                self._outer_step(index)
        self._sync_buffers()
        if before is not None:
            self._adapt(before)
        self.syncs += 1
        self._outer_started = self._outer_started or self.outer_optimizer is not None
        logger.debug("LocalSGD: sync %d at iteration %d", self.syncs, self.iterations)

    def _squared_norm(self) -> torch.Tensor:
        """This rank's squared norm of the trainable parameters, in float64."""
        total = torch.zeros((), dtype=torch.float64, device=self._ranges[0].device)
        for flat_range in self._ranges:
            total += torch.linalg.vector_norm(flat_range, dtype=torch.float64) ** 2
        return total

    def _adapt(self, before: torch.Tensor) -> None:
        """mean_r |p_r|^2 - |p_mean|^2 = mean_r |p_r - p_mean|^2: the spread the average removed.

        ``|p_mean|^2`` is read after the average (or, with an outer optimizer,
        from ``snapshot - G`` before the outer step, see :meth:`_outer_step`).
        """
        after = self._squared_norm() if self.outer_optimizer is None else self._mean_squared
        sums = torch.stack([before, after]).reshape(2)
        dist.all_reduce(sums, group=self.process_group)  # summed identically on every rank: one decision
        mean_before, mean_after = (sums / self.world_size).tolist()
        spread = max(mean_before - mean_after, 0.0)
        self.divergence = math.sqrt(spread / mean_after) if mean_after > 0 else 0.0
        previous = self.sync_every
        self.sync_every = self.adaptive.next_interval(previous, self.divergence)
        if self.sync_every != previous:
            logger.info(
                "LocalSGD: divergence %.3g at sync %d: sync every %d iterations (was %d)",
                self.divergence,
                self.syncs + 1,
                self.sync_every,
                previous,
            )

    def _outer_step(self, index: int) -> None:
        params, snapshot = self._ranges[index], self._snapshots[index]
        # The pseudo-gradient in the parameters' own storage: G = mean(snapshot - param), no other buffer.
        torch.sub(snapshot, params, out=params)
        params.div_(self.world_size)
        dist.all_reduce(params, group=self.process_group)
        if self.adaptive is not None:  # |p_mean|^2 = |snapshot - G|^2, a piece at a time (no full-size temporary)
            for start in range(0, params.numel(), _NORM_PIECE):
                piece = snapshot[start : start + _NORM_PIECE] - params[start : start + _NORM_PIECE]
                self._mean_squared += torch.linalg.vector_norm(piece, dtype=torch.float64) ** 2
        momentum = self._momenta[index] if self._momenta else None
        span = outer_span(self.flat, self._groups[index], snapshot, params, momentum, self._outer_started)
        span.step([outer_group(self.outer_optimizer)], (True,) * len(span.members), owner="LocalSGD outer step")
        params.copy_(snapshot)

    def _sync_buffers(self) -> None:
        for (how, _, _), tensors in self._buffer_batches().items():
            if how == "broadcast":
                broadcast_tensors(tensors, self.process_group)
                continue
            self._average_in_place(tensors)

    def _average_in_place(self, tensors: list[torch.Tensor]) -> None:
        """The ranks' average of ``tensors`` (one device and dtype), written into them: one all-reduce."""
        staging = torch.cat([t.reshape(-1) for t in tensors]).div_(self.world_size)
        dist.all_reduce(staging, group=self.process_group)
        offset = 0
        for tensor in tensors:
            tensor.copy_(staging[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Iteration and sync counts, and the outer optimizer's snapshot and momentum (the same on every rank)."""
        return {
            "format": FORMAT,
            "iterations": self.iterations,
            "syncs": self.syncs,
            "next_sync": self._next_sync,
            "sync_every": self.sync_every,
            "adaptive": None if self.adaptive is None else dataclasses.asdict(self.adaptive),
            "warmup_steps": self.warmup_steps,
            "outer_optimizer": None if self.outer_optimizer is None else dataclasses.asdict(self.outer_optimizer),
            "outer_started": self._outer_started,
            "snapshots": [s.clone() for s in self._snapshots],
            "momenta": [m.clone() for m in self._momenta],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes where :meth:`state_dict` left off (mid-interval too): load the model and optimizer as well.

        Raises ValueError, changing nothing, when the state dict is not a whole
        LocalSGD state dict, or when the checkpoint's schedule or buffer sizes
        differ from this LocalSGD's.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            raise ValueError("LocalSGD: not a state dict of LocalSGD.state_dict()")
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"LocalSGD: the state dict lacks {', '.join(missing)} (not from LocalSGD.state_dict()?)")
        for key in ("iterations", "syncs", "next_sync", "sync_every", "warmup_steps"):
            value = state_dict[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LocalSGD: the state dict's {key} must be an int >= 0, got {value!r}")
        checked = ("warmup_steps",) if self.adaptive is not None else ("sync_every", "warmup_steps")
        for key in checked:  # (an adaptive interval resumes at the checkpoint's current interval)
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"LocalSGD: the checkpoint has {key}={state_dict[key]}, this LocalSGD {getattr(self, key)}"
                )
        adaptive = None if self.adaptive is None else dataclasses.asdict(self.adaptive)
        if state_dict.get("adaptive") != adaptive:
            raise ValueError(
                f"LocalSGD: the checkpoint's adaptive rule is {state_dict.get('adaptive')}, this one's {adaptive}"
            )
        mine = None if self.outer_optimizer is None else dataclasses.asdict(self.outer_optimizer)
        if state_dict["outer_optimizer"] != mine:
            raise ValueError(
                f"LocalSGD: the checkpoint's outer optimizer is {state_dict['outer_optimizer']}, this one's {mine}"
            )
        for name, saved, ours in (
            ("snapshots", state_dict["snapshots"], self._snapshots),
            ("momenta", state_dict["momenta"], self._momenta),
        ):
            if not isinstance(saved, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in saved):
                raise ValueError(f"LocalSGD: the checkpoint's {name} must be a list of tensors")
            if [tuple(t.shape) for t in saved] != [tuple(t.shape) for t in ours]:
                raise ValueError(f"LocalSGD: the checkpoint's {name} do not match this model's flat buffers")
        # Everything checked: from here on nothing raises.
        for saved, ours in zip(state_dict["snapshots"], self._snapshots):
            ours.copy_(saved)
        for saved, ours in zip(state_dict["momenta"], self._momenta):
            ours.copy_(saved)
        self.iterations = int(state_dict["iterations"])
        self.syncs = int(state_dict["syncs"])
        self.sync_every = int(state_dict["sync_every"])
        self._next_sync = int(state_dict["next_sync"])
        self._outer_started = bool(state_dict["outer_started"])
        if self.iterations >= self.warmup_steps:
            if self.wrapper is not None and not self._paused:
                self.wrapper._pause_communication(True)
            self._paused = True

    def __repr__(self) -> str:
        return (
            f"LocalSGD(sync_every={self.sync_every}, warmup_steps={self.warmup_steps}, "
            f"outer_optimizer={self.outer_optimizer}, iterations={self.iterations}, syncs={self.syncs})"
        )
