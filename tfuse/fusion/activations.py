"""Recognising an activation in a traced graph or a container: which one, with what parameters.

A node (``call_module`` of ``nn.ReLU``, ``call_function`` of ``F.gelu``,
``call_method`` ``relu``...) is turned into an :class:`ActivationCall` when
tfuse has a fused kernel for it, into an :class:`Unsupported` naming it when
it is an activation tfuse cannot fuse yet, and into None otherwise.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

#: The activation's name in reports, by tfuse name.
DISPLAY = {
    "relu": "ReLU",
    "leaky_relu": "LeakyReLU",
    "gelu": "GELU",
    "gelu_tanh": "GELU(tanh)",
    "silu": "SiLU",
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
    "relu6": "ReLU6",
    "hardtanh": "Hardtanh",
    "hardswish": "Hardswish",
    "hardsigmoid": "Hardsigmoid",
    "mish": "Mish",
    "elu": "ELU",
}


@dataclasses.dataclass(frozen=True)
class ActivationCall:
    """A fusable activation: tfuse's name for it, leaky_relu's slope, and the node it is applied to."""

    act: str
    negative_slope: float | None
    source: Any  # the input node (graph), or None (a module in a container)

    @property
    def display(self) -> str:
        return DISPLAY[self.act]


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """An activation tfuse has no fused kernel for (yet)."""

    name: str


_PLAIN_MODULES: dict[type, str] = {
    nn.ReLU: "relu", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.ReLU6: "relu6",
    nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid", nn.Mish: "mish",
}  # fmt: skip
_UNSUPPORTED_MODULES = (
    nn.Hardtanh,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.PReLU,
    nn.Softplus,
    nn.GLU,
    nn.RReLU,
    nn.LogSigmoid,
    nn.Softsign,
    nn.Tanhshrink,
)  # fmt: skip  (Hardtanh and ELU: with other parameters than the kernels' defaults)
_PLAIN_FUNCTIONS: dict[Any, str] = {
    F.relu: "relu",
    torch.relu: "relu",
    torch.relu_: "relu",
    F.relu_: "relu",
    F.silu: "silu",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    F.relu6: "relu6",
    F.hardswish: "hardswish",
    F.hardsigmoid: "hardsigmoid",
    F.mish: "mish",
}
_UNSUPPORTED_FUNCTIONS = {F.selu: "selu", F.celu: "celu", F.softplus: "softplus", F.prelu: "prelu"}
#: Activations with parameters, fusable at the kernels' values: name -> (parameter names, fused values).
_PARAMETRIC = {"hardtanh": (("min_val", "max_val"), (-1.0, 1.0)), "elu": (("alpha",), (1.0,))}
_PLAIN_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid", "tanh": "tanh",
                  "tanh_": "tanh"}  # fmt: skip


#: timm's own activation modules (``timm.layers.activations``; what ``act_layer="gelu"`` builds), by class name:
#: each computes what tfuse's kernel of that name computes (GELU is ``F.gelu``, GELUTanh its tanh form, Swish
#: ``x * sigmoid(x)``, HardSwish ``x * relu6(x + 3) / 6``...). Recognised only with timm's module path.
_TIMM_MODULES = {"GELU": "gelu", "GELUTanh": "gelu_tanh", "Swish": "silu", "Sigmoid": "sigmoid", "Tanh": "tanh",
                 "HardSwish": "hardswish", "HardSigmoid": "hardsigmoid", "Mish": "mish"}  # fmt: skip
_TIMM_UNSUPPORTED = ("HardMish", "QuickGELU", "PReLU")


def _timm_activation(kind: type) -> str | None:
    """The timm activation class's name, when ``kind`` is one (module ``timm[.models].layers.activations``)."""
    module = kind.__module__
    if module.startswith("timm.") and module.endswith(".activations"):
        return kind.__name__
    return None


def is_timm_activation(module: nn.Module) -> bool:
    """One of timm's activation modules tfuse knows (fusable or not)."""
    name = _timm_activation(type(module))
    return name in _TIMM_MODULES or name in _TIMM_UNSUPPORTED


def of_module(module: nn.Module, source: Any = None) -> ActivationCall | Unsupported | None:
    """What activation ``module`` is (exact types: a subclass may compute something else)."""
    kind = type(module)
    if kind in _PLAIN_MODULES:
        return ActivationCall(_PLAIN_MODULES[kind], None, source)
    timm_name = _timm_activation(kind)
    if timm_name in _TIMM_MODULES:
        return ActivationCall(_TIMM_MODULES[timm_name], None, source)
    if timm_name in _TIMM_UNSUPPORTED:
        return Unsupported(timm_name)
    if kind is nn.LeakyReLU:
        return ActivationCall("leaky_relu", float(module.negative_slope), source)
    if kind is nn.Hardtanh:
        if (module.min_val, module.max_val) == (0.0, 6.0):
            return ActivationCall("relu6", None, source)
        if (module.min_val, module.max_val) == (-1.0, 1.0):
            return ActivationCall("hardtanh", None, source)
        return Unsupported(f"Hardtanh(min_val={module.min_val}, max_val={module.max_val})")
    if kind is nn.ELU:
        return ActivationCall("elu", None, source) if module.alpha == 1.0 else Unsupported(f"ELU(alpha={module.alpha})")
    if kind is nn.GELU:
        approximate = module.approximate
        if approximate in ("none", "tanh"):
            return ActivationCall("gelu" if approximate == "none" else "gelu_tanh", None, source)
        return Unsupported(f"GELU(approximate={approximate!r})")
    if isinstance(module, _UNSUPPORTED_MODULES):
        return Unsupported(kind.__name__)
    return None


def of_node(node: fx.Node, modules: dict[str, nn.Module]) -> ActivationCall | Unsupported | None:
    """What activation ``node`` applies, and to which node; None when it is not an activation."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source = node.args[0]
    if node.op == "call_module":
        return of_module(modules[node.target], source)
    if node.op == "call_function":
        target = node.target
        if target in _PLAIN_FUNCTIONS:
            return ActivationCall(_PLAIN_FUNCTIONS[target], None, source)
        if target is F.leaky_relu:
            slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
            return ActivationCall("leaky_relu", float(slope), source) if isinstance(slope, (int, float)) else None
        if target is F.gelu:
            approximate = node.kwargs.get("approximate", "none")
            if approximate in ("none", "tanh"):
                return ActivationCall("gelu" if approximate == "none" else "gelu_tanh", None, source)
            return Unsupported(f"gelu(approximate={approximate!r})")
        if target in (F.hardtanh, F.elu):
            return _parametric(node, "hardtanh" if target is F.hardtanh else "elu", source)
        if target in _UNSUPPORTED_FUNCTIONS:
            return Unsupported(_UNSUPPORTED_FUNCTIONS[target])
        return None
    if node.op == "call_method" and node.target in _PLAIN_METHODS and len(node.args) == 1 and not node.kwargs:
        return ActivationCall(_PLAIN_METHODS[node.target], None, source)
    return None


def in_place(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether the activation ``node`` may write its result into its input (``nn.ReLU(inplace=True)``,
    ``F.relu(x, inplace=True)``, ``torch.relu_``, ``x.relu_()``...): removing such a node changes what the
    input's other holders see."""
    if node.op == "call_module":
        return bool(getattr(modules[node.target], "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.target in (torch.relu_, F.relu_):
        return True
    return node.kwargs.get("inplace") is True or any(arg is True for arg in node.args[1:])


#: Tensor additions a residual or bias add is traced as.
ADDS = (operator.add, operator.iadd, torch.add)


def _parametric(node: fx.Node, name: str, source: fx.Node) -> ActivationCall | Unsupported:
    """F.hardtanh / F.elu: fusable at the kernels' parameter values (-1 and 1; alpha 1), named otherwise."""
    names, fused = _PARAMETRIC[name]
    values = tuple(
        node.args[1 + i] if len(node.args) > 1 + i else node.kwargs.get(param, default)
        for i, (param, default) in enumerate(zip(names, fused))
    )
    if values == fused:
        return ActivationCall(name, None, source)
    if name == "hardtanh" and values == (0.0, 6.0):
        return ActivationCall("relu6", None, source)
    shown = ", ".join(f"{param}={value}" for param, value in zip(names, values))
    return Unsupported(f"{name}({shown})")
