"""The fused optimizers' base: a torch.optim.Optimizer whose parameters live in flat buffers.

:class:`FlatOptimizer` is a thin layer between torch.optim's bookkeeping and
the flat update:

* Parameter groups, defaults, ``state_dict()``, step hooks and the
  implementation checks of ``add_param_group`` are torch.optim's own.
* Each parameter is bound once, when its group is added, to the
  :class:`~tfuse.flat.FlatParams` that holds it (the one passed as ``params``,
  the one its memory belongs to, or a new one the optimizer coalesces it into).
  The optimizer holds every FlatParams it updates (:attr:`FlatOptimizer.flat_params`).
* Each flat buffer is stepped whole by a :class:`~tfuse.optim.span.SpanStepper`
  (the span engine, which a shard owner uses over its shard): it owns the
  buffer's state and runs the family's update, one Triton launch or torch's
  fused kernels over whole runs of the buffer on the PyTorch path.
  ``optimizer.state[p]`` holds views of that state in torch.optim's format.

Subclasses declare their update family, the state they keep and the
torch.optim class they replace, check their hyperparameters
(:meth:`FlatOptimizer.check_group`) and turn a group into a row of
hyperparameters (:meth:`FlatOptimizer.update_row`): they are the span
engine's :class:`~tfuse.optim.span.UpdateRule`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from tfuse._eager import eager_in_compiled_code
from tfuse.flat import FlatParams, flat_params_of
from tfuse.optim import _report
from tfuse.optim._checks import check_implementation_flags, check_params
from tfuse.optim._optimizer_copies import OptimizerCopies
from tfuse.optim._update import UpdateFamily
from tfuse.optim.load_rules import check_saved_state, merge_saved_groups
from tfuse.optim.span import MASTER_KEY, SpanMember, SpanStepper, closure_and_amp

logger = logging.getLogger(__name__)


_AS_RULE: contextvars.ContextVar[bool] = contextvars.ContextVar("tfuse_optimizer_as_rule", default=False)


class FlatOptimizer(OptimizerCopies, torch.optim.Optimizer):
    """Base of the fused optimizers: parameters in flat buffers, one update per buffer.

    Subclasses set :attr:`family` (the update maths), :attr:`state_names`
    (every per-parameter state tensor they keep, by torch's names) and
    :attr:`torch_name`, and implement :meth:`check_group` and
    :meth:`update_row`. Each flat buffer is one :class:`~tfuse.optim.span.SpanStepper`
    over the whole buffer (:attr:`spans`).
    """

    family: ClassVar[UpdateFamily]
    state_names: ClassVar[tuple[str, ...]]
    torch_name: ClassVar[str]  # the torch.optim class this one replaces (named in error messages)
    # Whether the constructor creates every parameter's state (torch's Adagrad does), not the first gradient.
    creates_state_eagerly: ClassVar[bool] = False
    # Group keys that say what kind of group it is, not a hyperparameter: kept from the current group on load.
    structural_keys: ClassVar[tuple[str, ...]] = ()
    # State names kept in another name's flat buffer (FusedMuon: Muon's momentum in its AdamW groups' exp_avg).
    state_aliases: ClassVar[dict[str, str]] = {}
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf

    def __init__(
        self, params: Any, defaults: dict[str, Any], master_weights: bool = False, capturable: bool | None = None
    ) -> None:
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
        # torch's switch in the groups (Adam), or an argument of optimizers whose torch class has none (SGD).
        self.capturable = bool(defaults.get("capturable", False)) if capturable is None else capturable
        self._check_flags(defaults)
        self.master_weights = master_weights
        self._init_runtime()
        if isinstance(params, FlatParams):
            self._flats.append(params)  # bound to this very FlatParams
        # The constructor's groups are coalesced together (one buffer per device and dtype,
        # so one launch whatever the number of groups); later add_param_group calls coalesce
        # their own new parameters.
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        self._bind([p for group in self.param_groups for p in group["params"]])
        if self.creates_state_eagerly and not _AS_RULE.get():
            self._start_state_now()

    @staticmethod
    @contextlib.contextmanager
    def as_update_rule() -> Iterator[None]:
        """Fused optimizers built inside serve only as an update rule and the holder of the parameter groups
        (a ShardedOptimizer's): none creates state in its constructor, which the owner of the state does.

        Example:
            >>> import torch
            >>> from tfuse.optim import FlatOptimizer, FusedAdagrad
            >>> with FlatOptimizer.as_update_rule():
            ...     rule = FusedAdagrad(torch.nn.Linear(2, 2).parameters())
            >>> len(rule.state)
            0
        """
        token = _AS_RULE.set(True)
        try:
            yield
        finally:
            _AS_RULE.reset(token)

    def _init_runtime(self) -> None:
        """What the optimizer keeps besides torch's defaults/state/param_groups (rebuilt after a copy)."""
        self._spans: list[SpanStepper] = []
        self._flats: list[FlatParams] = []  # every FlatParams it updates; held here (nothing else keeps them alive)
        self._entries = 0  # members with an entry in self.state (a drop in len(self.state) shows a clear())
        self._announced: set[tuple] = set()  # (device, dtype, backend) already logged
        self._stepped_ahead = 0  # members stepped by step_ahead since the last step
        self._constructing = False

    @property
    def flat_params(self) -> tuple[FlatParams, ...]:
        """The FlatParams whose buffers the optimizer updates (each holds some of its parameters)."""
        return tuple(self._flats)

    @property
    def spans(self) -> tuple[SpanStepper, ...]:
        """The span engines stepping the flat buffers, one per buffer (each over the whole buffer)."""
        return tuple(self._spans)

    # ------------------------------------------------------------------ groups

    def check_group(self, group: dict[str, Any]) -> None:
        """Raises ValueError (torch's wording) for a bad hyperparameter of ``group``."""
        raise NotImplementedError

    def _check_flags(self, group: dict[str, Any]) -> None:
        """Checks torch.optim's implementation switches in ``group`` (see :func:`check_implementation_flags`)."""
        check_implementation_flags(type(self).__name__, self.torch_name, group)
        if "capturable" in group and bool(group["capturable"]) != self.capturable:
            raise ValueError(
                f"{type(self).__name__}: capturable={group.get('capturable')} in a parameter group of an optimizer "
                f"built with capturable={self.capturable}: the step counts of one optimizer live in one place "
                "(on the device when capturable), so every group must agree"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group as torch does, checks it, and binds its parameters to flat buffers.

        A :class:`~tfuse.flat.FlatParams` given as the group's ``params`` is
        the one its parameters are updated in; parameters in no FlatParams are
        coalesced into a new one.
        """
        flat = None
        if isinstance(param_group, dict):
            flat = param_group.get("params")
            param_group = dict(param_group)  # torch edits the dict it is given; the caller's stays as it was
        with warnings.catch_warnings():
            # torch only warns about duplicates (an error "in future"); check_params raises it now.
            warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)  # Tensors, leaves, names, defaults, no parameter in two groups
        group = self.param_groups[-1]
        try:
            check_params(type(self).__name__, group["params"])
            self.check_group(group)
            self._check_flags(group)
        except Exception:
            self.param_groups.pop()
            raise
        if isinstance(flat, FlatParams) and flat not in self._flats:
            self._flats.append(flat)
        if not self._constructing:
            self._bind(group["params"])

    def _flat_of(self, param: torch.Tensor) -> FlatParams | None:
        for flat in self._flats:
            if flat.holds(param):
                return flat
        return flat_params_of(param)

    def _bind(self, new: list[torch.Tensor]) -> None:
        """Binds new parameters to the FlatParams holding them (coalescing loose ones) and rebuilds the spans.

        Members already bound keep their records and state; a buffer whose
        FlatParams was laid out again since the last step follows first.
        """
        loose = [p for p in new if self._flat_of(p) is None]
        if loose:
            self._flats.extend(self._coalesce(loose))
        known = {id(m.param): m for s in self._spans for m in s.members}
        existing = {(id(s.flat), s.device, s.dtype, s.rule_id): s for s in self._spans}
        # One FlatState per buffer, whatever the number of rules stepping it (FusedMuon's two kinds in one buffer
        # keep one set of masters and step counts, and share their state buffers through state_aliases).
        states = {(id(s.flat), s.device, s.dtype): s.state for s in self._spans}
        spans: dict[tuple, tuple[SpanStepper, list[SpanMember]]] = {}
        for index, group in enumerate(self.param_groups):
            rule = self.rule_for(group)
            for param in group["params"]:
                flat = self._flat_of(param)
                key = (id(flat), param.device, param.dtype, id(rule))
                if key not in spans:
                    span = existing.get(key)
                    if span is None:
                        buffer = flat.groups[flat.range_of(param).buffer]
                        shared = states.get(key[:3])
                        if shared is not None and shared.group is not buffer:
                            shared = None  # (laid out again since: the other span follows at its next step)
                        span = SpanStepper(
                            flat,
                            buffer,
                            rule,
                            master_weights=self.master_weights,
                            capturable=self.capturable,
                            state=shared,
                        )
                        states[key[:3]] = span.state
                    elif span.layout_version != flat.layout_version:
                        self._follow_layout(span)
                    spans[key] = (span, [])
                member = known.get(id(param)) or SpanMember(param, index)
                member.group = index
                spans[key][1].append(member)
        for span, members in spans.values():
            span.set_members(members)
        self._spans = [span for span, _ in spans.values()]
        self._flats = list(dict.fromkeys(span.flat for span in self._spans))

    def _coalesce(self, loose: list[torch.Tensor]) -> list[FlatParams]:
        """The FlatParams that take parameters held by none yet (one; FusedMuon keeps its two kinds apart)."""
        return [FlatParams(loose)]

    def rule_for(self, group: dict[str, Any]) -> Any:
        """The update rule of ``group``'s parameters: the optimizer itself (FusedMuon's AdamW groups differ)."""
        return self

    def required_state(self, group: dict[str, Any]) -> set[str]:
        """The state a parameter of ``group`` (as a state dict has it) holds once stepped."""
        return self.family.required_state(group)

    def _follow_layout(self, span: SpanStepper) -> None:
        logger.info("tfuse: flat layout changed; moving optimizer state to the new offsets")
        span.follow_layout()
        state = span.state
        for member in span.members:
            entry = self.state.get(member.param)
            for name in entry or ():
                if name == "step":
                    entry[name] = state.step(member.param)
                elif name == MASTER_KEY:
                    entry[name] = state.master_view(member.param)
                elif name in state.buffers:
                    entry[name] = state.view(name, member.param)

    # ------------------------------------------------------------------ the update rule (see UpdateRule)

    def update_row(self, group: dict[str, Any], step: int, first: bool) -> Any:
        """The update row (:class:`~tfuse.optim._update.AdamStep`...) of ``group`` at step ``step``;
        ``first``: the parameters' first step."""
        raise NotImplementedError

    def state_names_of(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The flat state a parameter of ``group`` gets at its first step (none: SGD without momentum)."""
        return self.update_row(group, 1, True).state_names

    def initial_state(self, name: str, group: dict[str, Any]) -> float:
        """The value state ``name`` starts from at a parameter's first step (zero; Adagrad's ``sum`` differs)."""
        return 0.0

    def pads_stay_zero(self) -> bool:
        """Whether the update keeps zero padding at zero (runs may then cross it)."""
        return True

    # ------------------------------------------------------------------ step

    @eager_in_compiled_code  # runs eagerly inside compiled code: one launch per buffer, nothing to trace
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step: one update launch per flat buffer.

        Args:
            closure: reevaluates the model and returns the loss (as in torch.optim).

        With ``capturable=True`` the step reads nothing on the host and copies
        nothing to the device: step counts and the coefficient table are
        computed on the device, and a GradScaler's ``found_inf`` is read by the
        kernel (the step is skipped there). Otherwise the step counts are on
        the host, the coefficient table is sent from pinned memory (no sync),
        and under a GradScaler ``found_inf`` is read once (one sync per step).
        """
        loss, grad_scale, found_inf = closure_and_amp(self, closure)
        ahead, self._stepped_ahead = self._stepped_ahead, 0
        if found_inf is not None and not self.capturable and bool(found_inf.item()):
            # GradScaler found inf/NaN: skip the step, nothing changes. The host step counts must not advance,
            # so this reads one scalar (capturable=True decides on the device instead).
            return loss
        for flat in self._flats:
            flat.sync_grads()
        if self._entries > len(self.state):
            self._forget_removed_entries()  # someone cleared optimizer.state (or deleted entries)
        for span in self._spans:
            active = [p.grad is not None for p in span.params]
            if ahead:  # members stepped by step_ahead since the last step: not again
                for at, member in enumerate(span.members):
                    active[at] = active[at] and not member.ahead
                    member.ahead = False
            self._step_span(span, tuple(active), grad_scale, found_inf if self.capturable else None)
        return loss

    @torch.no_grad()
    def step_ahead(self, span: SpanStepper, members: tuple[bool, ...]) -> None:
        """Steps the flagged members of ``span`` (one of :attr:`spans`) that have a gradient now, ahead of
        :meth:`step`, which then skips them: the overlapped step of FusedDataParallel runs each gradient
        bucket's update as soon as its all-reduce has landed.

        The update is the one :meth:`step` would run for them (same rows,
        step counts and state), so the result does not depend on the split.
        No GradScaler and no closure here: the caller checked the gradients.

        Example:
            >>> import torch
            >>> from tfuse.optim import FusedMomentum
            >>> layer = torch.nn.Linear(3, 1)
            >>> optimizer = FusedMomentum(layer.parameters(), lr=0.1)
            >>> layer(torch.ones(2, 3)).sum().backward()
            >>> (span,) = optimizer.spans
            >>> optimizer.step_ahead(span, tuple(m.param is layer.weight for m in span.members))
            >>> layer.weight.grad.sum().item(), float(optimizer.state[layer.weight]["momentum_buffer"].sum())
            (6.0, 6.0)
            >>> optimizer.step()  # the bias only
            >>> sorted(tuple(p.shape) for p in optimizer.state)
            [(1,), (1, 3)]
        """
        if self._entries > len(self.state):
            self._forget_removed_entries()
        active = tuple(
            on and p.grad is not None and not m.ahead for on, p, m in zip(members, span.params, span.members)
        )
        for member, on in zip(span.members, active):
            if on:
                member.ahead = True
                self._stepped_ahead += 1
        self._step_span(span, active, None, None)

    def _step_span(
        self,
        span: SpanStepper,
        active: tuple[bool, ...],
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """Steps the ``active`` members of one of :attr:`spans` (a fused step of their flat buffer)."""
        if span.layout_version != span.flat.layout_version:
            self._follow_layout(span)
            active = tuple([p.grad is not None for p in span.params])  # (the members were sorted again)
        started = span.step(
            self.param_groups, active, grad_scale=grad_scale, found_inf=found_inf, owner=type(self).__name__
        )
        for member in started:
            self._new_entry(span, member)
        if span.last_backend is not None:
            _report.announce(self, span, span.last_backend, logger)

    def _start_state_now(self) -> None:
        """Creates every parameter's state now, as torch's Adagrad does in its constructor (step 0 and the
        initial values), instead of at each parameter's first gradient."""
        where = {}
        for span in self._spans:
            fresh = [m for m in span.members if not m.started]
            span.start(fresh, self.param_groups)
            where.update((id(m.param), (span, m)) for m in fresh)
        for param in (p for group in self.param_groups for p in group["params"]):  # torch's order of entries
            if id(param) in where:
                self._new_entry(*where[id(param)])

    def _new_entry(self, span: SpanStepper, member: SpanMember) -> None:
        """torch's lazy state creation, seen from optimizer.state: the entry of a member at its first step."""
        names = span.rule.state_names_of(self.param_groups[member.group])
        if not (names or span.master_weights):
            return
        entry = self.state[member.param]
        entry.clear()
        entry.update(span.entry_views(member, names))
        self._set_has_entry(member, True)

    def _set_has_entry(self, member: SpanMember, has_entry: bool) -> None:
        self._entries += has_entry - member.has_entry
        member.has_entry = has_entry

    def _forget_removed_entries(self) -> None:
        for span in self._spans:
            for member in span.members:
                if member.has_entry and not self.state.get(member.param):
                    self._set_has_entry(member, False)
                    member.started = False

    # ------------------------------------------------------------------ zero_grad / state_dict

    @eager_in_compiled_code  # a flat buffer's zeroing, run eagerly inside compiled code
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like torch's, but a flat buffer whose parameters are all ours is zeroed in one op."""
        ours = {id(p) for group in self.param_groups for p in group["params"]}
        loose = []
        for flat in self._flats:
            params = flat.params
            if all(id(p) in ours for p in params if p.requires_grad):
                flat.zero_grad(set_to_none)
            else:
                loose.extend(p for p in params if id(p) in ours)
        for param in loose:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of the matching torch.optim class.

        Values are copied into the flat state buffers (the loaded tensors are
        not adopted); hyperparameters come from the state dict, as in torch.
        torch's implementation switches (``foreach``, ``fused``, ``capturable``,
        ``differentiable``) stay this optimizer's own: they say how the saving
        optimizer ran, not what the state is, and a checkpoint of a
        ``capturable=True`` torch optimizer loads like any other.
        Raises ValueError for a different number of groups, a group of a
        different size, or a state tensor whose shape differs from its
        parameter's; nothing is changed then.

        The steps are torch.optim's, in its order and words (pre-hooks, group
        checks, matching parameters by position, post-hooks; the rules are
        :mod:`tfuse.optim.load_rules`), but not its code: torch casts every
        state tensor to its parameter's dtype (the float32 state and masters
        of float16/bfloat16 parameters would lose their precision) and copies
        the whole state once more before it could be copied into the flat buffers.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        params = check_saved_state(self, self.param_groups, state_dict)
        self.param_groups = merge_saved_groups(self, self.param_groups, state_dict["param_groups"], self.defaults)
        self.state = collections.defaultdict(dict)
        place = {}
        for span in self._spans:
            span.reset()
            place.update((id(m.param), (span, m)) for m in span.members)
        self._entries = 0
        for saved_id, entry in state_dict["state"].items():
            param = params.get(saved_id)
            if param is not None:
                self.state[param] = self._load_entry(*place[id(param)], entry)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_entry(self, span: SpanStepper, member: SpanMember, saved: dict[str, Any]) -> dict[str, Any]:
        """Copies one parameter's saved state into its span; returns its torch-format entry (views)."""
        entry = span.load_member(member, saved, self.param_groups)
        self._set_has_entry(member, bool(entry))
        return entry

    # ------------------------------------------------------------------ report

    def describe(self) -> str:
        """One line: the flat buffers the optimizer updates, and what serves each step.

        Says which backend runs the update of each buffer as things stand now
        (``TFUSE_BACKEND``, ``tfuse.use_backend``, the device and the Triton
        interpreter decide): the Triton kernel, one launch per buffer per step,
        or the PyTorch path (torch's fused kernels; no Triton kernel runs).
        """
        params = sum(len(s.members) for s in self._spans)
        elements = sum(m.end - m.start for s in self._spans for m in s.members)
        buffers = len({(id(s.flat), s.device, s.dtype) for s in self._spans})  # (FusedMuon: two rules, one buffer)
        return (
            f"{type(self).__name__}: {params} parameters ({elements} elements) in {buffers} flat "
            f"buffer{'s' if buffers != 1 else ''}, {_report.service(self)}"
        )

    def __repr__(self) -> str:
        """torch.optim's repr, with a first line saying what serves the step (see :meth:`describe`)."""
        text = super().__repr__()
        head = type(self).__name__ + " ("
        return f"{head}\nStep: {_report.service(self)}{text[len(head) :]}"
