"""Fusion by rewriting the traced computation (torch.fx): what the forward computes, not module order.

The model is traced symbolically (tfuse's own layers are leaves). Each
activation node is looked at together with what it is applied to:

* a BatchNorm1d/2d call -> the fused batch norm layer with that activation;
* an add of a BatchNorm call and another tensor of its shape (shapes from
  ``example_inputs``) -> the fused layer with ``residual=`` the other tensor;
* an nn.Linear call -> FusedLinear with that activation;
* otherwise, when the activation's only user is a depthwise nn.Conv2d call
  -> ``FusedActDepthwiseConv2d`` with that activation as ``act_in`` (a batch
  norm or Linear fusion keeps its activation: BN -> ReLU6 -> depthwise conv
  stays BN+ReLU6 then the plain conv, with the same memory and traffic);
* any other add of two tensors (shapes known) -> ``tfuse.add_act``.

A layer called more than once (a module reused), or one whose output has
another user besides the activation (a branch), is left as it is and
reported; so is a grouped convolution after an activation when it is not
depthwise with depth multiplier 1 and zero padding, or when the activation
has other users or is in place on a tensor that may be used elsewhere (dense
convolutions are not candidates, and not reported). The fused layers share
the original layers' parameters and buffers; the result is a
``torch.fx.GraphModule`` with the original's module names, so state dicts
load either way.
"""

from __future__ import annotations

import collections
import operator
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from tfuse.functional import add_act
from tfuse.fusion import activations
from tfuse.fusion.layers import (
    depthwise_mismatch,
    fused_depthwise,
    fused_layer,
    in_place_reason,
    is_batch_norm,
    is_grouped_conv,
    is_linear,
    makes_new_tensor,
    unsupported_before_reason,
    unsupported_reason,
)
from tfuse.fusion.report import Fused, FusionReport, Skipped
from tfuse.fusion.strategy import FusionStrategy


def trace(model: nn.Module) -> fx.GraphModule:
    """``model`` traced symbolically (raises what torch.fx raises when the forward does not trace)."""
    tracer = fx.Tracer()
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def fuse_graph(
    model: nn.Module, strategy: FusionStrategy, example_inputs: tuple[Any, ...] | None
) -> tuple[fx.GraphModule, FusionReport]:
    """The fused GraphModule of ``model`` and the report (raises if ``model`` does not trace)."""
    gm = trace(model)
    shapes = _shapes(gm, example_inputs) if example_inputs is not None else None
    report = FusionReport(method="fx")
    _Rewriter(gm, strategy, shapes, report).run()
    _keep_unused_modules(gm, model)
    gm.train(model.training)
    gm.graph.lint()
    gm.recompile()
    return gm, report


def _shapes(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> dict[fx.Node, torch.Size]:
    """Each node's output shape, from one run on ``example_inputs`` in eval mode without gradients (no
    running statistics move, nothing is kept)."""
    modes = {name: m.training for name, m in gm.named_modules()}
    try:
        gm.eval()
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
    finally:
        for name, module in gm.named_modules():
            module.training = modes[name]
    return {
        node: node.meta["tensor_meta"].shape
        for node in gm.graph.nodes
        if hasattr(node.meta.get("tensor_meta"), "shape")
    }


def _keep_unused_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Puts back the submodules the forward never calls (a GraphModule keeps only those it uses), so the
    fused model's state dict has every key of the original's."""
    for name, module in model.named_modules():
        if not name:
            continue
        parent_name, _, leaf = name.rpartition(".")
        try:
            gm.get_submodule(name)
            continue
        except AttributeError:
            pass
        parent = gm.get_submodule(parent_name) if parent_name else gm
        parent.add_module(leaf, module)


class _Rewriter:
    def __init__(
        self,
        gm: fx.GraphModule,
        strategy: FusionStrategy,
        shapes: dict[fx.Node, torch.Size] | None,
        report: FusionReport,
    ) -> None:
        self.gm, self.strategy, self.shapes, self.report = gm, strategy, shapes, report
        self.modules = dict(gm.named_modules())
        self.calls = collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_module")

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node.graph is not self.gm.graph or node.op == "output":
                continue  # erased by an earlier fusion
            found = activations.of_node(node, self.modules)
            if found is None:
                continue
            source = node.args[0]
            if isinstance(found, activations.Unsupported):
                layer = self._layer_name(source)
                if layer is not None:
                    self._skip(layer, unsupported_reason(found))
                self._fuse_depthwise(node, found)  # reports a depthwise convolution after it
                continue
            # Precedence: the layer before the activation (batch norm, Linear) keeps it; then a depthwise
            # convolution after it; then a plain add before it.
            if self._fuse_before(node, found, source) or self._fuse_depthwise(node, found):
                continue
            if _is_tensor_add(source) and self._add_norm(source) is None:
                self._fuse_add(node, found, source)

    def _fuse_before(self, node: fx.Node, found: activations.ActivationCall, source: fx.Node) -> bool:
        """The activation fused into the batch norm or Linear it follows (also through a residual add)."""
        if source.op == "call_module" and is_batch_norm(self.modules[source.target]):
            return self.strategy.fuse_bn_act and self._fuse_bn(node, found, source, residual=None)
        if source.op == "call_module" and is_linear(self.modules[source.target]):
            return self.strategy.fuse_linear_act and self._fuse_linear(node, found, source)
        if _is_tensor_add(source) and self._add_norm(source) is not None:
            return self._fuse_add(node, found, source)
        return False

    def _add_norm(self, add_node: fx.Node) -> fx.Node | None:
        """The operand of ``add_node`` that is a batch norm call, if any."""
        return next(
            (n for n in add_node.args[:2] if n.op == "call_module" and is_batch_norm(self.modules[n.target])), None
        )

    # ------------------------------------------------------------------ checks

    def _layer_name(self, node: fx.Node) -> str | None:
        if node.op == "call_module" and (
            is_batch_norm(self.modules[node.target]) or is_linear(self.modules[node.target])
        ):
            return node.target
        return None

    def _skip(self, where: str, reason: str) -> None:
        self.report.skipped.append(Skipped(where, reason))

    def _callable_once(self, layer: fx.Node) -> bool:
        count = self.calls[layer.target]
        if count > 1:
            self._skip(layer.target, f"is used {count} times (one module called at several places)")
            return False
        return True

    def _only_user(self, producer: fx.Node, consumer: fx.Node, what: str) -> bool:
        others = [u.name for u in producer.users if u is not consumer]
        if others:
            self._skip(what, f"has its output used besides the activation (by {', '.join(others)})")
            return False
        return True

    # ------------------------------------------------------------------ rewrites

    def _replace_module(self, target: str, module: nn.Module) -> None:
        parent_name, _, leaf = target.rpartition(".")
        parent = self.gm.get_submodule(parent_name) if parent_name else self.gm
        setattr(parent, leaf, module)
        self.modules[target] = module

    def _drop(self, act_node: fx.Node, replacement: fx.Node) -> None:
        act_node.replace_all_uses_with(replacement)
        self.gm.graph.erase_node(act_node)

    def _fuse_bn(self, act_node, found, bn_node, residual: fx.Node | None, add_node: fx.Node | None = None) -> bool:
        if not self._callable_once(bn_node) or not self._only_user(bn_node, add_node or act_node, bn_node.target):
            return False
        fused, kind = fused_layer(self.modules[bn_node.target], found)
        self._replace_module(bn_node.target, fused)
        where = [bn_node.target, act_node.name]
        if residual is not None:
            add_node.prepend(bn_node)  # after the residual is computed (a downsample may come after the norm)
            bn_node.args = (bn_node.args[0], residual)
            self._drop(act_node, bn_node)
            self.gm.graph.erase_node(add_node)
            where.insert(1, add_node.name)
        else:
            self._drop(act_node, bn_node)
        self.report.fused.append(Fused(kind, tuple(where), type(fused).__name__, residual is not None))
        return True

    def _fuse_linear(self, act_node, found, linear_node) -> bool:
        if not self._callable_once(linear_node) or not self._only_user(linear_node, act_node, linear_node.target):
            return False
        fused, kind = fused_layer(self.modules[linear_node.target], found)
        self._replace_module(linear_node.target, fused)
        self._drop(act_node, linear_node)
        self.report.fused.append(Fused(kind, (linear_node.target, act_node.name), "FusedLinear"))
        return True

    def _fuse_depthwise(self, act_node: fx.Node, found) -> bool:
        """The activation fused into the depthwise convolution that is its only user (``act_in``); a grouped
        convolution after it that cannot take it is reported."""
        if not self.strategy.fuse_relu_depthwise_conv:
            return False
        convs = [
            user
            for user in act_node.users
            if user.op == "call_module"
            and is_grouped_conv(self.modules[user.target])
            and user.args == (act_node,)
            and not user.kwargs
        ]
        if not convs:
            return False
        shown = found.name if isinstance(found, activations.Unsupported) else found.display
        candidates = []
        for conv_node in convs:
            reason = depthwise_mismatch(self.modules[conv_node.target], shown)
            if reason is not None:
                self._skip(conv_node.target, reason)
            elif isinstance(found, activations.Unsupported):
                self._skip(conv_node.target, unsupported_before_reason(found))
            elif self._callable_once(conv_node):
                candidates.append(conv_node)
        if not candidates:
            return False
        if len(act_node.users) > 1:  # a branch: the activation's output is needed anyway
            for conv_node in candidates:
                others = ", ".join(u.name for u in act_node.users if u is not conv_node)
                self._skip(
                    conv_node.target, f"follows {shown}, whose output is used besides the convolution (by {others})"
                )
            return False
        conv_node = candidates[0]
        source = act_node.args[0]
        if activations.in_place(act_node, self.modules) and not self._new_single_use(source):
            self._skip(conv_node.target, in_place_reason(shown))
            return False
        fused, kind = fused_depthwise(self.modules[conv_node.target], found)
        self._replace_module(conv_node.target, fused)
        conv_node.args = (source,)
        self.gm.graph.erase_node(act_node)
        self.report.fused.append(Fused(kind, (act_node.name, conv_node.target), type(fused).__name__))
        return True

    def _new_single_use(self, node: fx.Node) -> bool:
        """Whether ``node`` is a new tensor (a layer's output or an out-of-place add) used only once."""
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return False
        if node.op == "call_module":
            return makes_new_tensor(self.modules[node.target])
        return _is_tensor_add(node) and node.target is not operator.iadd

    def _fuse_add(self, act_node, found, add_node) -> bool:
        left, right = add_node.args[:2]
        norm = self._add_norm(add_node)
        wanted = self.strategy.fuse_bn_add_act if norm is not None else self.strategy.fuse_add_act
        if not wanted:
            return False
        where = norm.target if norm is not None else add_node.name
        if self.shapes is None:
            self._skip(where, "is followed by an add and an activation: fusing them needs example_inputs (shapes)")
            return False
        if len(add_node.users) != 1:
            self._skip(where, "has its add's result used besides the activation")
            return False
        out_shape = self.shapes.get(add_node)
        if norm is not None:
            other = right if norm is left else left
            if self.shapes.get(norm) != out_shape or self.shapes.get(other) != out_shape:
                self._skip(where, "is added to a tensor of another shape (a broadcast, not a residual)")
                return False
            return self._fuse_bn(act_node, found, norm, residual=other, add_node=add_node)
        full = next((n for n in (left, right) if self.shapes.get(n) == out_shape), None)
        if full is None:
            self._skip(where, "adds two tensors, neither of the result's shape")
            return False
        other = right if full is left else left
        with self.gm.graph.inserting_before(act_node):
            kwargs = {"act": found.act}
            if found.negative_slope is not None:
                kwargs["negative_slope"] = found.negative_slope
            fused = self.gm.graph.call_function(add_act, (full, other), kwargs)
        self._drop(act_node, fused)
        self.gm.graph.erase_node(add_node)
        self.report.fused.append(Fused(f"add+{found.display}", (add_node.name, act_node.name), "tfuse.add_act"))
        return True


def _is_tensor_add(node: fx.Node) -> bool:
    """``a + b`` of two graph values (no scalar, no ``alpha``)."""
    return (
        node.op == "call_function"
        and node.target in activations.ADDS
        and len(node.args) == 2
        and not node.kwargs
        and all(isinstance(a, fx.Node) for a in node.args)
    )
