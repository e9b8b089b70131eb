"""How a fused optimizer is pickled and deep-copied: torch.optim's behaviour over flat state buffers.

:class:`OptimizerCopies` is a base class of :class:`~tfuse.optim.FlatOptimizer`
(never used alone): it hands out compact per-parameter state, carries the
FlatParams the parameters live in along, and rebuilds the flat state of a copy.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch


class OptimizerCopies:
    """The copy and pickle methods of :class:`~tfuse.optim.FlatOptimizer`."""

    # What they read and write of the optimizer (torch.optim's attributes and FlatOptimizer's own), and the
    # FlatOptimizer methods they call: _init_runtime, _bind, _load_entry.
    defaults: dict[str, Any]
    state: Any
    param_groups: list[dict[str, Any]]
    master_weights: bool
    capturable: bool
    _flats: list
    _spans: list

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim's picklable state, plus ``master_weights``.

        State tensors are handed out compact (cloned): each is a view of a whole
        flat state buffer, and pickle would otherwise write the whole buffer once
        per view. The flat buffers themselves are not part of the state; they are
        rebuilt by :meth:`__setstate__`.
        """
        state = {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for p, entry in self.state.items()
        }
        return {**self._raw_state(), "state": state}

    def _raw_state(self) -> dict[str, Any]:
        # The FlatParams the parameters live in travel along: copied in the same deepcopy call as the
        # parameters (or unpickled with them), they coalesce the copies again with the same layout, whichever
        # of the model, the FlatParams and the optimizer the call reaches first; the copy then holds them.
        return {
            "defaults": self.defaults,
            "state": self.state,
            "param_groups": self.param_groups,
            "master_weights": self.master_weights,
            "capturable": self.capturable,
            "flat_params": list(self._flats),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuilds an optimizer from :meth:`__getstate__`'s state (unpickling, copy.deepcopy).

        As with torch.optim, the copy holds the parameters it was given (the
        copies a deepcopy or unpickle made), bound to the copied FlatParams
        that hold them; parameters in none are coalesced into new ones, and the
        per-parameter state is copied into the new flat state buffers.
        """
        state = dict(state)
        saved_state = state.pop("state", {})
        flats = state.pop("flat_params", []) + state.pop("owned_flat_params", [])  # (the latter: older pickles)
        state.setdefault("master_weights", False)
        capturable = state.pop("capturable", None)
        super().__setstate__(state)
        self.capturable = bool(self.defaults.get("capturable", False)) if capturable is None else capturable
        self._init_runtime()
        self._flats = list(flats)
        for group in self.param_groups:
            for name, default in self.defaults.items():
                group.setdefault(name, default)
        self.state = collections.defaultdict(dict)
        self._bind([p for group in self.param_groups for p in group["params"]])
        place = {id(m.param): (s, m) for s in self._spans for m in s.members}
        for param, entry in saved_state.items():
            where = place.get(id(param))
            if where is not None and entry:
                self.state[param] = self._load_entry(*where, entry)

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizerCopies:
        """A deep copy like torch.optim's: copies of the parameters (shared with whatever else
        the same ``copy.deepcopy`` call copies, e.g. the model), copies of the state."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        # The views go to deepcopy as they are: it copies each flat buffer's storage once.
        copied.__setstate__(copy.deepcopy(self._raw_state(), memo))
        return copied
