"""torch.optim's rules for loading a state dict, written once for every tfuse optimizer.

``torch.optim.Optimizer.load_state_dict`` matches saved parameters to the
optimizer's by position over the groups, checks the number and sizes of
the groups, and takes the saved hyperparameters. The fused optimizers and
:class:`~tfuse.distributed.ShardedOptimizer` (consolidated checkpoints)
follow those rules through :func:`check_saved_state` and
:func:`merge_saved_groups`, and add the checks torch makes late or not at
all: a state tensor of another family, or of another shape than its
parameter, is refused before anything changes.

Example:
    >>> import torch
    >>> from tfuse.optim import FusedAdam
    >>> from tfuse.optim.load_rules import check_saved_state, merge_saved_groups
    >>> layer = torch.nn.Linear(2, 1)
    >>> saved = torch.optim.Adam(layer.parameters(), lr=0.5).state_dict()
    >>> optimizer = FusedAdam(layer.parameters())
    >>> params = check_saved_state(optimizer, optimizer.param_groups, saved)
    >>> [tuple(p.shape) for p in params.values()], merge_saved_groups(optimizer, optimizer.param_groups,
    ...     saved["param_groups"], optimizer.defaults)[0]["lr"]
    ([(1, 2), (1,)], 0.5)
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch

from tfuse.optim._checks import IMPLEMENTATION_FLAGS
from tfuse.optim.span import MASTER_KEY


def check_saved_state(
    rule: Any, groups: list[dict[str, Any]], state_dict: dict[str, Any], owner: str = ""
) -> dict[Any, torch.nn.Parameter]:
    """Checks ``state_dict`` against ``groups`` as torch does, and each entry's tensors; returns saved id -> parameter.

    Args:
        rule: the fused optimizer whose family the state must be
            (:attr:`state_names`, :attr:`family`; see :class:`~tfuse.optim.span.UpdateRule`).
        groups: the optimizer's parameter groups.
        state_dict: torch.optim's format (``state``, ``param_groups``).
        owner: the optimizer named in messages (default: the rule's class).

    Raises ValueError for a different number of groups, a group of another
    size, a state tensor of another family (or a required one missing), or
    a state tensor whose shape differs from its parameter's.
    """
    saved_groups = state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )
    params = dict(
        zip(
            itertools.chain.from_iterable(g["params"] for g in saved_groups),
            itertools.chain.from_iterable(g["params"] for g in groups),
        )
    )
    required = {saved_id: rule.required_state(g) for g in saved_groups for saved_id in g["params"]}
    shaped = {*rule.state_names, MASTER_KEY}
    for saved_id, entry in state_dict["state"].items():
        param = params.get(saved_id)
        if param is None:
            continue
        _check_family(rule, saved_id, entry, required[saved_id], owner)
        for name, value in entry.items():
            if name in shaped and isinstance(value, torch.Tensor) and value.shape != param.shape:
                raise ValueError(
                    f"loaded state dict has '{name}' of shape {tuple(value.shape)} for a parameter of shape "
                    f"{tuple(param.shape)} (parameter {saved_id})"
                )
    return params


def _check_family(rule: Any, saved_id: Any, entry: dict[str, Any], required: set[str], owner: str) -> None:
    """Raises ValueError when a saved parameter's state is another family's (a tensor this optimizer does not
    keep, or one it needs missing): torch.optim fails at load too, not at the next step."""
    known = {*rule.state_names, MASTER_KEY, "step"}
    foreign = sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor) and k not in known)
    missing = sorted(required - set(entry)) if entry else []
    if foreign or missing:
        what = f"has {', '.join(map(repr, foreign))}" if foreign else f"lacks {', '.join(map(repr, missing))}"
        name = type(rule).__name__
        raise ValueError(
            f"{owner or name}.load_state_dict: the state of parameter {saved_id} {what}: a state dict of another "
            f"optimizer? {name} keeps {', '.join(map(repr, rule.state_names))} per parameter"
        )


def merge_saved_groups(
    rule: Any, groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> list[dict[str, Any]]:
    """The groups after loading: the saved hyperparameters (checked by ``rule.check_group``) on the current
    parameters, as torch takes them.

    torch's implementation switches (``foreach``, ``fused``, ``capturable``,
    ``differentiable``) stay the optimizer's own: they say how the saving
    optimizer ran, not what the state is. Missing hyperparameters take the
    defaults; the current groups are not changed.
    """
    merged = []
    for group, saved in zip(groups, copy.deepcopy(saved_groups)):
        saved["params"] = group["params"]
        if "param_names" in group and "param_names" not in saved:
            saved["param_names"] = group["param_names"]
        for name, default in defaults.items():
            saved.setdefault(name, default)
        for key in rule.structural_keys:  # what kind of group it is (FusedMuon's use_muon) stays the current one's
            saved[key] = group[key]
        for flag in IMPLEMENTATION_FLAGS:  # how this optimizer runs is its own, not the saver's
            if flag in group:
                saved[flag] = group[flag]
            else:
                saved.pop(flag, None)
        rule.check_group(saved)
        merged.append(saved)
    return merged
