"""Argument checks of the fused optimizers, in torch.optim's words where torch has them."""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# torch.optim's implementation switches; tfuse has one implementation (the fused update).
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def check_params(name: str, params: list[torch.Tensor]) -> None:
    """What a flat buffer needs of a group's parameters, beyond torch's own checks (Tensors, leaves)."""
    seen: set[int] = set()
    for param in params:
        if id(param) in seen:
            raise ValueError("optimizer contains a parameter group with duplicate parameters")
        seen.add(id(param))
        if param.is_complex() or param.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"`{name}` requires all the params to be floating point Tensors "
                f"(float16, bfloat16, float32 or float64), but got {param.dtype}"
            )
        if param.layout != torch.strided:
            raise ValueError(f"`{name}` does not support sparse parameters ({param.layout})")


def check_implementation_flags(name: str, torch_name: str, group: dict[str, Any]) -> None:
    """Checks torch.optim's implementation switches: accepts those tfuse honours, refuses the others.

    * ``foreach`` (None or a bool): accepted and ignored. It picks among torch's
      for-loop and multi-tensor implementations, which compute the same update;
      tfuse has one implementation, the fused update of whole flat buffers.
    * ``fused``: None or True (tfuse is always fused). False asks for an
      implementation tfuse does not have: ValueError.
    * ``fused=True`` with ``foreach=True``: torch's RuntimeError.
    * ``differentiable=True``: ValueError (see the message).
    * ``capturable``: a bool; True keeps the step counts and the step's
      coefficients on the device (see ``FlatOptimizer.step``).
    """
    foreach = group.get("foreach")
    fused = group.get("fused")
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"{name}: foreach must be None or a bool, got {foreach!r}")
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"{name}: fused must be None or a bool, got {fused!r}")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused is False:
        raise ValueError(
            f"{name}: fused=False asks for one of torch's non-fused implementations, which tfuse does not have: "
            f"{name} always updates whole flat buffers with one fused update per buffer. Pass fused=None or "
            f"fused=True (foreach is accepted and ignored), or use {torch_name} for its for-loop implementation."
        )
    if group.get("differentiable"):
        raise ValueError(
            f"{name}: differentiable=True is not supported: the fused update runs outside autograd (under "
            f"torch.no_grad), so no gradient flows through step(). Use {torch_name}(..., differentiable=True) to "
            "differentiate through optimizer steps."
        )
    check_capturable_flag(name, group.get("capturable", False))


def as_float(value: float | torch.Tensor) -> float:
    """A hyperparameter as a Python float (a 0-dim tensor lr is read once per step)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def check_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:  # (NaN is refused too)
        raise ValueError(f"Invalid learning rate: {lr}")


def check_non_negative(value: Any, what: str) -> None:
    if not value >= 0.0:
        raise ValueError(f"Invalid {what} value: {value}")


def check_capturable_flag(owner: str, capturable: Any) -> None:
    """``capturable`` as an argument of an optimizer whose torch counterpart has none (a bool)."""
    if not isinstance(capturable, bool):
        raise TypeError(f"{owner}: capturable must be a bool, got {capturable!r}")


def check_betas(owner: str, betas: Any, *, one_allowed: bool = False) -> None:
    """A pair (beta1, beta2), each in [0, 1) (or [0, 1] with ``one_allowed``), in torch's words."""
    if len(betas) != 2:
        raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        value = as_float(beta)
        if not (0.0 <= value <= 1.0 if one_allowed else 0.0 <= value < 1.0):
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
