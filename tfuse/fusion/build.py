"""A traced model fused: the graphs rewritten with one set of module decisions, the fused model assembled.

The fused model's modules are new objects over the original's parameters and
buffers (``copy_tree``): fusing leaves the original as it was, and a hook or a
mode set on one model stays off the other. Where the forward traced to two
graphs (train and eval), a module is replaced only when both fuse it the same
way. A model in which nothing fused is returned as it was given.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import fx, nn

from tfuse.fusion.graph import Decisions, Rewriter
from tfuse.fusion.model import FusedGraphModule
from tfuse.fusion.report import FusionReport
from tfuse.fusion.strategy import FusionStrategy
from tfuse.fusion.tracing import Traced, copy_tree, node_shapes


def fuse_traced(
    model: nn.Module, traced: Traced, strategy: FusionStrategy, example_inputs: tuple[Any, ...] | None
) -> tuple[nn.Module, FusionReport]:
    """``model`` fused from its traced graphs; ``model`` itself where nothing fused.

    Raises:
        ValueError: the forward failed on ``example_inputs``.
    """
    graphs = [traced.train_graph] + ([traced.eval_graph] if traced.eval_graph is not None else [])
    shapes = [
        node_shapes(traced.shadow, copy.deepcopy(graph), example_inputs) if example_inputs is not None else None
        for graph in graphs
    ]
    tree = copy_tree(model)
    modules = dict(tree.named_modules(remove_duplicate=False))
    # A first pass on copies says what each graph would replace; a module is replaced only where every graph
    # that calls it replaces it alike (an auxiliary head that only the train graph calls is fused there).
    plans, called = [], []
    for graph, graph_shapes in zip(graphs, shapes):
        plan = Decisions()
        Rewriter(copy.deepcopy(graph), dict(modules), strategy, graph_shapes, FusionReport(), plan).run()
        plans.append(set(plan.made))
        called.append({node.target for node in graph.nodes if node.op == "call_module"})
    allowed = {
        key for plan in plans for key in plan
        if all(key in other or key[0] not in calls for other, calls in zip(plans, called))
    }  # fmt: skip
    decisions = Decisions(allowed=allowed)
    report = FusionReport(method="fx")
    for index, (graph, graph_shapes) in enumerate(zip(graphs, shapes)):
        own = report if index == 0 else FusionReport(method="fx")
        Rewriter(graph, dict(modules), strategy, graph_shapes, own, decisions).run()
        if own is not report:
            _merge(report, own)
    if not report.fused:
        return model, report
    for key, module in decisions.made.items():
        _set_submodule(tree, key[0], module)
    for graph in graphs:
        graph.lint()
    constants = _constants(graphs, tree, traced.shadow)
    fused = FusedGraphModule(
        tree,
        graphs[0],
        graphs[1] if len(graphs) > 1 else None,
        traced.traced_through,
        constants,
        class_name=type(model).__name__,
    )
    return fused, report


def _merge(report: FusionReport, other: FusionReport) -> None:
    """The eval graph's fusions and skips that the train graph's report does not already name."""
    seen = {(f.kind, f.where[0]) for f in report.fused}
    report.fused += [f for f in other.fused if (f.kind, f.where[0]) not in seen]
    report.skipped += [s for s in other.skipped if s not in report.skipped]


def _set_submodule(root: nn.Module, target: str, module: nn.Module) -> None:
    parent_name, _, leaf = target.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    parent._modules[leaf] = module  # in place in the parent's order (setattr would too, this says so)


def _constants(graphs: list[fx.Graph], tree: nn.Module, shadow: nn.Module) -> dict[str, Any]:
    """Tensors the tracer stored on its root for the graphs to read (``_tensor_constant0``...): none of the
    model's own attributes."""
    found = {}
    for graph in graphs:
        for node in graph.nodes:
            if node.op != "get_attr" or "." in node.target:
                continue
            if node.target in tree._parameters or node.target in tree._buffers or node.target in tree._modules:
                continue
            if hasattr(type(tree), node.target) or node.target in tree.__dict__:
                continue
            found[node.target] = getattr(shadow, node.target)
    return found
