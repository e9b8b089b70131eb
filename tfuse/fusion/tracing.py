"""Tracing a model for fusion without touching it: a shadow copy, leaves that must stay calls, both modes.

``torch.fx`` runs a module's Python while it traces, and traces through every
module that is not a leaf: branches on ``self.training`` become constants,
hooks of traced-through modules never fire again, and whatever the forward
writes (a cached attribute, an in-place buffer update) lands on the module.
So tfuse traces a *shadow*: new module objects over the same parameters, with
cloned buffers and copied attribute containers, once in train mode and once
in eval mode. A module is a leaf (called, not traced through) when torch.fx
would make it one, when it is a tfuse layer, a subclass of a batch, group or
layer norm (it may compute something else than its base, or branch on its
mode; timm's norm + activation modules are recognised whole), one of timm's
activation modules (recognised whole: Swish traced through would be a
multiply of a sigmoid), or when it has hooks (a call runs them).

Example:
    >>> import torch
    >>> from tfuse.fusion.tracing import trace_modes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> traced = trace_modes(model)
    >>> traced.eval_graph is None  # the same computation in both modes: one graph
    True
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch import fx, nn

from tfuse.fusion import activations

#: The hook dictionaries of an nn.Module: a module with any entry in one is called, never traced through.
HOOK_ATTRIBUTES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a forward, forward-pre, backward or backward-pre hook of its own."""
    return any(getattr(module, name, None) for name in HOOK_ATTRIBUTES)


def copy_tree(module: nn.Module, clone_buffers: bool = False, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """``module`` and its descendants as new module objects over the same parameters (and buffers, unless
    ``clone_buffers``), with their dict, list and set attributes copied (hooks registered on a copy stay
    off the original); a module reused at two places stays one object."""
    memo = {} if memo is None else memo
    found = memo.get(id(module))
    if found is not None:
        return found
    clone = copy_module(module)
    memo[id(module)] = clone
    clone._modules = {
        name: None if child is None else copy_tree(child, clone_buffers, memo)
        for name, child in module._modules.items()
    }
    if clone_buffers:
        clone._buffers = {name: None if b is None else b.detach().clone() for name, b in module._buffers.items()}
    return clone


def copy_module(module: nn.Module) -> nn.Module:
    """A new object of ``module``'s class with its attributes, its containers copied one level deep."""
    clone = object.__new__(type(module))
    for name, value in module.__dict__.items():
        if isinstance(value, (dict, list, set)):
            value = type(value)(value) if not hasattr(value, "copy") else value.copy()
        clone.__dict__[name] = value
    return clone


class InPlaceProxy(fx.Proxy):
    """A Proxy that records ``x += y`` as the in-place ``operator.iadd`` (torch.fx's own Proxy has no
    ``__iadd__``, so Python falls back to ``x = x + y``: another tensor, and an alias of x no longer sees the
    sum, which the traced graph would then compute differently from the forward)."""


def _in_place(op):  # type: ignore[no-untyped-def]
    def method(self, other):  # type: ignore[no-untyped-def]
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift",
              "irshift"):  # fmt: skip
    setattr(InPlaceProxy, f"__{_name}__", _in_place(getattr(operator, _name)))


#: Norm layers whose subclasses are leaves too (torch.fx makes torch's own ones leaves).
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


class LeafTracer(fx.Tracer):
    """torch.fx's tracer with tfuse's leaves and in-place augmented assignments; records the modules it
    traces through."""

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return InPlaceProxy(node, self)

    def __init__(self) -> None:
        super().__init__()
        self.traced_through: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if type(m).__module__.startswith("tfuse."):
            return True
        if isinstance(m, _NORMS) or has_hooks(m) or activations.is_timm_activation(m):
            return True
        leaf = super().is_leaf_module(m, module_qualified_name)
        if not leaf and module_qualified_name not in self.traced_through:
            self.traced_through.append(module_qualified_name)
        return leaf


@dataclasses.dataclass
class Traced:
    """A model traced in both modes.

    Attributes:
        train_graph: the graph of the forward in train mode.
        eval_graph: the graph in eval mode, or None when it is the same computation as in train mode.
        traced_through: the modules whose forward was traced (their Python is no longer called; with two
            graphs, their train/eval flag must follow the root's).
        shadow: the shadow the graphs were traced on (new modules, cloned buffers).
    """

    train_graph: fx.Graph
    eval_graph: fx.Graph | None
    traced_through: list[str]
    shadow: nn.Module


def trace_modes(model: nn.Module) -> Traced:
    """``model`` traced in train and in eval mode on a shadow copy (raises what torch.fx raises)."""
    shadow = copy_tree(model, clone_buffers=True)
    graphs = []
    traced_through: list[str] = []
    for training in (True, False):
        shadow.train(training)
        tracer = LeafTracer()
        graphs.append(tracer.trace(shadow))
        traced_through += [name for name in tracer.traced_through if name not in traced_through]
    shadow.train(model.training)
    train_graph, eval_graph = graphs
    same = signature(train_graph) == signature(eval_graph)
    return Traced(train_graph, None if same else eval_graph, traced_through, shadow)


def signature(graph: fx.Graph) -> list[tuple]:
    """What a graph computes, node by node, with nodes named by their position (names may differ)."""
    index = {node: i for i, node in enumerate(graph.nodes)}

    def arg(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return ("node", index[value])
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(arg(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple(sorted((k, arg(v)) for k, v in value.items())))
        if isinstance(value, (int, float, str, bool, type(None), torch.dtype, torch.device)):
            return value
        return ("object", type(value).__name__, repr(value))

    return [(node.op, str(node.target), arg(node.args), arg(node.kwargs)) for node in graph.nodes]


def node_shapes(shadow: nn.Module, graph: fx.Graph, example_inputs: tuple[Any, ...]) -> dict[str, torch.Size]:
    """Each node's output shape (by node name) from one run of ``graph`` on ``example_inputs``, on the shadow,
    its leaves in eval mode, without gradients.

    Raises:
        ValueError: the forward failed on ``example_inputs`` (the message names their shapes and the error).
    """
    gm = fx.GraphModule(shadow, graph)
    gm.eval()
    recorder = _ShapeRecorder(gm)
    try:
        with torch.no_grad():
            recorder.run(*example_inputs)
    except Exception as error:
        raise example_inputs_error(example_inputs, error) from error
    return recorder.shapes


class _ShapeRecorder(fx.Interpreter):
    """Runs a graph and keeps each tensor-valued node's shape (torch's ShapeProp prints a traceback of its own
    when a node fails; this one leaves the error to its caller)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.shapes: dict[str, torch.Size] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            self.shapes[n.name] = result.shape
        return result


def example_inputs_error(example_inputs: tuple[Any, ...], error: Exception) -> ValueError:
    """The error for a forward that failed on the user's ``example_inputs``: their shapes and torch's words."""
    described = ", ".join(
        f"tensor of shape {list(x.shape)} ({x.dtype})" if isinstance(x, torch.Tensor) else type(x).__name__
        for x in example_inputs
    )
    words = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return ValueError(
        f"tfuse.fuse_model: the model's forward failed on example_inputs ({described}): {type(error).__name__}: {words}"
    )
