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
    over whole contiguous runs of the buffers. ``master_weights`` and AMP
    work as in :class:`~tfuse.optim.FusedAdam`.

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

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool = False,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize)
        self._check_group(defaults)
        super().__init__(params, defaults, master_weights)

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
        spec = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
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

    def _torch_update(self, unit: _Unit, table: BlockTable, specs: list[dict[str, Any]], grad_scale: torch.Tensor | None) -> None:
        """torch's fused CPU SGD over whole runs of the flat buffers (one call per coefficient row)."""
        for spec, spans, params, grads in self._torch_runs(unit, table, specs, grad_scale):
            buffers = [unit.buffers["momentum_buffer"][s:e] for s, e in spans] if spec["momentum"] != 0 else []
            torch._fused_sgd_(
                params, grads, buffers, weight_decay=spec["weight_decay"], momentum=spec["momentum"], lr=spec["lr"],
                dampening=spec["dampening"], nesterov=spec["nesterov"], maximize=spec["maximize"],
                is_first_step=spec["is_first_step"], grad_scale=None if grad_scale is None else grad_scale.to(torch.float32),
            )


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
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool = False,
    ) -> None:
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                         master_weights=master_weights)
