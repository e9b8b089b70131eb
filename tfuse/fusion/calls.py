"""How a module's own code uses its children: only by calling them whole, or otherwise.

Where a forward cannot be traced, tfuse cannot see how it uses its children,
and fusing inside a child is right only if the child is always called whole:
``self.block(x)``. ``self.block[:2](x)``, ``self.block[0](x)``,
``self.block.bn(x)``, ``layer = self.block`` or ``getattr(self, name)`` could
run part of a fused pair alone. This reads the source of the module's class
(every method but ``__init__``, through its base classes outside torch) and
answers per child name.

Example:
    >>> import torch
    >>> from tfuse.examples.train import BasicBlock
    >>> from tfuse.fusion.calls import called_whole_only
    >>> called_whole_only(BasicBlock, "bn1"), called_whole_only(BasicBlock, "downsample")  # "is None" is no use
    (True, True)
    >>> called_whole_only(type("Local", (torch.nn.Module,), {}), "bn1")  # no source to read: not known
    False
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn

#: Attributes of ``self`` through which code can reach any child by name.
_DYNAMIC = {"_modules", "children", "named_children", "modules", "named_modules", "__dict__", "get_submodule",
            "_get_name", "apply"}  # fmt: skip


def called_whole_only(cls: type, child: str) -> bool:
    """Whether the code of ``cls`` uses its child ``child`` only as ``self.<child>(...)`` (False when the
    source is not available or the code reaches children dynamically)."""
    uses = _child_uses(cls)
    if uses is None:
        return False
    return uses.get(child, {"call"}) == {"call"}


@functools.lru_cache(maxsize=256)
def _child_uses(cls: type) -> dict[str, frozenset[str]] | None:
    """Per attribute name of ``self``: how the class's methods use it ("call" or "other"); None when the
    source cannot be read or the code reaches its children dynamically."""
    uses: dict[str, set[str]] = {}
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            return None
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return None
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or function.name == "__init__":
                continue
            if not _collect(function, uses):
                return None
    return {name: frozenset(kinds) for name, kinds in uses.items()}


def _is_check(node: ast.Attribute, parent: ast.AST | None) -> bool:
    """``self.x is None`` / ``is not None``, or ``self.x`` as the test of an if, while or boolean operator."""
    if isinstance(parent, ast.Compare):
        return all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops) and all(
            isinstance(c, ast.Constant) and c.value is None for c in [parent.left, *parent.comparators] if c is not node
        )
    if isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)):
        return parent.test is node
    return isinstance(parent, (ast.BoolOp, ast.UnaryOp))


def _collect(function: ast.AST, uses: dict[str, set[str]]) -> bool:
    """Adds the uses of ``self.<name>`` in ``function``; False when it reaches children dynamically."""
    parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(function):
        if isinstance(node, ast.Call):  # self handed to other code (getattr(self, name), helper(self)...)
            arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
            if any(isinstance(a, ast.Name) and a.id == "self" for a in arguments):
                return False
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
            continue
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            continue
        if node.attr in _DYNAMIC:
            return False
        parent = parents.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            kind = "call"
        elif _is_check(node, parent):
            continue  # ``self.child is None``, ``if self.child:``: reads no part of the child
        else:
            kind = "other"
        uses.setdefault(node.attr, set()).add(kind)
    return True
