"""FusedSGD and FusedMomentum: torch.optim.SGD semantics, one launch per flat buffer."""

from __future__ import annotations

from typing import Any

import torch

from tfuse import kernels
from tfuse._launch import launch
from tfuse.optim._flat_optimizer import BlockTable, FlatOptimizer, _Unit, as_float, check_lr, check_non_negative


class FusedSGD(FlatOptimizer):
    """SGD with optional momentum, dampening, Nesterov and weight decay, over flat buffers.

    Same constructor, update and state (``momentum_buffer`` per parameter,
    none without momentum) as ``torch.optim.SGD``; state dicts move between
    the two both ways. Each flat buffer is updated by one Triton launch per
    step; on CPU without the Triton interpreter, torch's fused CPU SGD runs
    over whole contiguous runs of the buffers. For float16/bfloat16 it is
    checked first and, when it gets them wrong, replaced by the same kernel on
    float32 copies, rounded back: torch 2.13's fused CPU SGD leaves
    low-precision parameters unchanged (see
    :func:`~tfuse.optim._flat_optimizer.native_low_precision_ok`).
    ``master_weights``, AMP and copies work as in :class:`~tfuse.optim.FusedAdam`.

    Args:
        params: parameters or parameter groups, as for torch.optim.
        lr: learning rate, a float or a 0-dim tensor (read once per step).
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs a momentum and zero dampening).
        maximize: maximize the objective.
        foreach: accepted for compatibility and ignored: it picks among
            torch's for-loop and multi-tensor implementations, which compute
            the same update; tfuse has one, the fused update of whole buffers.
        differentiable: must be False (the update runs outside autograd).
        fused: None or True; tfuse is always fused. False is refused (use
            ``torch.optim.SGD`` for torch's non-fused implementations).
        master_weights: float32 master copies for float16/bfloat16 parameters
            (see :class:`~tfuse.optim.FusedAdam`).

    Positional arguments bind as in ``torch.optim.SGD``; everything after
    ``nesterov`` is keyword-only, as there.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedSGD
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedSGD(layer.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state[layer.weight])
        ['momentum_buffer']
    """

    _uses_step = False
    _triton_kernel = "_sgd_kernel"

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float | torch.Tensor = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        self._check_group(defaults)
        super().__init__(params, defaults, master_weights)

    @classmethod
    def _torch_class_name(cls) -> str:
        return "torch.optim.SGD"

    def _check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["momentum"], "momentum")
        check_non_negative(group["weight_decay"], "weight_decay")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _has_state(self, group: dict[str, Any]) -> bool:
        return group["momentum"] != 0

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def _row(self, group: dict[str, Any], step: int, first: bool) -> tuple[list[float], dict[str, Any]]:
        lr, momentum = as_float(group["lr"]), as_float(group["momentum"])
        dampening, weight_decay = as_float(group["dampening"]), as_float(group["weight_decay"])
        row = [lr, momentum, 1.0 - dampening, weight_decay, 1.0 if group["nesterov"] else 0.0,
               -1.0 if group["maximize"] else 1.0, 1.0 if first else 0.0]
        spec = dict(kernel="_fused_sgd_", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]), is_first_step=first)
        return row, spec

    def _launch(self, unit: _Unit, table: BlockTable, rows: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        momentum_buffer = unit.buffers.get("momentum_buffer")
        launch(
            kernels._sgd_kernel,
            (table.n_blocks,),
            (
                unit.data, unit.grad, unit.data if momentum_buffer is None else momentum_buffer,
                unit.data if unit.master is None else unit.master,
                table.starts, table.ends, table.rows, rows, rows if grad_scale is None else grad_scale,
            ),
            dict(MOMENTUM=momentum_buffer is not None, **self._kernel_meta(unit, table, grad_scale)),
            unit.device,
        )

    # The PyTorch path: torch's fused SGD over whole runs of the flat buffers.

    def _torch_kernel(self, group: dict[str, Any]) -> str:
        return "_fused_sgd_"

    @staticmethod
    def _torch_state_names(spec: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if spec["momentum"] != 0 else ()

    @staticmethod
    def _torch_call(spec: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    states: dict[str, list[torch.Tensor]], grad_scale: torch.Tensor | None) -> None:
        torch._fused_sgd_(
            params, grads, states.get("momentum_buffer", []), weight_decay=spec["weight_decay"],
            momentum=spec["momentum"], lr=spec["lr"], dampening=spec["dampening"], nesterov=spec["nesterov"],
            maximize=spec["maximize"], is_first_step=spec["is_first_step"], grad_scale=grad_scale,
        )

    @staticmethod
    def _probe_specs(kernel: str) -> list[list[dict[str, Any]]]:
        # Every option changes the result by many ulps of float16 and bfloat16 (2 ulps pass the check).
        plain = dict(kernel=kernel, lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                     maximize=False, is_first_step=True)
        nesterov = dict(plain, momentum=0.9, weight_decay=0.5, nesterov=True, maximize=True)
        damped = dict(plain, momentum=0.8, dampening=0.3, weight_decay=0.3)
        return [[plain], [nesterov, dict(nesterov, is_first_step=False)], [damped, dict(damped, is_first_step=False)]]


class FusedMomentum(FusedSGD):
    """SGD with momentum (default 0.9), the seeds' ``momentum`` optimizer; see :class:`FusedSGD`.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedMomentum
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedMomentum(layer.parameters(), lr=0.1)
        >>> optimizer.param_groups[0]["momentum"]
        0.9
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float | torch.Tensor = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
    ) -> None:
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize, foreach=foreach,
                         differentiable=differentiable, fused=fused, master_weights=master_weights)
