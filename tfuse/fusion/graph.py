"""Fusion by rewriting a traced graph (torch.fx): what the forward computes, not module order.

Each activation node is looked at together with what it is applied to:

* a BatchNorm1d/2d, nn.GroupNorm or nn.LayerNorm call -> the fused norm
  layer with that activation;
* an add of such a norm call and another tensor of its shape (shapes from
  ``example_inputs``) -> the fused layer with ``residual=`` the other tensor;
* a BatchNorm2d call whose activation's only user is a depthwise nn.Conv2d
  call -> the convolution normalises and activates its input as it loads
  (``BatchNormBoundDepthwiseConv2d``; the batch norm module keeps its name);
* an nn.Linear call -> FusedLinear with that activation;
* otherwise, when the activation's only user is a depthwise nn.Conv2d call
  -> ``FusedActDepthwiseConv2d`` with that activation as ``act_in`` (a batch
  norm or Linear fusion keeps its activation);
* any other add of two tensors (shapes known) -> ``tfuse.add_act``.

And a norm module that applies its own activation (timm's
``BatchNormAct2d``, ``GroupNormAct``, ``LayerNormAct``) becomes the fused
layer. ``nn.Identity`` calls are read through (timm's ``drop_block`` between
a norm and its activation).

Left as they are, and reported: a layer called more than once or whose
output has another user (a branch); a layer or activation with hooks (a
fused call would skip them); an in-place add into a tensor that something
else also reads (fusing would change what it holds); a subclass of a batch,
group or layer norm or of Linear; timm's ``LayerNormAct2d`` (it permutes); a
grouped convolution after an activation that cannot take it.

The rewrite works on one graph at a time but shares its module decisions
(:class:`Decisions`): a forward that differs between train and eval mode has
two graphs over one module tree, and a module is replaced only where both
graphs fuse it the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import operator

import torch
from torch import fx, nn

from tfuse.functional import add_act
from tfuse.fusion import activations
from tfuse.fusion.layers import (
    act_switch,
    bound_depthwise,
    depthwise_mismatch,
    fused_depthwise,
    fused_layer,
    hooks_reason,
    in_place_reason,
    is_batch_norm,
    is_group_or_layer_norm,
    is_grouped_conv,
    is_linear,
    makes_new_tensor,
    norm_act_module,
    subclass_reason,
    unsupported_before_reason,
    unsupported_reason,
)
from tfuse.fusion.report import Fused, FusionReport, Skipped
from tfuse.fusion.strategy import FusionStrategy
from tfuse.fusion.tracing import has_hooks


@dataclasses.dataclass
class Decisions:
    """Module replacements shared by the graphs of one model.

    Attributes:
        allowed: the replacement keys a rewrite may make (None: any); a key is (module name, pattern).
        made: the keys made so far, with the module that replaces each name.
    """

    allowed: set[tuple] | None = None
    made: dict[tuple, nn.Module] = dataclasses.field(default_factory=dict)

    def replacement(self, key: tuple, build) -> nn.Module | None:  # type: ignore[no-untyped-def]
        """The module for ``key`` (built once, shared by every graph); None when ``key`` is not allowed."""
        if self.allowed is not None and key not in self.allowed:
            return None
        if key not in self.made:
            self.made[key] = build()
        return self.made[key]


class Rewriter:
    """Fuses the patterns of one graph whose modules are ``modules`` (name -> module, the fused tree's)."""

    def __init__(
        self,
        graph: fx.Graph,
        modules: dict[str, nn.Module],
        strategy: FusionStrategy,
        shapes: dict[str, torch.Size] | None,
        report: FusionReport,
        decisions: Decisions,
    ) -> None:
        self.graph, self.modules, self.strategy, self.shapes = graph, modules, strategy, shapes
        self.report, self.decisions = report, decisions
        self.calls = collections.Counter(n.target for n in graph.nodes if n.op == "call_module")
        self.replaced: dict[str, nn.Module] = {}

    def run(self) -> dict[str, nn.Module]:
        """Rewrites the graph; returns the modules to put in the tree (name -> replacement)."""
        self._read_through_identities()
        for node in list(self.graph.nodes):
            if node.graph is not self.graph or node.op == "output":
                continue  # erased by an earlier fusion
            if node.op == "call_module" and self._fuse_norm_act_module(node):
                continue
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
            # Precedence: the layer before the activation (a norm, Linear) keeps it; then a depthwise
            # convolution after it; then a plain add before it.
            if self._fuse_before(node, found, source) or self._fuse_depthwise(node, found):
                continue
            if _is_tensor_add(source) and self._add_norm(source) is None:
                self._fuse_add(node, found, source)
        return self.replaced

    # ------------------------------------------------------------------ patterns

    def _read_through_identities(self) -> None:
        """Calls of an ``nn.Identity`` (without hooks) removed: their users read the input itself."""
        for node in list(self.graph.nodes):
            if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
                continue
            module = self.modules[node.target]
            if type(module) is nn.Identity and not has_hooks(module):
                node.replace_all_uses_with(node.args[0])
                self.graph.erase_node(node)
                self.calls[node.target] -= 1

    def _fuse_before(self, node: fx.Node, found: activations.ActivationCall, source: fx.Node) -> bool:
        """The activation fused into the norm or Linear it follows (also through a residual add)."""
        if source.op == "call_module":
            layer = self.modules[source.target]
            switch = act_switch(layer)
            if switch is not None:
                if not getattr(self.strategy, switch):
                    self._skip(source.target, f"is followed by {found.display}; {switch} is off in the strategy")
                    return False
                if is_linear(layer):
                    return self._fuse_linear(node, found, source)
                return self._fuse_bn_depthwise(node, found, source) or self._fuse_norm(
                    node, found, source, residual=None
                )
            reason = subclass_reason(layer)
            if reason is not None:
                self._skip(source.target, reason)
            return False
        if _is_tensor_add(source) and self._add_norm(source) is not None:
            return self._fuse_add(node, found, source)
        return False

    def _add_norm(self, add_node: fx.Node) -> fx.Node | None:
        """The operand of ``add_node`` that is a (batch, group or layer) norm call, if any."""
        return next((n for n in add_node.args[:2] if n.op == "call_module" and _is_norm(self.modules[n.target])), None)

    def _fuse_norm_act_module(self, node: fx.Node) -> bool:
        """A norm module that applies its own activation (timm's BatchNormAct2d, GroupNormAct...) -> the fused
        layer."""
        module = self.modules[node.target]
        found = norm_act_module(module)
        switch = "fuse_bn_act" if isinstance(module, nn.modules.batchnorm._BatchNorm) else "fuse_norm_act"
        if found is None or not getattr(self.strategy, switch):
            return False
        if isinstance(found, (activations.Unsupported, str)):
            self._skip(node.target, found if isinstance(found, str) else unsupported_reason(found))
            return False
        # Its children too: the fused layer does not call its drop and act modules, so their hooks would not run.
        if not (self._callable_once(node) and self._without_hooks(node.target, module, *module.children())):
            return False
        fused = self._take(node.target, "norm-act", found, lambda: fused_layer(module, found)[0])
        if fused is None:
            return False
        kind = f"{type(module).__name__}({found.display})"
        self.report.fused.append(Fused(kind, (node.target,), type(fused).__name__))
        return True

    # ------------------------------------------------------------------ checks

    def _layer_name(self, node: fx.Node) -> str | None:
        if node.op == "call_module" and act_switch(self.modules[node.target]) is not None:
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

    def _without_hooks(self, where: str, *modules: nn.Module) -> bool:
        for module in modules:
            reason = hooks_reason(module)
            if reason is not None:
                self._skip(where, reason)
                return False
        return True

    def _act_module(self, act_node: fx.Node) -> tuple[nn.Module, ...]:
        """The activation's module, when it is one (its hooks count too)."""
        return (self.modules[act_node.target],) if act_node.op == "call_module" else ()

    # ------------------------------------------------------------------ rewrites

    def _replace(self, target: str, module: nn.Module) -> None:
        self.modules[target] = module
        self.replaced[target] = module

    def _take(self, target: str, pattern: str, found, build) -> nn.Module | None:  # type: ignore[no-untyped-def]
        """The module that replaces ``target`` for this pattern (shared by every graph), put in place; None,
        reported, where another graph of the model does not fuse ``target`` alike."""
        fused = self.decisions.replacement((target, pattern, found.act, found.negative_slope), build)
        if fused is None:
            self._skip(target, _MODE_REASON)
            return None
        self._replace(target, fused)
        return fused

    def _drop(self, act_node: fx.Node, replacement: fx.Node) -> None:
        act_node.replace_all_uses_with(replacement)
        self.graph.erase_node(act_node)

    def _fuse_norm(self, act_node, found, norm_node, residual: fx.Node | None, add_node: fx.Node | None = None) -> bool:
        """The activation (and the residual add before it) fused into the batch, group or layer norm
        ``norm_node``."""
        if not self._callable_once(norm_node) or not self._only_user(norm_node, add_node or act_node, norm_node.target):
            return False
        layer = self.modules[norm_node.target]
        if not self._without_hooks(norm_node.target, layer, *self._act_module(act_node)):
            return False
        pattern = "norm+residual" if residual is not None else "norm"
        fused = self._take(norm_node.target, pattern, found, lambda: fused_layer(layer, found)[0])
        if fused is None:
            return False
        kind = f"{type(layer).__name__}+{found.display}"
        where = [norm_node.target, act_node.name]
        if residual is not None:
            add_node.prepend(norm_node)  # after the residual is computed (a downsample may come after the norm)
            norm_node.args = (norm_node.args[0], residual)
            self._drop(act_node, norm_node)
            self.graph.erase_node(add_node)
            where.insert(1, add_node.name)
        else:
            self._drop(act_node, norm_node)
        self.report.fused.append(Fused(kind, tuple(where), type(fused).__name__, residual is not None))
        return True

    def _fuse_linear(self, act_node, found, linear_node) -> bool:
        if not self._callable_once(linear_node) or not self._only_user(linear_node, act_node, linear_node.target):
            return False
        layer = self.modules[linear_node.target]
        if not self._without_hooks(linear_node.target, layer, *self._act_module(act_node)):
            return False
        if self._take(linear_node.target, "linear", found, lambda: fused_layer(layer, found)[0]) is None:
            return False
        self._drop(act_node, linear_node)
        self.report.fused.append(Fused(f"Linear+{found.display}", (linear_node.target, act_node.name), "FusedLinear"))
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
            elif self._callable_once(conv_node) and self._without_hooks(
                conv_node.target, self.modules[conv_node.target], *self._act_module(act_node)
            ):
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
        conv = self.modules[conv_node.target]
        fused = self._take(conv_node.target, "depthwise", found, lambda: fused_depthwise(conv, found)[0])
        if fused is None:
            return False
        conv_node.args = (source,)
        self.graph.erase_node(act_node)
        self.report.fused.append(
            Fused(f"{found.display}+depthwise Conv2d", (act_node.name, conv_node.target), type(fused).__name__)
        )
        return True

    def _fuse_bn_depthwise(self, act_node: fx.Node, found, bn_node: fx.Node) -> bool:
        """BatchNorm2d -> activation -> depthwise conv: the convolution normalises and activates its input as it
        loads, bound to the batch norm (which stays in the tree under its name, uncalled). False (nothing
        reported) where the pattern is not there, so the batch norm + activation fusion is tried next."""
        if not (self.strategy.fuse_bn_act_depthwise_conv and self.strategy.fuse_relu_depthwise_conv):
            return False
        bn = self.modules[bn_node.target]
        if type(bn) is not nn.BatchNorm2d or len(act_node.users) != 1 or len(bn_node.users) != 1:
            return False
        (conv_node,) = act_node.users
        if not (
            conv_node.op == "call_module"
            and is_grouped_conv(self.modules[conv_node.target])
            and conv_node.args == (act_node,)
            and not conv_node.kwargs
            and len(bn_node.args) == 1
            and not bn_node.kwargs
        ):
            return False
        conv = self.modules[conv_node.target]
        if depthwise_mismatch(conv, found.display) is not None or self.calls[conv_node.target] != 1:
            return False
        if self.calls[bn_node.target] != 1 or has_hooks(bn) or has_hooks(conv):
            return False
        if any(has_hooks(m) for m in self._act_module(act_node)):
            return False
        fused = self._take(conv_node.target, "bn-depthwise", found, lambda: bound_depthwise(bn, conv, found))
        if fused is None:
            return False
        conv_node.args = (bn_node.args[0],)
        self.graph.erase_node(act_node)
        self.graph.erase_node(bn_node)
        self.report.fused.append(
            Fused(
                f"BatchNorm2d+{found.display}+depthwise Conv2d",
                (bn_node.target, act_node.name, conv_node.target),
                type(fused).__name__,
            )
        )
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
        switch = "fuse_add_act" if norm is None else _residual_switch(self.modules[norm.target])
        where = norm.target if norm is not None else add_node.name
        if not getattr(self.strategy, switch):
            if norm is not None:
                self._skip(where, f"is added to a residual before {found.display}; {switch} is off")
            return False
        if self.shapes is None:
            self._skip(where, "is followed by an add and an activation: fusing them needs example_inputs (shapes)")
            return False
        if len(add_node.users) != 1:
            self._skip(where, "has its add's result used besides the activation")
            return False
        if add_node.target is operator.iadd and not self._new_single_use(left):
            # ``x += y`` writes into x: whoever else holds x (an alias, the caller) sees the sum.
            self._skip(
                where,
                f"is added in place into {left.name}, which is also read elsewhere (fusing would "
                "leave it without the sum)",
            )
            return False
        out_shape = self.shapes.get(add_node.name)
        if norm is not None:
            other = right if norm is left else left
            if self.shapes.get(norm.name) != out_shape or self.shapes.get(other.name) != out_shape:
                self._skip(where, "is added to a tensor of another shape (a broadcast, not a residual)")
                return False
            return self._fuse_norm(act_node, found, norm, residual=other, add_node=add_node)
        if not self._without_hooks(where, *self._act_module(act_node)):
            return False
        full = next((n for n in (left, right) if self.shapes.get(n.name) == out_shape), None)
        if full is None:
            self._skip(where, "adds two tensors, neither of the result's shape")
            return False
        other = right if full is left else left
        with self.graph.inserting_before(act_node):
            kwargs = {"act": found.act}
            if found.negative_slope is not None:
                kwargs["negative_slope"] = found.negative_slope
            fused = self.graph.call_function(add_act, (full, other), kwargs)
        self._drop(act_node, fused)
        self.graph.erase_node(add_node)
        self.report.fused.append(Fused(f"add+{found.display}", (add_node.name, act_node.name), "tfuse.add_act"))
        return True


_MODE_REASON = "is fused in one mode's graph but not in the other's (the forward differs between train and eval)"


def _is_norm(module: nn.Module) -> bool:
    """A batch, group or layer norm (exact types) that can take a residual add and an activation."""
    return is_batch_norm(module) or is_group_or_layer_norm(module)


def _residual_switch(norm: nn.Module) -> str:
    """The FusionStrategy switch for ``norm`` -> residual add -> activation."""
    return "fuse_bn_add_act" if is_batch_norm(norm) else "fuse_norm_act"


def _is_tensor_add(node: fx.Node) -> bool:
    """``a + b`` of two graph values (no scalar, no ``alpha``)."""
    return (
        node.op == "call_function"
        and node.target in activations.ADDS
        and len(node.args) == 2
        and not node.kwargs
        and all(isinstance(a, fx.Node) for a in node.args)
    )
