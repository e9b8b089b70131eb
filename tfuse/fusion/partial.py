"""Fusion where the whole forward does not trace: inside the parts that are always called whole.

A forward that torch.fx cannot trace (data-dependent control flow, say) is
kept, and tfuse looks at its children instead. Fusing inside a child is
right only if the untraced code always calls that child whole; otherwise it
could run half of a fused pair (``self.features[:2](x)``, ``self.block[0](x)``,
``self.block.bn(x)``). :mod:`tfuse.fusion.calls` reads the parent's source to
tell. A child called whole is then, by its kind:

* an ``nn.Sequential``: its neighbours fused (its own forward calls each
  child whole, so its children are looked at the same way);
* a module whose forward traces: fused from its graphs, as a whole model is;
* another module: looked at the same way, one level down.

``nn.ModuleList``/``nn.ModuleDict`` children are reached by index or key,
which the source cannot follow: left as they are. The containers on the way
are new objects over the same layers (the original model is not changed).
With ``example_inputs``, one run of a shadow copy records each module's
inputs, so the parts that trace get shapes for their residual patterns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tfuse.fusion.build import fuse_traced
from tfuse.fusion.calls import called_whole_only
from tfuse.fusion.layers import act_switch
from tfuse.fusion.report import Fused, FusionReport, Skipped
from tfuse.fusion.strategy import FusionStrategy
from tfuse.fusion.structural import fuse_neighbours
from tfuse.fusion.tracing import copy_tree, example_inputs_error, has_hooks, trace_modes


def fuse_untraced(
    model: nn.Module, strategy: FusionStrategy, example_inputs: tuple[Any, ...] | None, note: str
) -> tuple[nn.Module, FusionReport]:
    """``model`` (whose forward does not trace) with the parts of it that are called whole fused; ``model``
    itself where nothing fused."""
    report = FusionReport(method="structural", note=note)
    inputs = _record_inputs(model, example_inputs) if example_inputs is not None else {}
    tree = copy_tree(model)  # new module objects over the same tensors: changed in place below
    _Walk(strategy, report, inputs).children(tree, "", lambda name: called_whole_only(type(model), name))
    return (tree if report.fused else model), report


class _Walk:
    def __init__(self, strategy: FusionStrategy, report: FusionReport, inputs: dict[str, tuple]) -> None:
        self.strategy, self.report, self.inputs = strategy, report, inputs

    def module(self, module: nn.Module, path: str, called_whole: bool) -> nn.Module:
        """What takes ``module``'s place at ``path``: itself, fused inside where that is safe, or a fused
        model of its graphs."""
        if not called_whole:
            if _has_candidates(module):
                self.report.skipped.append(Skipped(path, _NOT_WHOLE))
            return module
        if not module._modules or type(module).__module__.startswith("tfuse."):
            return module
        if type(module) is nn.Sequential:
            fuse_neighbours(module, path, self.strategy, self.report)
            self.children(module, path, lambda name: True)  # Sequential.forward calls each child whole
            return module
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            if _has_candidates(module):
                self.report.skipped.append(Skipped(path, _INDEXED))
            return module
        if not has_hooks(module):  # a module with hooks must run its own forward, which calls its hooks
            fused = self._traced(module, path)
            if fused is not None:
                return fused
        self.children(module, path, lambda name: called_whole_only(type(module), name))
        return module

    def children(self, module: nn.Module, path: str, whole) -> None:  # type: ignore[no-untyped-def]
        """Each child of ``module`` replaced by what takes its place (``whole(name)``: called whole only)."""
        for name, child in list(module._modules.items()):
            if child is not None and not type(child).__module__.startswith("tfuse."):
                module._modules[name] = self.module(child, _join(path, name), whole(name))

    def _traced(self, module: nn.Module, path: str) -> nn.Module | None:
        """``module`` fused from its own graphs; None when its forward does not trace."""
        try:
            traced = trace_modes(module)
        except Exception:
            return None
        fused, report = fuse_traced(module, traced, self.strategy, self.inputs.get(path))
        self.report.fused += [
            Fused(f.kind, tuple(_join(path, w) for w in f.where), f.replacement, f.residual) for f in report.fused
        ]
        self.report.skipped += [Skipped(_join(path, s.where), s.reason) for s in report.skipped]
        return fused


_NOT_WHOLE = (
    "is used by code tfuse cannot trace otherwise than by calling it whole (indexed, sliced, a part of it "
    "called, or reached by name): fusing inside it could split a fused pair, so it is left as it is"
)
_INDEXED = "is an nn.ModuleList/ModuleDict reached by code tfuse cannot trace: left as it is"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _has_candidates(module: nn.Module) -> bool:
    """Whether a norm or Linear lives in ``module`` (a fusion site tfuse should say it left alone)."""
    return any(act_switch(m) is not None for m in module.modules())


def _record_inputs(model: nn.Module, example_inputs: tuple[Any, ...]) -> dict[str, tuple]:
    """Each module's positional inputs in one run of a shadow copy on ``example_inputs`` (eval, no gradients);
    modules called with keyword arguments or several times are left out.

    Raises:
        ValueError: the forward failed on ``example_inputs``.
    """
    shadow = copy_tree(model, clone_buffers=True)
    seen: dict[str, tuple | None] = {}
    handles = []
    for name, module in shadow.named_modules():

        def record(_module, args, kwargs, name=name):  # type: ignore[no-untyped-def]
            seen[name] = None if (name in seen or kwargs) else tuple(args)

        handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        shadow.eval()
        with torch.no_grad():
            shadow(*example_inputs)
    except Exception as error:
        raise example_inputs_error(example_inputs, error) from error
    finally:
        for handle in handles:
            handle.remove()
    return {name: args for name, args in seen.items() if args is not None}
