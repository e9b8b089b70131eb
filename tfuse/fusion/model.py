"""FusedGraphModule: the fused forward over the original's module tree, in the original's order.

A ``torch.fx.GraphModule`` keeps only the modules its graph calls, recreates
the containers on the way as plain modules, and orders them by first use; it
also makes every tensor the graph reads a persistent buffer, and it pickles
by re-tracing its code, which rebuilds it that way again. So the fused model
adopts the tree it was built from (its containers, every module, every
parameter and buffer, in their registration order and persistence): its
``state_dict`` keys and ``named_parameters`` order are the original's, and a
checkpoint or an optimizer state dict of one loads onto the other.

A forward whose code branches on the train/eval mode traces to two graphs;
the fused model then holds both and runs the one of its current mode (the
modules whose code was traced must then be in the root's mode: a mixture is an
error, not a silent choice).

Example:
    >>> import torch, tfuse
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> fused, _ = tfuse.fuse_model(model)
    >>> [name for name, _ in fused.named_parameters()] == [name for name, _ in model.named_parameters()]
    True
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

#: nn.Module's hook registries (and the flag that says which kind its backward hooks are).
_ROOT_HOOKS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


class FusedGraphModule(fx.GraphModule):
    """A GraphModule over a whole module tree, with an eval-mode graph where the forward depends on the mode.

    Attributes:
        graph: the forward's graph (in train mode, where the two modes differ).
        eval_graph: the eval-mode graph, or None when one graph serves both modes.
    """

    def __init__(
        self,
        tree: nn.Module,
        graph: fx.Graph,
        eval_graph: fx.Graph | None = None,
        traced_through: list[str] | None = None,
        constants: dict[str, torch.Tensor] | None = None,
        class_name: str = "GraphModule",
    ) -> None:
        # GraphModule copies what the graph reads from ``tree`` (constants included, as the tracer left them
        # on its root); the tree itself then replaces what it built.
        source = _with_constants(tree, constants or {})
        super().__init__(source, graph, class_name)
        self.eval_graph = eval_graph
        self._tfuse_traced_through = list(traced_through or [])
        self._adopt(tree, constants or {})
        self.recompile()

    def _adopt(self, tree: nn.Module, constants: dict[str, torch.Tensor]) -> None:
        """This module's children, parameters and buffers become ``tree``'s, in its order; the tracer's
        constants are non-persistent buffers (they move with ``.to()`` but are no checkpoint keys)."""
        self._modules = dict(tree._modules)
        self._parameters = dict(tree._parameters)
        self._buffers = dict(tree._buffers)
        self._non_persistent_buffers_set = set(tree._non_persistent_buffers_set)
        for name in _ROOT_HOOKS:  # the model's own hooks fire on the fused model (called with it as module)
            if name in tree.__dict__:
                value = tree.__dict__[name]
                self.__dict__[name] = copy.copy(value) if isinstance(value, (dict, set)) else value
        self.training = tree.training
        for name, value in constants.items():
            self.register_buffer(name, value, persistent=False)
        graphs = [self.graph] + ([self.eval_graph] if self.eval_graph is not None else [])
        for node in (n for graph in graphs for n in graph.nodes):
            if node.op == "get_attr" and "." not in node.target and node.target in tree.__dict__:
                self.__dict__[node.target] = tree.__dict__[node.target]  # a plain attribute the forward reads

    def recompile(self):  # type: ignore[no-untyped-def]
        """Regenerates the forward from ``graph`` (and the eval forward from ``eval_graph``)."""
        code = super().recompile()
        cls = type(self)
        cls._tfuse_train_forward = cls.forward
        eval_graph = self.__dict__.get("eval_graph")
        if eval_graph is not None:
            eval_code = eval_graph.python_code(root_module="self")
            namespace = dict(eval_code.globals)
            exec(compile(eval_code.src, "<tfuse eval-mode forward>", "exec"), namespace)
            cls._tfuse_eval_forward = namespace["forward"]
            cls.forward = FusedGraphModule._forward_by_mode
        return code

    def _forward_by_mode(self, *args: Any, **kwargs: Any) -> Any:
        """The train-mode or the eval-mode graph, by this module's mode; the traced modules must share it."""
        training = self.training
        for name in self._tfuse_traced_through:
            if name and self.get_submodule(name).training != training:
                mode = "train" if training else "eval"
                raise RuntimeError(
                    f"tfuse: the fused model is in {mode} mode but its submodule {name!r} is not; its forward was "
                    "traced into the model's graphs, which follow the whole model's mode: call .train() or "
                    ".eval() on the fused model as a whole"
                )
        forward = type(self)._tfuse_train_forward if training else type(self)._tfuse_eval_forward
        return forward(self, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedGraphModule:
        result = FusedGraphModule.__new__(FusedGraphModule)  # a class of its own: recompile sets forward on it
        memo[id(self)] = result
        state = copy.deepcopy(self.__dict__, memo)
        result.__dict__.update(state)
        result.recompile()
        return result

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # The graphs travel as detached copies (a graph refers to its owning module, which is being pickled).
        state = {k: v for k, v in self.__dict__.items() if k not in ("_graph", "eval_graph")}
        eval_graph = self.eval_graph
        return (_rebuild, (state, _detached(self._graph), None if eval_graph is None else _detached(eval_graph)))

    def __copy__(self) -> FusedGraphModule:
        result = FusedGraphModule.__new__(FusedGraphModule)
        result.__dict__.update(self.__dict__)
        result.recompile()
        return result


def _detached(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` without its tracer's node metadata (it names classes by module path, which need
    not import where the model is loaded; the forward does not need it)."""
    copied = copy.deepcopy(graph)
    for node in copied.nodes:
        node.meta = {}
    return copied


def _rebuild(state: dict[str, Any], graph: fx.Graph, eval_graph: fx.Graph | None) -> FusedGraphModule:
    """Unpickles a FusedGraphModule: its state, its graphs, the forward generated again."""
    module = FusedGraphModule.__new__(FusedGraphModule)
    module.__dict__.update(state)
    module.__dict__["eval_graph"] = eval_graph
    module.graph = graph  # GraphModule's setter: owns the graph, recompiles
    return module


def _with_constants(tree: nn.Module, constants: dict[str, torch.Tensor]) -> nn.Module:
    """``tree`` as GraphModule's constructor reads it: with the tracer's constants (root attributes, named
    ``_tensor_constant0``...) reachable by their names, without touching ``tree``."""
    if not constants:
        return tree
    view = nn.Module()
    view._modules = dict(tree._modules)
    view._parameters = dict(tree._parameters)
    view._buffers = dict(tree._buffers)
    view._buffers.update(constants)
    return view
